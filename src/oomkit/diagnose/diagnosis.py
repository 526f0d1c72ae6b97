"""Why an out-of-memory error happened, from the figures of its message.

``diagnose_oom_text`` classifies the causes that the numbers of one OOM message can show
(``shortage``, ``fragmentation``, ``outside_pytorch``, ``fraction_limit``,
``request_exceeds_device``), strongest first, each with its evidence in bytes, and prices the
remedies those numbers support. ``leak`` and ``transient_spike`` need a trace over time (a
snapshot or a prediction); a message alone cannot show them.

The quantities (ref §12.2): ``Q`` requested (for the native allocator the segment size it could
not get), ``T`` total and ``F`` free device memory, ``A`` allocated, ``R`` reserved,
``U = R - A - P`` reserved but unallocated, ``O = T - F - R`` held outside this process's caching
allocator, ``C`` the CUDA context's expected share of ``O`` (oomkit.core.gpus, an estimate), ``L`` the
memory-fraction limit. The deficit is ``Q - F``: what the device lacked when the request came.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from oomkit.diagnose._context import (
    context_range,
    figure_warnings,
    inconsistency,
    matched_gpu,
    memory_paragraph,
    own_and_others,
)
from oomkit.diagnose._remedy_code import setting_code, workload_code
from oomkit.diagnose.oom_text import OomText, failed_library
from oomkit.diagnose.records import CAUSES, Cause, Finding, Remedy
from oomkit.errors import OomTextError
from oomkit.units import format_bytes

if TYPE_CHECKING:
    # Annotations only: `oomkit explain TEXT` never attributes, and attribution imports the
    # snapshot reader (issue 19 item 4: start-up); a snapshot's diagnosis has no traceback to
    # locate and needs no GPU catalog (issue 41 item 4).
    from oomkit.core.gpus import GpuSpec
    from oomkit.diagnose.attribution import Attribution
    from oomkit.diagnose.oom_traceback import OomLocation

__all__ = ["Cause", "CAUSES", "Finding", "Remedy", "Diagnosis", "diagnose_oom_text"]

@dataclass(frozen=True)
class Diagnosis:
    """The answer for one OOM: the main cause, every cause that applies, and ranked remedies.

    Attributes:
        cause: the strongest finding's cause.
        causes: every cause that applies, strongest first.
        remedies: what to change, by ``saving_bytes`` (largest first).
        memory_explained: allocated vs reserved vs nvidia-smi, with the user's numbers.
        deficit_bytes: what the device lacked when the request came; None where unknown.
        warnings: what the diagnosis assumed or could not see.
        source: what was diagnosed: ``"text"`` (an OOM message), ``"snapshot"`` or
            ``"prediction"``.
        attribution: what was live at the OOM (or the peak), for snapshots; None otherwise.
        figures_bytes: the figures at the moment diagnosed (``requested_bytes``,
            ``allocated_bytes``, ``reserved_bytes``, ``free_bytes``, ``total_bytes``,
            ``largest_free_block_bytes``...), where known.
        location: for a pasted traceback, the user's line where the OOM surfaced and the phase.
        gpu_name: the GPU the figures were read for (given, or matched by the message's total
            memory); None where unknown.
    """

    cause: Cause
    causes: tuple[Finding, ...]
    remedies: tuple[Remedy, ...]
    memory_explained: str
    deficit_bytes: int | None
    warnings: tuple[str, ...] = ()
    source: Literal["text", "snapshot", "prediction"] = "text"
    attribution: Attribution | None = None
    figures_bytes: Mapping[str, int | None] = field(default_factory=dict)
    location: OomLocation | None = None
    gpu_name: str | None = None

    def __repr__(self) -> str:
        """One line, as a REPL shows it: the cause, its evidence, the first remedy
        (``<Diagnosis: fragmentation: 1.90 GiB was reserved...; first remedy: ...>``); the
        fields are the attributes, and ``render_diagnosis`` prints them all."""
        first = self.remedies[0] if self.remedies else None
        saves = (
            "" if first is None or not first.saving_bytes
            else f" (saves {'~' if first.estimate else ''}{format_bytes(first.saving_bytes)})"
        )
        remedy = "" if first is None else f"; first remedy: {first.title}{saves}"
        more = f", {len(self.remedies) - 1} more" if len(self.remedies) > 1 else ""
        return f"<Diagnosis: {self.cause}: {self.causes[0].summary}{remedy}{more}>"


_DECISIVE = 2**62  # ranks a finding above any byte count
# Memory outside the allocator above the context's upper bound is named only from this much on;
# less is counted with the context (issue 14 item 5: only what clearly exceeds it is a cause).
_OUTSIDE_NOTABLE_BYTES = 256 * 2**20
# The cache (reserved but unallocated) is fragmentation only from 5% of reserved memory or 1 GiB
# on: below both it is the ordinary overhead of rounding and per-size pools (a full GPU with a
# 1-3% cache is a shortage, not fragmentation; issue 14 item 5's real messages).
_CACHE_SHARE = 0.05
_CACHE_NOTABLE_BYTES = 2**30
# Above this share of the device in tensors, the workload's own remedies are offered whatever
# the cause (issue 35 item 6): the room any other remedy wins is small next to the tensors.
_WORKLOAD_SHARE = 0.8


def diagnose_oom_text(
    parsed: OomText,
    gpu: GpuSpec | None = None,
    *,
    expandable_segments: bool | None = None,
    location: OomLocation | None = None,
) -> Diagnosis:
    """Classify the causes of the OOM a message describes and price the remedies.

    Args:
        parsed: the message's figures (``parse_oom_text``).
        gpu: the device, when known; otherwise one is matched by the message's total memory, for
            its CUDA-context range.
        expandable_segments: whether the failing run already had ``expandable_segments:True``
            (a snapshot's recorded settings, or ``explain --alloc-conf``); None: not known.
            PyTorch's message always suggests it; when it was on, the diagnosis says so instead
            of offering it.
        location: where the traceback around the message shows the OOM surfaced
            (``oom_traceback.find_oom_location``); reported as given.

    Returns:
        The diagnosis; its ``cause`` is the strongest finding.

    Raises:
        OomTextError: the message's figures contradict each other (more free than the device
            has, more held than a device that cannot page to system memory has): it was
            edited or corrupted, and a diagnosis of it would be a confident wrong answer.
    """
    # Only a message read from text is checked: figures built from a snapshot's trace (its
    # ``text`` is empty) come from one allocator's own accounting.
    wrong = inconsistency(parsed, gpu) if parsed.text else None
    if wrong is not None:
        raise OomTextError(
            f"the out-of-memory message is inconsistent: {wrong}. It was edited or corrupted; "
            "paste the message as PyTorch printed it, or explain a snapshot file instead"
        )
    if parsed.variant == "exa" or (
        parsed.requested_bytes is not None
        and parsed.total_bytes is not None
        and parsed.requested_bytes > parsed.total_bytes
    ):
        diagnosis = _exceeds_device(parsed)
    elif parsed.variant == "driver":
        diagnosis = _driver_error(parsed)
    elif parsed.variant == "fraction_rejected":
        diagnosis = _fraction_rejected(parsed)
    else:
        diagnosis = _from_figures(parsed, gpu, expandable_segments, location)
    spec = matched_gpu(parsed, gpu)
    return replace(
        diagnosis,
        location=location,
        gpu_name=None if spec is None or spec.compute_capability is None else spec.name,
    )


def _from_figures(
    parsed: OomText,
    gpu: GpuSpec | None,
    expandable_segments: bool | None = None,
    location: OomLocation | None = None,
) -> Diagnosis:
    """Causes ranked by what would have let the request succeed.

    The deficit ``Q - F`` splits exactly into three parts: the cache held but unusable
    (``U``), memory clearly held by others (``E``: outside the allocator above this process's
    context and libraries) and the rest, ``over = A + P + Q - (T - context)``: what the
    process's own tensors lacked even with a perfect cache and the device to itself. A cache
    below 5% of reserved memory (and 1 GiB) is ordinary overhead and counts as held. A positive
    ``over`` is a shortage and leads (neither defragmenting nor freeing others would do);
    otherwise the parts that alone would have covered the deficit rank first.
    """
    q = parsed.requested_bytes or 0
    t = parsed.total_bytes or 0
    f = parsed.free_bytes or 0
    a = parsed.allocated_bytes or 0
    p = parsed.private_pool_bytes
    # cudaMallocAsync keeps no cache PyTorch sees: treat reserved as allocated.
    r = parsed.reserved_bytes if parsed.reserved_bytes is not None else a
    u = max(0, r - a - p)
    o = max(0, t - f - r)
    context = context_range(parsed, gpu)
    own, others = own_and_others(parsed, r)
    # This process's own non-PyTorch memory (NVML's sentence, when printed) or, without it, all
    # outside memory up to the context's upper bound, is its context and libraries: not freeable.
    # NVML's own sentence below the reserved memory ("this process has 0 bytes memory in use",
    # in containers) cannot be true: it is ignored.
    own_outside = o if own is None or own < r else own - r
    context_used = min(o, own_outside, context.high_bytes)
    if o - context_used < _OUTSIDE_NOTABLE_BYTES:
        # Not clearly someone else's (a desktop, a driver's pages): counted with the context.
        context_used = o
    excess_outside = o - context_used
    deficit = max(0, q - f)
    limit = (
        parsed.allowed_bytes
        if parsed.allowed_bytes is not None and parsed.allowed_bytes < t
        else None
    )
    device_usable = t - context_used
    available = device_usable if limit is None else min(device_usable, limit)
    # The per-process memory fraction's limit is what the tensors are held against.
    limited = limit is not None and limit < device_usable
    # A cache below both marks is what a healthy caching allocator keeps (block rounding, the
    # small and large pools, split remainders): it counts as held, not as fragmentation.
    # A cache at least as large as the request is fragmentation whatever its share: PyTorch
    # released every wholly free cached segment and retried before raising
    # (CUDACachingAllocator.cpp malloc: release_cached_blocks), so the bytes it still held were
    # there, split into blocks too small for the request.
    cache_covers = u > 0 and u >= q
    cache_matters = cache_covers or u >= _CACHE_SHARE * r or u >= _CACHE_NOTABLE_BYTES
    held_cache = 0 if cache_matters else u
    over = a + p + q - available + held_cache
    findings: list[Finding] = []
    sufficient: set[Cause] = set()

    if limit is not None and r + q > limit and f >= q:
        findings.append(
            Finding(
                "fraction_limit",
                _DECISIVE,
                f"the per-process limit of {format_bytes(limit)} refused {format_bytes(q)} while "
                f"the device still had {format_bytes(f)} free",
                {
                    "allowed_bytes": limit,
                    "reserved_bytes": r,
                    "requested_bytes": q,
                    "free_bytes": f,
                },
            )
        )
    if over > 0:
        findings.append(
            Finding(
                "shortage",
                over,
                f"tensors held {format_bytes(a + p)}"
                + (f" and the cache its ordinary {format_bytes(u)}" if held_cache else "")
                + f" and the request needs {format_bytes(q)} more: "
                f"{format_bytes(a + p + q + held_cache)} against "
                + (
                    f"the {format_bytes(available)} the per-process memory fraction allows "
                    f"(the device would offer {format_bytes(device_usable)} without it)"
                    if limited
                    else f"about {format_bytes(available)} that PyTorch can use on this device "
                    f"({format_bytes(t)} less {format_bytes(context_used)} outside the "
                    "allocator for the CUDA context and libraries)"
                )
                + f", {format_bytes(over)} short"
                + ("" if held_cache else " even with a perfect cache")
                + (
                    f" and the other {format_bytes(excess_outside)} freed" if excess_outside else ""
                ),
                {
                    "allocated_bytes": a + p,
                    "requested_bytes": q,
                    "available_bytes": available,
                    "shortfall_bytes": over,
                },
            )
        )
    if cache_matters and u > 0 and (u + f >= q or (over <= 0 and deficit > 0)):
        if u + f >= q:
            sufficient.add("fragmentation")
        findings.append(
            Finding(
                "fragmentation",
                min(u, deficit) if deficit else u,
                f"{format_bytes(u)} was reserved but unallocated"
                + (
                    f", {'more than' if u > q else 'as much as'} the {format_bytes(q)} requested"
                    if u >= q
                    else ""
                )
                + ", yet no cached block was large enough: the cache is fragmented",
                {"reserved_unallocated_bytes": u, "requested_bytes": q, "free_bytes": f},
            )
        )
    if excess_outside > 0:
        if excess_outside + f >= q:
            sufficient.add("outside_pytorch")
        findings.append(
            Finding(
                "outside_pytorch",
                min(excess_outside, deficit) if deficit else excess_outside,
                f"{format_bytes(o)} of the device was held outside this process's PyTorch "
                f"allocator, {format_bytes(excess_outside)} more than this process's CUDA context "
                f"and libraries take (at most {format_bytes(context.high_bytes)}; "
                f"{context.describe()})"
                + (
                    f"; this process itself held {format_bytes(own - r)} outside PyTorch's "
                    "allocator (NVML)"
                    if own is not None and own - r > context.high_bytes
                    else ""
                )
                + (f"; other processes used {format_bytes(others)}" if others else ""),
                {
                    "outside_allocator_bytes": o,
                    "expected_context_bytes": context.expected_bytes,
                    "context_high_bytes": context.high_bytes,
                    "other_processes_bytes": others,
                },
            )
        )
    warnings: list[str] = []
    if not findings:
        # The figures show room for the request: the memory went between the failed cudaMalloc
        # and the message (another process), or the driver's granularity refused it.
        findings.append(
            Finding(
                "shortage",
                0,
                f"tensors held {format_bytes(a + p)} and the request needs {format_bytes(q)} more; "
                f"the figures show {format_bytes(f)} free, so the memory was taken between the "
                "failed allocation and the message, most likely by another process",
                {"allocated_bytes": a + p, "requested_bytes": q, "available_bytes": available},
            )
        )
        warnings.append(
            "the message's own figures leave room for the request; check other processes "
            "on the GPU (nvidia-smi) at the time of the error"
        )
    # What would have let the request succeed ranks first: the fraction limit (the device had
    # room), a cache that held the request's bytes (only its layout failed), a shortage
    # (nothing else would do), then what alone covers the deficit, by bytes.
    first: set[Cause] = {"fraction_limit", "shortage"}
    if cache_covers:
        first.add("fragmentation")
    findings.sort(
        key=lambda finding: (
            0 if finding.cause in first else 1 if finding.cause in sufficient else 2,
            finding.cause != "fraction_limit",
            not (cache_covers and finding.cause == "fragmentation"),
            -finding.explained_bytes,
        )
    )
    remedies = _remedies(
        parsed,
        findings,
        u=u,
        excess_outside=excess_outside,
        others=others,
        over=over,
        t=t,
        a=a + p,
        expandable_on=bool(expandable_segments),
        device_usable=device_usable,
        limited=limited,
        location=location,
        gpu=_gpu_flag(parsed, gpu),
    )
    warnings += figure_warnings(
        parsed, held_bytes=max(r, a + p), cached_bytes=u, expandable_segments=expandable_segments
    )
    return Diagnosis(
        cause=findings[0].cause,
        causes=tuple(findings),
        remedies=remedies,
        memory_explained=memory_paragraph(parsed, a=a, r=r, u=u, o=o, t=t, f=f, context=context),
        deficit_bytes=deficit,
        warnings=tuple(warnings),
    )


def _gpu_flag(parsed: OomText, gpu: GpuSpec | None) -> str | None:
    """The ``--gpu`` value naming the OOM's device in a command: its catalog name where it is
    one (given, or matched by the message's total memory), else its total memory as a size;
    None where the message gives none."""
    spec = matched_gpu(parsed, gpu)
    if spec is not None and spec.aliases:
        return spec.aliases[0]
    total = spec.total_memory_bytes if spec is not None else parsed.total_bytes
    return None if not total else format_bytes(total).replace(" ", "")


def _remedies(
    parsed: OomText,
    findings: list[Finding],
    *,
    u: int,
    excess_outside: int,
    others: int,
    over: int,
    t: int,
    a: int,
    expandable_on: bool = False,
    device_usable: int = 0,
    limited: bool = False,
    location: OomLocation | None = None,
    gpu: str | None = None,
) -> tuple[Remedy, ...]:
    causes = {finding.cause for finding in findings}
    script = None if location is None else location.script
    remedies: list[Remedy] = []
    if "fraction_limit" in causes and parsed.allowed_bytes is not None and t:
        remedies.append(
            Remedy(
                "raise the per-process memory fraction",
                # At 1.0 the allocator may use what the device offers it (less the context).
                max(0, device_usable - parsed.allowed_bytes),
                "high",
                "torch.cuda.set_per_process_memory_fraction(1.0)  # or the share this job may use",
                "The limit, not the device, refused the request.",
                estimate=False,
            )
        )
    if "fragmentation" in causes and parsed.variant != "cuda_malloc_async" and not expandable_on:
        remedies.append(
            Remedy(
                "expandable segments",
                u,
                "medium",
                setting_code("expandable_segments:True", script),
                "Segments that grow in place let the cached-but-unallocated memory serve one "
                "large request. Replay a snapshot (`oomkit tune`) to measure it exactly.",
            )
        )
    if "outside_pytorch" in causes:
        remedies.append(
            Remedy(
                "free the memory held outside PyTorch",
                excess_outside,
                "medium",
                "nvidia-smi --query-compute-apps=pid,used_memory --format=csv",
                "Other processes on this GPU (a second job, a notebook kernel, a dataloader that "
                "touched CUDA) or libraries (NCCL, cuDNN) hold memory PyTorch cannot use."
                if others
                else "NVML names no other process: this process holds it outside PyTorch's "
                "caching allocator (NCCL buffers, a library's own cudaMalloc or memory pool, "
                "such as an inference engine's); shrink those pools or their workspace.",
            )
        )
    if over > 0 or (t and a > _WORKLOAD_SHARE * t):
        # Whatever the cause, tensors filling most of the device leave the cache and other
        # processes little room: using less memory per step helps in every case.
        remedies.append(
            Remedy(
                "reduce memory per step by at least the shortfall"
                if over > 0
                else "reduce memory per step",
                None,
                "low",
                workload_code(script, None if location is None else location.trainer, gpu),
                (
                    f"Tensors need about {format_bytes(over)} more than the per-process memory "
                    "fraction allows; raising it (above) or using less memory helps."
                    if limited
                    else f"Tensors need about {format_bytes(over)} more than the device offers; "
                    "only using less memory helps."
                )
                if over > 0
                else f"Tensors held {format_bytes(a)}, {100 * a / t:.0f}% of the device's "
                f"{format_bytes(t)}: with less memory per step the same request fits whatever "
                "the cache and other processes do.",
            )
        )
    if u > 0:
        remedies.append(
            Remedy(
                "do not rely on torch.cuda.empty_cache()",
                0,
                "high",
                "# PyTorch already released every unused cached segment and retried before raising",
                f"The {format_bytes(u)} cached but unallocated sits in segments that also hold "
                "live tensors; empty_cache() cannot return it and would not have prevented "
                "this OOM.",
                estimate=False,
                lowers_peak=False,
            )
        )
    remedies.sort(key=Remedy.rank_key)
    return tuple(remedies)


def _exceeds_device(parsed: OomText) -> Diagnosis:
    q = parsed.requested_bytes or 0
    t = parsed.total_bytes
    summary = (
        f"one request of {format_bytes(q)} is larger than the whole device"
        + (f" ({format_bytes(t)})" if t is not None else "")
        if parsed.variant != "exa"
        else "one request of more than 1 EB: a size computed from a wrong shape or an overflow"
    )
    evidence = {"requested_bytes": q} | ({"total_bytes": t} if t is not None else {})
    return Diagnosis(
        cause="request_exceeds_device",
        causes=(Finding("request_exceeds_device", _DECISIVE, summary, evidence),),
        remedies=(
            Remedy(
                "check the shape of the tensor being created",
                None,
                "high",
                "# print the shapes just before the failing line; a batch dimension multiplied "
                "twice,\n# an attention matrix over a whole document or a wrong view are typical",
                "No setting or cache behaviour can serve a request larger than the device.",
                estimate=False,
            ),
        ),
        memory_explained="",
        deficit_bytes=None if t is None else q - (parsed.free_bytes or 0),
    )


def _fraction_rejected(parsed: OomText) -> Diagnosis:
    q = parsed.requested_bytes or 0
    return Diagnosis(
        cause="fraction_limit",
        causes=(
            Finding(
                "fraction_limit",
                _DECISIVE,
                f"the per-process memory fraction refused {format_bytes(q)} before asking the "
                "device",
                {"requested_bytes": q},
            ),
        ),
        remedies=(
            Remedy(
                "raise the per-process memory fraction",
                None,
                "medium",
                "torch.cuda.set_per_process_memory_fraction(1.0)",
                "The limit set by this process, not the device, refused the request.",
            ),
        ),
        memory_explained="",
        deficit_bytes=None,
    )


def _driver_error(parsed: OomText) -> Diagnosis:
    who = f"; {said}" if (said := failed_library(parsed.text)) else ""
    return Diagnosis(
        cause="outside_pytorch",
        causes=(
            Finding(
                "outside_pytorch",
                0,
                "a CUDA call outside PyTorch's caching allocator ran out of memory (creating the "
                f"CUDA context, a cuBLAS/cuDNN handle or its workspace, NCCL buffers{who}); the "
                "message carries no figures",
            ),
        ),
        remedies=(
            Remedy(
                "leave room outside the caching allocator",
                None,
                "low",
                "nvidia-smi --query-compute-apps=pid,used_memory --format=csv\n"
                "torch.cuda.set_per_process_memory_fraction(0.95)  # keeps ~5% for libraries",
                "The caching allocator may have reserved nearly all memory; libraries that call "
                "cudaMalloc directly then fail. Check other processes first.",
            ),
        ),
        memory_explained="",
        deficit_bytes=None,
        warnings=("the message has no figures; explain a snapshot for a full diagnosis",),
    )
