"""The record a trace returns (events in order, step boundaries, totals, warnings) and its build."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oomkit.core.trace import TraceEvent, new_trace_event
from oomkit.prediction.tracing.categories import Category, Phase
from oomkit.prediction.tracing.emulation_sites import EmulationSite

if TYPE_CHECKING:
    from oomkit.prediction.tracing.storages import Allocation

__all__ = ["TraceRecording", "build_recording"]


@dataclass(frozen=True)
class TraceRecording:
    """An allocation trace of user code run on the meta device.

    Attributes:
        events: ``alloc`` / ``free_requested`` / ``free_completed`` events in execution order.
            ``address`` is an opaque allocation id, unique within the recording; ``size`` is the
            storage's ``nbytes``. Alloc tags: ``category``, ``phase`` and, where known,
            ``module`` (``named_modules()`` path, ``""`` for the root) and ``op`` (aten
            overload). Free events carry the allocation's ``category``.
        warnings: things that ran but are not modelled, one line each.
        step_starts: index into ``events`` where each step begins; events before the first are
            storages that existed before tracing (parameters of a model built earlier).
        bytes_by_category: bytes allocated per category over the whole recording.
        kernel_choices: the CUDA kernels the emulations chose for the target GPU, with how many
            calls each (``{"SDPA flash_attention": 24}``).
        assumptions: facts about the target those choices rest on, e.g. ``{"cuDNN": "9.20.0
            (torch 2.13's default Linux wheel)"}`` where the cuDNN version picked the kernel.
        sites: the calls of emulated kernels whose temporaries depend on a size, in order
            (``oomkit.prediction.tracing.emulation_sites``): a batch search synthesizes them at other
            batches.
        collective_ids: where the peak depends on the GPU's timing, the allocations whose
            frees wait on a collective's event (``stream_timeline.py``); ``None`` where timing
            changes nothing.
        timing_note: what the recording assumes about that timing, in words (distributed).
        outside_allocator: ``(what, bytes, source)`` of device memory the step allocates
            outside PyTorch's caching allocator (async TP's symmetric-memory workspace).
        memory_fraction: the share of the GPU the step limited the allocator to
            (``torch.cuda.set_per_process_memory_fraction``, the last call's); ``None``: none.
    """

    events: tuple[TraceEvent, ...]
    warnings: tuple[str, ...] = ()
    step_starts: tuple[int, ...] = ()
    bytes_by_category: Mapping[Category, int] = field(default_factory=dict)
    kernel_choices: Mapping[str, int] = field(default_factory=dict)
    assumptions: Mapping[str, str] = field(default_factory=dict)
    sites: tuple[EmulationSite, ...] = ()
    collective_ids: frozenset[int] | None = None
    timing_note: str | None = None
    outside_allocator: tuple[tuple[str, int, str], ...] = ()
    memory_fraction: float | None = None

    @property
    def steps(self) -> int:
        """How many steps were recorded."""
        return len(self.step_starts)

    def step_events(self, step: int) -> tuple[TraceEvent, ...]:
        """The events of one step (0-based), from its start to the next step's start."""
        start = self.step_starts[step]
        end = self.step_starts[step + 1] if step + 1 < len(self.step_starts) else len(self.events)
        return self.events[start:end]

    def allocated_bytes(
        self,
        category: Category | None = None,
        *,
        phase: Phase | None = None,
        step: int | None = None,
    ) -> int:
        """Bytes allocated (not net of frees), optionally filtered.

        Args:
            category: only allocations of this category.
            phase: only allocations made in this phase (``user``, ``forward``, ``backward``,
                ``optimizer``).
            step: only allocations made in this step (0-based); ``None`` for the whole trace,
                including storages that existed before tracing.
        """
        events = self.events if step is None else self.step_events(step)
        total = 0
        for event in events:
            if event.action != "alloc":
                continue
            tags = dict(event.tags)
            if category is not None and tags.get("category") != category:
                continue
            if phase is not None and tags.get("phase") != phase:
                continue
            total += event.size
        return total

    def peak_allocated_bytes(self) -> int:
        """The most bytes live at once (before the caching allocator's rounding)."""
        live = peak = 0
        for event in self.events:
            if event.action == "alloc":
                live += event.size
                peak = max(peak, live)
            elif event.action == "free_requested":
                live -= event.size
        return peak


def build_recording(
    log: Sequence[tuple[Any, ...]],
    module_tag: Callable[[Allocation, Category], str | None],
    *,
    warnings: tuple[str, ...],
    kernel_choices: dict[str, int],
    assumptions: dict[str, str],
    sites: Sequence[tuple[str, tuple[int, ...], int]] = (),
) -> TraceRecording:
    """The recording of a recorder's log, once the step is over and categories are known.

    Args:
        log: ``("alloc", alloc)``, ``("free", alloc, frames)``, ``("step",)``,
            ``("empty_cache",)``, ``("memory_fraction", f)`` and ``("allocator_settings",
            text)`` in order.
        module_tag: the ``module`` tag of an allocation of a category (None: no tag).
        warnings: kernel_choices: assumptions: as in :class:`TraceRecording`.
        sites: (kind, params, the allocation id of its anchor) of each site
            (``CudaEmulationEngine.sites``); one whose anchor was not recorded is left out.
    """
    events: list[TraceEvent] = []
    step_starts: list[int] = []
    memory_fraction: float | None = None
    allocated_before = False
    categories: dict[int, Category] = {}
    totals: dict[Category, int] = {}
    for entry in log:
        kind = entry[0]
        if kind == "step":
            step_starts.append(len(events))
            continue
        if kind == "empty_cache":  # torch.cuda.empty_cache() in the step (step_memory.py)
            events.append(new_trace_event("empty_cache", 0, 0, 0, None, (), ()))
            continue
        if kind == "allocator_settings":  # _set_allocator_settings(text) (step_memory.py)
            setting = (("setting", entry[1]),)
            events.append(new_trace_event("allocator_settings", 0, 0, 0, None, (), setting))
            continue
        if kind == "memory_fraction":  # set_per_process_memory_fraction (step_memory.py)
            memory_fraction = entry[1]
            allocated_before = allocated_before or any(e.action == "alloc" for e in events)
            continue
        alloc: Allocation = entry[1]
        category = categories.get(alloc.alloc_id)
        if category is None:
            category = categories[alloc.alloc_id] = alloc.category
        if kind == "alloc":
            totals[category] = totals.get(category, 0) + alloc.size_bytes
            tags: list[tuple[str, str]] = [("category", category), ("phase", alloc.phase)]
            module = module_tag(alloc, category)
            if module is not None:
                tags.append(("module", module))
            if alloc.op is not None:
                tags.append(("op", alloc.op))
            if alloc.param_name is not None and category in ("gradient", "optimizer_state"):
                # The parameter it serves, named in the module tag's module (``weight``).
                tags.append(("parameter", alloc.param_name))
            if alloc.optimizer is not None:
                tags.append(("optimizer", alloc.optimizer))
            if "saved" in alloc.roles:
                tags.append(("saved_for_backward", "true"))
            if alloc.emulated is not None:
                tags.append(("emulated", alloc.emulated))
            events.append(
                new_trace_event(
                    "alloc", alloc.alloc_id, alloc.size_bytes, alloc.stream, None, alloc.frames, tuple(tags)
                )
            )
        else:
            frames = entry[2]
            tags_free = (("category", category),)
            for action in ("free_requested", "free_completed"):
                events.append(
                    new_trace_event(
                        action, alloc.alloc_id, alloc.size_bytes, alloc.stream, None, frames, tags_free
                    )
                )
    alloc_index = {e.address: i for i, e in enumerate(events) if e.action == "alloc"} if sites else {}
    if memory_fraction is not None:
        assumptions = {
            **assumptions,
            "memory fraction": (
                f"torch.cuda.set_per_process_memory_fraction({memory_fraction}): the replay "
                "limits the allocator to that share of the GPU's total memory from the start"
                + (
                    " (the step set it after allocating; those allocations are held to it too "
                    "here)"
                    if allocated_before
                    else ""
                )
            ),
        }
    return TraceRecording(
        events=tuple(events),
        warnings=warnings,
        step_starts=tuple(step_starts),
        bytes_by_category=totals,
        kernel_choices=kernel_choices,
        assumptions=assumptions,
        sites=tuple(
            EmulationSite(kind, alloc_index[alloc_id], params)
            for kind, params, alloc_id in sites
            if alloc_id in alloc_index
        ),
        memory_fraction=memory_fraction,
    )
