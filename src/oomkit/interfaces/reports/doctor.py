"""Rendering of ``SettingsReport`` records (``oomkit doctor``): a rich table and JSON."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from oomkit.core.allocator.config import AllocatorConfig
from oomkit.diagnose.settings_doctor import SettingsReport
from oomkit.interfaces.reports._untrusted import as_written
from oomkit.units import format_bytes

__all__ = ["render_settings_report", "settings_report_to_json"]

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def _config_rows(config: AllocatorConfig) -> list[tuple[str, str]]:
    """The settings that change allocator decisions, as PyTorch's defaults or their values."""
    split = config.max_split_size_bytes
    divisions = sorted(set(config.roundup_power2_divisions))
    fraction = config.per_process_memory_fraction
    return [
        ("max_split_size", "unlimited (default)" if split is None else format_bytes(split)),
        (
            "roundup_power2_divisions",
            "off (default)" if divisions == [0] else ",".join(map(str, config.roundup_power2_divisions)),
        ),
        (
            "garbage_collection_threshold",
            "off (default)" if config.garbage_collection_threshold == 0.0 else str(config.garbage_collection_threshold),
        ),
        ("expandable_segments", str(config.expandable_segments)),
        ("per_process_memory_fraction", "not set" if fraction is None else str(fraction)),
    ]


def render_settings_report(report: SettingsReport, console: Console) -> None:
    """Print the variables, the settings in effect and the findings."""
    console.print(
        f"Allocator settings: {as_written(report.source)}, torch {report.torch_version} "
        f"({as_written(report.torch_version_from)})"
    )
    if report.env is not None:
        table = Table(title="Environment variables, in the order this torch reads them")
        table.add_column("variable")
        table.add_column("value")
        table.add_column("status")
        for var in report.env.variables:
            status = {
                "read": "read" + (" (deprecated name)" if var.deprecated else ""),
                "shadowed": "ignored: an earlier variable is set",
                "not_read": "ignored: this torch never reads it",
                "unset": "-",
            }[var.status]
            value = "(unset)" if var.value is None else repr(var.value)
            table.add_row(var.name, as_written(value), status)
        console.print(table)
    settings = Table(title="In effect")
    settings.add_column("setting")
    settings.add_column("value")
    if report.settings_text is not None:
        settings.add_row("settings string", as_written(repr(report.settings_text)) or "''")
    settings.add_row("backend", as_written(report.backend or "not recorded"))
    if report.config is not None:
        for name, value in _config_rows(report.config):
            settings.add_row(name, value)
    for name, value in report.implied.items():
        settings.add_row(f"{name} (seen in the trace)", as_written(str(value)))
    if report.live is not None and report.live.cuda_available:
        settings.add_row("running allocator backend", as_written(str(report.live.backend)))
    console.print(settings)
    if not report.findings:
        console.print("No problems found: the settings are read and applied as written.")
        return
    for finding in report.findings:
        console.print(
            f"[{_STYLE[finding.severity]}]{finding.severity}[/]: {as_written(finding.what)} "
            f"{as_written(finding.advice)} [dim]({as_written(finding.source)})[/dim]"
        )


def _config_json(config: AllocatorConfig | None) -> dict[str, Any] | None:
    if config is None:
        return None
    return {
        "max_split_size_bytes": config.max_split_size_bytes,
        "max_non_split_rounding_bytes": config.max_non_split_rounding_bytes,
        "roundup_power2_divisions": list(config.roundup_power2_divisions),
        "garbage_collection_threshold": config.garbage_collection_threshold,
        "expandable_segments": config.expandable_segments,
        "per_process_memory_fraction": config.per_process_memory_fraction,
    }


def settings_report_to_json(report: SettingsReport) -> dict[str, Any]:
    """The report as one JSON-ready object (``oomkit doctor --json``)."""
    env = report.env
    live = report.live
    return {
        "source": report.source,
        "torch_version": report.torch_version,
        "torch_version_from": report.torch_version_from,
        "variables": None
        if env is None
        else [
            {"name": v.name, "value": v.value, "status": v.status, "deprecated": v.deprecated}
            for v in env.variables
        ],
        "read_from": None if env is None else env.read_from,
        "settings_text": report.settings_text,
        "backend": report.backend,
        "config": _config_json(report.config),
        "implied": dict(report.implied),
        "live": None
        if live is None
        else {
            "torch_version": live.torch_version,
            "cuda_available": live.cuda_available,
            "backend": live.backend,
            "settings": None if live.settings is None else dict(live.settings),
        },
        "findings": [
            {"severity": f.severity, "what": f.what, "advice": f.advice, "source": f.source}
            for f in report.findings
        ],
        "worst": report.worst,
    }
