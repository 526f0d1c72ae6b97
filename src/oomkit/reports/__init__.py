"""Reports: records rendered for the terminal (rich) and as JSON-ready dicts."""

from __future__ import annotations

from oomkit.reports.replay import (
    comparison_table,
    render_replay,
    replay_to_json,
)

__all__ = ["comparison_table", "render_replay", "replay_to_json"]
