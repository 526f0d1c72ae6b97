"""How many steps one recording may hold: a whole number from 1 to ``MAX_RECORDED_STEPS``.

Each step is recorded op by op, so a recording's time grows with its steps: 1,000 steps of a
small model take minutes, 100,000,000 take days. A peak settles within a few steps (the first
creates the optimizer's state, the second shows the steady state), so past the bound a count
is a mistake, not a request. A long run of varying lengths is spliced from one recording a
length instead (``oomkit predict --lengths``). Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any

from oomkit.errors import ConfigError

__all__ = ["MAX_RECORDED_STEPS", "check_step_count"]

# The most steps recorded one by one.
MAX_RECORDED_STEPS = 1_000


def check_step_count(steps: Any, example: str) -> int:
    """``steps`` if it is a whole number from 1 to ``MAX_RECORDED_STEPS``; else ``ConfigError``.

    ``example`` is a call that shows a good value (``"trace_step(fn, steps=3)"``).
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ConfigError(
            f"steps must be a whole number of at least 1; got {steps!r}. Example: {example}"
        )
    if steps > MAX_RECORDED_STEPS:
        raise ConfigError(
            f"steps={steps:,}: each step is recorded in full, and past {MAX_RECORDED_STEPS:,} "
            "that takes hours (the peak settles within a few steps); give at most "
            f"{MAX_RECORDED_STEPS:,}. Example: {example}"
        )
    return steps
