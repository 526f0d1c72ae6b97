"""Where a script's recording is: its optimizer steps, its bound, its progress.

``record_script`` (script_run.py) runs a script up to its ``steps``-th optimizer step. A
``StepWatch`` marks where each step starts (the first training forward after an optimizer step,
or the step itself for a closure's), ends the script after the last one (``StopScript``),
stops an endless one at ``MAX_SCRIPT_ENTRIES`` log entries (``ScriptTooLong``) and reports
``ScriptProgress`` to a progress display.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.modules.module as _module_hooks
import torch.optim.optimizer as _optimizer_hooks

from oomkit.prediction.tracing.batch_finders import in_trials
from oomkit.prediction.tracing.cuda_device import entries_recorded

if TYPE_CHECKING:
    from oomkit.prediction.tracing.recorder import Tracer

__all__ = ["MAX_SCRIPT_ENTRIES", "ScriptProgress", "ScriptTooLong", "StepWatch", "StopScript"]


class ScriptTooLong(BaseException):
    """Raised when the recording reaches ``MAX_SCRIPT_ENTRIES`` (not an ``Exception``, so the
    script's own ``except Exception`` lets it through); the message says what to do."""


class StopScript(BaseException):
    """Raised after the last recorded optimizer step: ends the script (not an ``Exception``,
    so the script's own ``except Exception`` lets it through)."""


# The most log entries a script's recording keeps (about 2 KiB each with their frames): an
# endless or very long loop stops with a UserCodeError at about 4 GiB, not by exhausting memory.
MAX_SCRIPT_ENTRIES = 2_000_000

# Module calls between two reports to a progress display (and checks of the bound on the log).
_CALLS_PER_REPORT = 64


@dataclass(frozen=True)
class ScriptProgress:
    """Where a script's recording is, for a progress display (``record_script(progress=)``).

    Attributes:
        steps_done: optimizer steps recorded so far.
        steps: the optimizer steps the recording stops after.
        entries: entries of the recorder's log so far (device requests, frees, step markers);
            once ``ended``, as last reported.
        max_entries: the most the log keeps (``MAX_SCRIPT_ENTRIES``): the recording stops there.
        ended: the script has ended or been stopped; the replay follows.
        rank: ``(rank, ranks)`` where each rank of a torchrun script is recorded in turn
            (``--all-ranks``; set by the caller); ``None`` otherwise.
    """

    steps_done: int
    steps: int
    entries: int
    max_entries: int = MAX_SCRIPT_ENTRIES
    ended: bool = False
    rank: tuple[int, int] | None = None


class StepWatch:
    """Marks where each step starts and stops the script after the last one; reports progress."""

    def __init__(
        self, tracer: Tracer, steps: int, progress: Callable[[ScriptProgress], None] | None
    ) -> None:
        self._tracer = tracer
        self._steps = steps
        self._progress = progress
        self.done = 0
        self.entries = 0  # the log's entries when last reported
        self._calls = 0  # module calls seen (the log's bound is checked every _CALLS_PER_REPORT)
        self._started = False
        self._handles: list[Any] = []
        # The optimizers that stepped, by identity: their class names, in order of first step.
        self.optimizers: dict[int, str] = {}

    def __enter__(self) -> StepWatch:
        self._handles = [
            _module_hooks.register_module_forward_pre_hook(self._on_forward),
            # Registered after the Tracer's: its post hook notes the new optimizer state first.
            _optimizer_hooks.register_optimizer_step_post_hook(self._on_step),
        ]
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # dynamo traces global hooks into its graphs: nothing of this belongs there
        self._calls += 1
        if self._calls % _CALLS_PER_REPORT == 0:
            entries = entries_recorded()
            self.report(entries)
            if entries > MAX_SCRIPT_ENTRIES:
                raise ScriptTooLong(
                    f"the script has logged {entries:,} device requests and frees without "
                    f"reaching the end of its {self._steps} optimizer step(s) or its own end (an "
                    "endless loop, or a long evaluation or generation), and the recording stops "
                    f"at {MAX_SCRIPT_ENTRIES:,} to stay within memory. Give it the arguments of a "
                    "short run (a few batches)"
                )
        if self._started or in_trials():
            return
        if module.training and torch.is_grad_enabled():
            self._started = True
            self._tracer.mark_step()

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if in_trials():
            return  # a Lightning Tuner's trial step, not one of the script's (batch_finders.py)
        if not self._started:
            # A step with no training forward before it (a closure's): it starts here.
            self._tracer.mark_step()
        self.optimizers.setdefault(id(optimizer), type(optimizer).__name__)
        self.done += 1
        self._started = False
        self.report(entries_recorded())
        if self.done >= self._steps:
            raise StopScript

    def several_optimizers_note(self) -> str | None:
        """What the prediction says when more than one optimizer stepped (a GAN's generator
        and discriminator): each of their steps counted as one of the recorded steps."""
        if len(self.optimizers) < 2:
            return None
        names = ", ".join(self.optimizers.values())
        count = len(self.optimizers)
        return (
            f"{count} optimizers stepped ({names}): each optimizer.step() counts as one of the "
            f"steps recorded, so the {self.done} recorded hold about {self.done / count:g} "
            f"iteration(s) of the loop (the per-step table is per optimizer step). To record N "
            f"iterations, give --steps N x {count}"
        )

    def report(self, entries: int, *, ended: bool = False) -> None:
        """Tell the progress display (if any) where the recording is."""
        self.entries = entries
        if self._progress is not None:
            self._progress(ScriptProgress(self.done, self._steps, entries, ended=ended))
