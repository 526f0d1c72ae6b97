"""Reports: records rendered for the terminal (rich) and as JSON-ready dicts."""

from __future__ import annotations

from oomkit.reports.diagnosis import diagnosis_to_json, render_diagnosis
from oomkit.reports.prediction import prediction_to_json, render_prediction, verdict_line
from oomkit.reports.replay import (
    comparison_table,
    render_replay,
    replay_to_json,
)

__all__ = [
    "comparison_table",
    "diagnosis_to_json",
    "prediction_to_json",
    "render_diagnosis",
    "render_prediction",
    "render_replay",
    "replay_to_json",
    "verdict_line",
]
