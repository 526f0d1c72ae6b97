"""The pure parts of scripts/measure_gpu_lag.py (the GPU parts run on a lent GPU only)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "measure_gpu_lag.py"
_spec = importlib.util.spec_from_file_location("measure_gpu_lag", _PATH)
lag = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("measure_gpu_lag", lag)  # dataclasses look their module up
_spec.loader.exec_module(lag)


def test_lags_leave_out_ops_never_seen_complete():
    assert lag.lags_of([0, 1, 3], [2, -1, 7]) == [2, 4]
    with pytest.raises(ValueError):
        lag.lags_of([0, 1], [2])


def test_censored_lags_count_pending_ops_to_the_end():
    assert lag.censored_lags([0, 1, 3], [2, -1, 7], end=9) == [2, 8, 4]


def test_summary_of_lags():
    assert lag.summarize_lags(range(1, 11)) == {"ops": 10, "median": 5.5, "p90": 10, "max": 10}
    assert lag.summarize_lags([]) == {"ops": 0, "median": None, "p90": None, "max": None}


def test_allocator_lags_count_allocations_between_a_markers_free_and_its_completion():
    marker = lag.MARKER_BYTES
    entries = [
        ("alloc", 1, 512),
        ("free_requested", 9, marker),  # marker A freed: 1 allocation so far
        ("alloc", 2, 512),
        ("alloc", 3, marker),  # a marker's own allocation is not counted
        ("alloc", 4, 512),
        ("free_completed", 9, marker),  # A completes after 2 more allocations
        ("free_requested", 8, marker),  # marker B never completes before the end
        ("alloc", 5, 512),
    ]
    assert lag.allocator_lags(entries, marker) == [2, 1]
