"""Reports: records rendered for the terminal (rich) and as JSON-ready dicts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from oomkit._lazy import lazy_exports

if TYPE_CHECKING:
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
    from oomkit.interfaces.reports.prediction import (
        prediction_to_json,
        render_prediction,
        verdict_line,
    )
    from oomkit.interfaces.reports.replay import (
        comparison_table,
        render_replay,
        replay_to_json,
        what_if_table,
        what_if_to_json,
    )

# Imported on first use (PEP 562): a command imports the one report module it renders with,
# not all of them (issue 19 item 4: start-up).
_LAZY: dict[str, str] = {
    "batch_search_to_json": "oomkit.interfaces.reports.batch_search",
    "batch_search_verdict": "oomkit.interfaces.reports.batch_search",
    "render_batch_search": "oomkit.interfaces.reports.batch_search",
    "render_smallest_gpu": "oomkit.interfaces.reports.batch_search",
    "smallest_gpu_to_json": "oomkit.interfaces.reports.batch_search",
    "smallest_gpu_verdict": "oomkit.interfaces.reports.batch_search",
    "diagnosis_to_json": "oomkit.interfaces.reports.diagnosis",
    "render_diagnosis": "oomkit.interfaces.reports.diagnosis",
    "diagnosis_html": "oomkit.interfaces.reports.diagnosis_html",
    "write_diagnosis_html": "oomkit.interfaces.reports.diagnosis_html",
    "render_settings_report": "oomkit.interfaces.reports.doctor",
    "settings_report_to_json": "oomkit.interfaces.reports.doctor",
    "experiment_to_json": "oomkit.interfaces.reports.experiment",
    "render_experiment": "oomkit.interfaces.reports.experiment",
    "HtmlPage": "oomkit.interfaces.reports.html",
    "HtmlSection": "oomkit.interfaces.reports.html",
    "build_monitor_report": "oomkit.interfaces.reports.monitor",
    "monitor_report_to_json": "oomkit.interfaces.reports.monitor",
    "render_monitor_report": "oomkit.interfaces.reports.monitor",
    "write_monitor_html": "oomkit.interfaces.reports.monitor",
    "live_line_sink": "oomkit.interfaces.reports.monitor_live",
    "prediction_to_json": "oomkit.interfaces.reports.prediction",
    "render_prediction": "oomkit.interfaces.reports.prediction",
    "verdict_line": "oomkit.interfaces.reports.prediction",
    "comparison_table": "oomkit.interfaces.reports.replay",
    "render_replay": "oomkit.interfaces.reports.replay",
    "replay_to_json": "oomkit.interfaces.reports.replay",
    "what_if_table": "oomkit.interfaces.reports.replay",
    "what_if_to_json": "oomkit.interfaces.reports.replay",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


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
    "what_if_table",
    "what_if_to_json",
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
