"""Progress bars on stderr for the long commands (``predict``, ``fit``): only on a terminal.

A bar is drawn when stderr is a terminal and ``--json`` is not given, so pipes, logs and JSON
output stay clean. rich is imported only when a bar is drawn.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from oomkit.interfaces.cli._common import stderr_console

__all__ = ["progress_enabled", "progress_bar", "StepProgress", "step_progress"]


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
    simulated allocator (the bar then says so, its clock still running).
    """

    def __init__(self, update: Callable[[str, int], None] | None, steps: int) -> None:
        self._update = update
        self.steps = steps
        self.done = 0

    def wrap(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """``step_fn`` with the bar advanced after each call (itself when there is no bar)."""
        if self._update is None:
            return step_fn
        self._show()

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = step_fn(*args, **kwargs)
            self.done += 1
            self._show()
            return result

        return counted

    def _show(self) -> None:
        assert self._update is not None
        if self.done < self.steps:
            text = f"recording step {self.done + 1} of {self.steps} on the meta device"
        else:
            text = "replaying the recording through the simulated allocator"
        self._update(text, self.done)


@contextmanager
def step_progress(enabled: bool, steps: int) -> Iterator[StepProgress]:
    """A ``StepProgress`` over ``steps`` steps, drawn on stderr when ``enabled``."""
    if not enabled:
        yield StepProgress(None, steps)
        return
    from rich.progress import Progress

    with Progress(*_columns(), console=stderr_console(), transient=True) as bar:
        task = bar.add_task("recording", total=steps)

        def update(text: str, done: int) -> None:
            bar.update(task, description=text, completed=done, refresh=True)

        yield StepProgress(update, steps)
