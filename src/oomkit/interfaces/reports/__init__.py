"""Reports: records rendered for the terminal (rich) and as JSON-ready dicts."""

from __future__ import annotations

from oomkit.interfaces.reports.batch_search import (
    batch_search_to_json,
    batch_search_verdict,
    render_batch_search,
    render_smallest_gpu,
    smallest_gpu_to_json,
    smallest_gpu_verdict,
)
from oomkit.interfaces.reports.diagnosis import diagnosis_to_json, render_diagnosis
from oomkit.interfaces.reports.diagnosis_html import diagnosis_html, write_diagnosis_html
from oomkit.interfaces.reports.doctor import render_settings_report, settings_report_to_json
from oomkit.interfaces.reports.experiment import experiment_to_json, render_experiment
from oomkit.interfaces.reports.html import HtmlPage, HtmlSection
from oomkit.interfaces.reports.monitor import (
    build_monitor_report,
    monitor_report_to_json,
    render_monitor_report,
    write_monitor_html,
)
from oomkit.interfaces.reports.monitor_live import live_line_sink
from oomkit.interfaces.reports.prediction import prediction_to_json, render_prediction, verdict_line
from oomkit.interfaces.reports.replay import (
    comparison_table,
    render_replay,
    replay_to_json,
)

__all__ = [
    "batch_search_to_json",
    "batch_search_verdict",
    "render_batch_search",
    "render_smallest_gpu",
    "smallest_gpu_to_json",
    "smallest_gpu_verdict",
    "comparison_table",
    "HtmlPage",
    "HtmlSection",
    "diagnosis_html",
    "diagnosis_to_json",
    "prediction_to_json",
    "render_diagnosis",
    "render_prediction",
    "render_replay",
    "render_settings_report",
    "settings_report_to_json",
    "replay_to_json",
    "build_monitor_report",
    "experiment_to_json",
    "live_line_sink",
    "monitor_report_to_json",
    "render_experiment",
    "render_monitor_report",
    "write_monitor_html",
    "verdict_line",
    "write_diagnosis_html",
]
