"""Progress bars on stderr for the long commands (predict, fit, snapshots): only on a terminal.

``predict`` and ``fit`` count steps and probes; ``replay``, ``tune``, ``explain``, ``doctor`` and
``diff`` show a snapshot's load and what follows it (``snapshot_progress``).

A bar is drawn when stderr is a terminal and ``--json`` is not given, so pipes, logs and JSON
output stay clean. rich is imported only when a bar is drawn.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any

from oomkit.interfaces.cli._common import stderr_console

if TYPE_CHECKING:  # imports torch
    from oomkit.prediction.tracing.script_run import ScriptProgress

__all__ = [
    "add_jobs_flag",
    "is_terminal",
    "progress_enabled",
    "progress_bar",
    "SnapshotProgress",
    "snapshot_progress",
    "StepProgress",
    "step_progress",
    "note_memory_cap",
]


def add_jobs_flag(
    parser: argparse.ArgumentParser, *, what: str, verb: str = "replay", default: str | None = None
) -> None:
    """The one ``--jobs N`` flag (dest ``jobs``, default None: one process per CPU core) of the
    commands that replay several settings at once (``tune``, ``replay --what-if``) or trace
    several batch sizes (``fit``); ``default`` words a default other than one per core."""
    parser.add_argument(
        "--jobs",
        type=_jobs,
        default=None,
        metavar="N",
        help=f"{verb} N {what} at once, one process each (default: "
        f"{default or 'one per CPU core'}; 1: one at a time). The results are the same either way.",
    )


def note_memory_cap(jobs: int | None, settings: int) -> None:
    """Say on stderr when the memory available holds fewer processes than would replay
    ``settings`` settings at once for ``jobs`` (``executors/forked.py memory_worker_cap``:
    that many then replay at once, with the same results)."""
    from oomkit.executors.forked import memory_worker_cap, process_count

    wanted = min(process_count(jobs), settings)
    cap = memory_worker_cap()
    if cap is not None and cap < wanted:
        print(
            f"oomkit: replaying {cap} setting(s) at once, not {wanted}: a process may come to "
            f"hold as much memory as this one, and the memory available holds {cap}",
            file=sys.stderr,
        )


def _jobs(text: str) -> int:
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of processes; got {text!r}")
    return jobs


def progress_enabled(args: argparse.Namespace, stream: IO[str]) -> bool:
    """Whether to draw a progress bar on ``stream``: not with --json, and only on a terminal."""
    return not getattr(args, "json", False) and is_terminal(stream)


def is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal (False for a stream without ``isatty``, or closed)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return isatty is not None and bool(isatty())
    except ValueError:  # a closed stream
        return False


def _columns(amount: Any = None) -> tuple[Any, ...]:
    """A bar's columns: spinner, description (shown as written: a file name's brackets are not
    rich markup), bar, ``amount`` (default: done/total), time elapsed."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return (
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn() if amount is None else amount,
        TimeElapsedColumn(),
    )


def _time_left() -> Any:
    """A column ``~M:SS left``: rich's estimate from the pace so far (its speed over the last
    30 s), once a first item is done; blank before that and when done. Long work (a ``plan``
    of a large model, a ``fit`` of a script) then says how long it may still take."""
    from datetime import timedelta

    from rich.progress import ProgressColumn
    from rich.text import Text

    class TimeLeft(ProgressColumn):
        def render(self, task: Any) -> Text:
            left = task.time_remaining
            if left is None or task.finished or not task.completed:
                return Text("")
            return Text(f"~{timedelta(seconds=math.ceil(left))} left", style="progress.remaining")

    return TimeLeft()


