"""The findings and remedies a diagnosis is made of, and the causes it names.

``diagnosis.py`` (an OOM message), ``snapshot_diagnosis.py`` and ``prediction_diagnosis.py``
build them; ``Diagnosis`` (diagnosis.py) holds them, ranked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = ["CAUSES", "Cause", "Confidence", "Finding", "Remedy"]

Cause = Literal[
    "shortage",
    "fragmentation",
    "outside_pytorch",
    "fraction_limit",
    "request_exceeds_device",
    "leak",
    "transient_spike",
]
CAUSES: tuple[Cause, ...] = get_args(Cause)
Confidence = Literal["high", "medium", "low"]


@dataclass(frozen=True)
class Finding:
    """One cause that applies, with the figures that show it.

    Attributes:
        cause: the cause.
        explained_bytes: how much of the deficit this cause accounts for; findings are ranked by
            it (a request larger than the device or a fraction limit with free memory left rank
            first whatever it is).
        summary: one sentence with the user's own numbers.
        evidence_bytes: the figures, by name.
    """

    cause: Cause
    explained_bytes: int
    summary: str
    evidence_bytes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Remedy:
    """One change to try, with what it saves.

    Attributes:
        title: what to do, in a few words.
        saving_bytes: bytes it frees for this request; None where the message cannot tell.
        confidence: how sure the saving is.
        code: copy-paste code or command.
        why: one or two sentences.
        estimate: True when ``saving_bytes`` is estimated rather than computed by replay.
        lowers_peak: False for a remedy whose bytes go to other processes, not to this one's
            need (``empty_cache``), and for one that saves nothing (``saving_bytes == 0``: advice
            against a change): it ranks after every remedy that lowers the peak.
        changes_training: True for a change to what is trained (LoRA, QLoRA, frozen layers):
            among the remedies that are enough, it ranks after those that keep the run's
            training as it is.
    """

    title: str
    saving_bytes: int | None
    confidence: Confidence
    code: str
    why: str
    estimate: bool = True
    lowers_peak: bool = True
    changes_training: bool = False

    def __post_init__(self) -> None:
        # A remedy that saves nothing cannot lower the peak (issue 16 item 8).
        if self.saving_bytes == 0 and self.lowers_peak:
            object.__setattr__(self, "lowers_peak", False)

    def rank_key(self, deficit_bytes: int | None = None) -> tuple[bool, bool, bool, bool, int, bool]:
        """Sort key: remedies that lower the peak first; then those that save at least
        ``deficit_bytes`` (every one, where it is not known), keeping the run's training before
        changing it; then by bytes saved (an unknown saving before none at all), measured first."""
        saving = self.saving_bytes
        enough = deficit_bytes is None or saving is None or saving >= deficit_bytes
        return (
            not self.lowers_peak,
            saving == 0,
            not enough,
            self.changes_training,
            -(saving or 0),
            self.estimate,
        )
