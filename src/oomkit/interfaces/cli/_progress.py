"""Progress bars on stderr for the long commands (``predict``, ``fit``): only on a terminal.

A bar is drawn when stderr is a terminal and ``--json`` is not given, so pipes, logs and JSON
output stay clean. rich is imported only when a bar is drawn.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from oomkit.interfaces.cli._common import stderr_console

__all__ = [
    "add_jobs_flag",
    "progress_enabled",
    "progress_bar",
    "StepProgress",
    "step_progress",
    "tracing_jobs",
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


def tracing_jobs(args: argparse.Namespace) -> int | None:
    """Processes that trace at once (``fit``; ``predict --lengths``' recordings): ``--jobs``,
    or by default one per core (None) for oomkit's own builders (a preset, ``--hf``) on Linux,
    and 1 for the user's code (``file.py:function``, ``--eval``), whose builder may have
    effects outside its process, for ``--compile``, and off Linux (macOS's system libraries
    are not safe to fork with torch loaded: Python's multiprocessing docs)."""
    from oomkit.interfaces.cli._user_function import is_user_target

    if args.jobs is not None:
        return int(args.jobs)
    target = getattr(args, "target", None)
    users = getattr(args, "eval", None) is not None or (target is not None and is_user_target(target))
    compiled = getattr(args, "compile", False)
    return 1 if users or compiled or not sys.platform.startswith("linux") else None


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
    isatty = getattr(stream, "isatty", None)
    return not getattr(args, "json", False) and isatty is not None and bool(isatty())


def _columns() -> tuple[Any, ...]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )


@contextmanager
def progress_bar(enabled: bool, what: str) -> Iterator[Callable[[int, int], None] | None]:
    """A bar of ``what``, updated by the ``(done, total)`` callback it yields (``None`` when
    not ``enabled``); it is removed from the terminal when the block ends."""
    if not enabled:
        yield None
        return
    from rich.progress import Progress

    with Progress(*_columns(), console=stderr_console(), transient=True) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, refresh=True)

        yield update


class StepProgress:
    """Counts the recorded steps of ``predict`` on a bar, then names the replay that follows.

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
