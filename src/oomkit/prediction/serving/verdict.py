"""A serving engine's start-up verdict: starts or not, at which stage, and which knob to turn."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Knob", "Verdict"]


@dataclass(frozen=True)
class Knob:
    """One engine flag to change, the way to change it, and why.

    Attributes:
        flag: the flag as the engine spells it (``"--gpu-memory-utilization"``).
        direction: ``"raise"``, ``"lower"``, ``"set"`` or a value to pass (``"fp8"``).
        why: what the change does, or the value to pass (``"at most 0.93"``).
    """

    flag: str
    direction: str
    why: str


@dataclass(frozen=True)
class Verdict:
    """Whether the engine starts and serves, and if not, where it stops.

    Attributes:
        starts: the engine comes up and survives its warm-up.
        stage: where it stops (``"init"``, ``"kv_cache"``, ``"max_model_len"``,
            ``"cuda_graph_capture"``, ``"sampler_warmup"``, ``"runtime"``), or ``"ready"``.
        reason: one sentence, with the figures.
        knobs: what to change, most direct first (empty when it starts).
    """

    starts: bool
    stage: str
    reason: str
    knobs: tuple[Knob, ...] = ()
