"""A remedy measured by re-predicting the step: whether it then fits, and what it needs.

Its own small module so that reports can tell measured remedies apart without importing the
re-prediction machinery (``remedy_measurement`` imports the workload record and, when it runs,
the predictor): ``oomkit explain TEXT`` stays light.
"""

from __future__ import annotations

import dataclasses

from oomkit.diagnose.diagnosis import Remedy

__all__ = ["MeasuredRemedy"]


@dataclasses.dataclass(frozen=True)
class MeasuredRemedy(Remedy):
    """A remedy measured by re-predicting the step with it.

    Attributes:
        fits: whether the re-predicted step fits the target (rank 0 for ``--fsdp``).
        peak_reserved_bytes: what the re-predicted step needs reserved (its peak on a device
            without limit), bytes.
        flag: the ``oomkit predict`` option that applies it (``--precision bf16``), if any.
    """

    fits: bool | None = None
    peak_reserved_bytes: int | None = None
    flag: str | None = None