@contextmanager
def progress_bar(enabled: bool, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A bar of ``what``, updated by the ``(done, total)`` callback it yields (``None`` when
    not ``enabled``); it is removed from the terminal when the block ends."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    with Progress(*_columns(), _time_left(), console=stderr_console(), transient=True) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, refresh=True)

        yield update


class StepProgress:
    """Counts the recorded steps of ``predict`` on a bar, then names the replay that follows.

    A whole script reports through ``script`` instead: its optimizer steps and the device
    requests and frees logged so far (``ScriptProgress``).

    ``wrap(step_fn)`` returns the step with a count after each call; the recorder calls the
    step once per ``--steps``, and after the last one oomkit replays the recording through the
    simulated allocator (the bar then says so, its clock still running). A ``generate`` step
    runs one forward per new token: with ``tokens_per_step`` set, ``count_forwards(model)``
    advances the bar once per forward of the model, token by token.
    """

    def __init__(
        self,
        update: Callable[[str, int], None] | None,
        steps: int,
        tokens_per_step: int | None = None,
    ) -> None:
        self._update = update
        self.steps = steps
        self.tokens_per_step = tokens_per_step
        self.done = 0
        self.tokens = 0
        self._shown_at = -math.inf  # when a script's progress was last drawn (time.monotonic)

    @property
    def total(self) -> int:
        """The bar's length: steps, or forwards when counting tokens."""
        return self.steps * (self.tokens_per_step or 1)

    def wrap(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` with the bar advanced after each call (itself when there is no bar)."""
        if self._update is None:
            return step_fn
        self._show()

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = step_fn(*args, **kwargs)
            self.done += 1
            self.tokens = 0
            self._show()
            return result

        return counted

    @contextmanager
    def count_forwards(self, model: Any) -> Iterator[None]:
        """While the block runs, each forward of ``model`` (an ``nn.Module``) is one token;
        nothing is registered without a bar or ``tokens_per_step``."""
        register = getattr(model, "register_forward_pre_hook", None)
        if self._update is None or self.tokens_per_step is None or register is None:
            yield
            return

        def on_forward(*_: Any) -> None:
            self.tokens += 1
            self._show()

        handle = register(on_forward)
        try:
            yield
        finally:
            handle.remove()

    def script(self, progress: ScriptProgress) -> None:
        """Where a whole script's recording is (``record_script``'s ``progress``): its
        optimizer steps on the bar, and the device requests and frees logged so far against
        the most the recording keeps (an evaluation loop has no steps to count)."""
        if self._update is None:
            return
        if progress.ended:
            self.done = self.steps
            self._show()
            return
        now = time.monotonic()
        if progress.steps_done == self.done and now - self._shown_at < _SCRIPT_REFRESH_S:
            return
        self.done, self._shown_at = progress.steps_done, now
        which = "the script" if progress.rank is None else (
            f"rank {progress.rank[0]} of {progress.rank[1]}"
        )
        self._update(
            f"recording {which}: {progress.steps_done} of {progress.steps} optimizer steps, "
            f"{progress.entries:,} allocator events (at most {progress.max_entries:,})",
            min(progress.steps_done, self.total),
        )

    def _show(self) -> None:
        assert self._update is not None
        per_step = self.tokens_per_step or 1
        if self.done < self.steps:
            text = f"recording step {self.done + 1} of {self.steps} on the meta device"
            if self.tokens_per_step is not None:
                text += f", token {max(self.tokens, 1)} of {self.tokens_per_step}"
        else:
            text = "replaying the recording through the simulated allocator"
        # At a forward's pre-hook, the forwards before it are done.
        completed = self.done * per_step + min(max(self.tokens - 1, 0), per_step)
        self._update(text, min(completed, self.total))


# A script reports every 64 module calls; its line is redrawn at most this often (seconds).
_SCRIPT_REFRESH_S = 0.1


@contextmanager
def step_progress(
    enabled: bool, steps: int, tokens_per_step: int | None = None
) -> Iterator[StepProgress]:
    """A ``StepProgress`` over ``steps`` steps (of ``tokens_per_step`` forwards each, for
    ``generate``), drawn on stderr when ``enabled``."""
    if not enabled:
        yield StepProgress(None, steps, tokens_per_step)
        return
    from rich.progress import Progress

    with Progress(*_columns(), console=stderr_console(), transient=True) as bar:
        progress = StepProgress(None, steps, tokens_per_step)
        task = bar.add_task("recording", total=progress.total)

        def update(text: str, done: int) -> None:
            bar.update(task, description=text, completed=done, refresh=True)

        progress._update = update
        yield progress


class SnapshotProgress:
    """What ``replay``, ``tune``, ``explain``, ``doctor`` and ``diff`` show while a snapshot
    loads and what follows.

    ``loading`` is the ``progress`` callback for ``load_snapshot`` (``None`` without a bar):
    the file's bytes read, then its trace entries (about four fifths of a large file's load).
    ``phase(text)`` then names what follows (the replay), whose length is not known ahead: the
    bar pulses and its clock runs. The file name is shown as written (no rich markup).
    """

    def __init__(self, name: str, update: Callable[[str, int, int | None, bool], None] | None):
        from oomkit.core.snapshot import READING_FILE

        self._name = _shortened(name, _NAME_CHARS)
        self._update = update
        self._in_bytes = READING_FILE  # the phase whose amounts are bytes

    @property
    def loading(self) -> Callable[[str, int, int], None] | None:
        """``load_snapshot``'s ``progress`` callback, or None without a bar."""
        return self._load if self._update is not None else None

    def _load(self, what: str, done: int, total: int) -> None:
        assert self._update is not None
        self._update(f"{self._name}: {what}", done, total, what == self._in_bytes)

    def phase(self, text: str) -> None:
        """What follows the load, of a length not known ahead ("replaying 5,000,001 events"):
        the bar pulses and its clock restarts (nothing without a bar)."""
        if self._update is not None:
            self._update(f"{self._name}: {text}", 0, None, False)


# A long file name would squeeze the bar and its amounts out of an 80-column terminal.
_NAME_CHARS = 32


def _shortened(name: str, limit: int) -> str:
    """``name`` with its middle elided when longer than ``limit`` characters."""
    if len(name) <= limit:
        return name
    head = (limit - 1) // 2
    return f"{name[:head]}…{name[len(name) - (limit - 1 - head):]}"


def _amount_column() -> Any:
    """Done / total: bytes for the file, a count for trace entries; nothing while unknown."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    from oomkit.units import format_bytes

    class AmountColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            if task.total is None:
                return Text("")
            if task.fields.get("in_bytes"):
                return Text(f"{format_bytes(int(task.completed))} / {format_bytes(int(task.total))}")
            return Text(f"{int(task.completed):,}/{int(task.total):,}")

    return AmountColumn()


@contextmanager
def snapshot_progress(enabled: bool, name: str) -> Iterator[SnapshotProgress]:
    """A ``SnapshotProgress`` for the snapshot called ``name``, drawn on stderr when
    ``enabled`` and removed when the block ends."""
    if not enabled:
        yield SnapshotProgress(name, None)
        return
    from rich.progress import Progress

    with Progress(*_columns(_amount_column()), console=stderr_console(), transient=True) as bar:
        from oomkit.interfaces.reports._untrusted import as_written

        # A file name is shown as written (rich would read "[v2]" in it as markup).
        label = as_written(_shortened(name, _NAME_CHARS))
        tasks = [bar.add_task(label, total=None, in_bytes=False)]

        def update(text: str, done: int, total: int | None, in_bytes: bool) -> None:
            if total is None:
                # An amount no longer known (rich's update cannot unset a total): a new,
                # pulsing task in place of the old one, with its own clock.
                bar.update(tasks[-1], visible=False)
                tasks.append(bar.add_task(text, total=None, in_bytes=False))
                return
            # No refresh here: a large file reports thousands of times; the bar redraws itself
            # ten times a second.
            bar.update(tasks[-1], description=text, completed=done, total=total, in_bytes=in_bytes)

        yield SnapshotProgress(name, update)
