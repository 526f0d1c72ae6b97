"""benchmarks/torchtitan_rows.py: 2024's micro-batches, ``--torch-version`` and ``--lags``.

torchtitan's published 405B PP rows ran on torch 1963fc83 (2024-12-23, 2.6's development line)
with torchtitan 9dec370. Two things of that run the benchmark states:

- 9dec370 split the local batch into as many micro-batches as the pipeline degree for every
  schedule (torchtitan/parallelisms/pipelining_utils.py ``build_pipeline_schedule``); the
  number of stages became the default only on 2025-01-07 (torchtitan 90567fc).
- torch before 2.8 recorded ProcessGroupNCCL's stream on every collective's tensors, so the
  peak depends on how far the GPU trails the CPU: predicted for torch 2.6 a row is a range
  (``gpu_timing``), and ``--lags`` replays it with the GPU a given number of allocations behind.

The timing tests run the benchmark's own functions on llama3's ``debugmodel`` (6 blocks) with
TP 2 x PP 2 on 4 ranks, 1F1B, full AC, eager: TP's DTensor collectives (before 2.8) and the
pipeline's sends and receives (every version) are the ones whose blocks wait.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from _torchtitan_small_job import debug_pp_row  # noqa: E402

from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

_BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_FULL_QUEUE = 1024  # core/trace/delayed_frees.py GPU_LAG_ALLOCATIONS: the range's upper end

_ROW = debug_pp_row("debugmodel-tp2-pp2-1f1b", fsdp=1, tp=2)


@pytest.fixture(scope="module")
def predicted(rows_module):
    """The row's rank 0 predicted for torch 2.13 (the installed one's rules) and for 2.6 with
    the GPU 0 and a full launch queue behind."""
    saved = rows_module._TORCH_VERSION, rows_module._LAGS, rows_module._gpu_timing
    kept: dict = {}  # torch version -> (recording, prediction): the bytes the GiB round off

    def gpu_timing(recording, prediction, target):
        kept[target.torch_version] = recording, prediction
        return saved[2](recording, prediction, target)

    try:
        rows_module._gpu_timing = gpu_timing
        rows_module._TORCH_VERSION, rows_module._LAGS = "2.13", ()
        newest = rows_module._predict_row(_ROW, "cross_entropy")
        rows_module._TORCH_VERSION, rows_module._LAGS = "2.6", (0, 8, _FULL_QUEUE)
        older = rows_module._predict_row(_ROW, "cross_entropy")
    finally:
        rows_module._TORCH_VERSION, rows_module._LAGS, rows_module._gpu_timing = saved
    newest["_recorded"], older["_recorded"] = kept["2.13"], kept["2.6"]
    return newest, older


def _published_row(rows_module, row_id: str) -> dict:
    import json

    data = json.loads((_BENCHMARKS / "data" / "torchtitan_published.json").read_text())
    return next(row for row in data["rows"] if row["id"] == row_id)


def test_2024_splits_every_schedule_into_pp_degree_micro_batches(rows_module):
    """The 405B PP rows: 8 micro-batches of 4 under 1F1B and Interleaved1F1B alike (local batch
    32, PP 8); the CP rows (local batch 8): 8 of 1."""
    for row_id in ("405b-fsdp8-tp8-pp8-1f1b", "405b-fsdp8-tp8-pp8-interleaved"):
        row = _published_row(rows_module, row_id)
        assert rows_module._microbatch_size(row) == 4
        assert "--parallelism.pipeline_parallel_microbatch_size" in rows_module._overrides(row)
    cp_row = _published_row(rows_module, "405b-fsdp1-tp8-pp8-cp8-256k")
    assert rows_module._microbatch_size(cp_row) == 1


def test_torch_2_13_waits_only_on_the_pipeline_buffers(predicted):
    """torch 2.13's ProcessGroupNCCL uses no record_stream for collectives, but its
    pointToPoint still records its stream on every send and receive buffer (stream_timeline.py
    P2P_FUNCTIONS): the waiting allocations are the pipeline's, and the range's upper end is
    one sent activation above the lower."""
    newest, _ = predicted
    timing = newest["gpu_timing"]
    assert timing["torch_version"] == "2.13"
    recording, prediction = newest["_recorded"]
    ids = recording.collective_ids
    assert ids is not None and timing["collective_allocations"] == len(ids) == 10
    sizes = sorted(e.size for e in recording.events if e.action == "alloc" and e.address in ids)
    # Per micro-batch (2 of 2 rows) stage 0's output, sequence-sharded by TP 2, bf16:
    # 2 x (512 / 2) x 256 x 2 bytes = 256 KiB: sent each of the 2 steps' 2 micro-batches (4),
    # and the 2 receive buffers of its input gradients; the metadata exchange's two int64 sizes
    # (send_object_list's torch.cat of the size, recv_object_list's) and two pickled payloads.
    activation = 2 * (512 // 2) * 256 * 2
    assert sizes == [8, 8, 394, 395] + [activation] * 6
    memory = prediction.distributed
    assert memory is not None
    low_reserved, low_allocated = prediction.peak_reserved_bytes, prediction.peak_allocated_bytes
    # A micro-batch's sent activation, freed after its backward, is still held at the peak in
    # the next one's backward: +256 KiB allocated, one more 2 MiB small-pool segment.
    assert memory.allocated_range_bytes == (low_allocated, low_allocated + activation)
    assert memory.reserved_range_bytes == (low_reserved, low_reserved + 2 * (1 << 20))
    # The benchmark's JSON gives both ends rounded to 0.01 GiB (the lower end is its headline).
    assert timing["reserved_range_gib"] == [round(b / 2**30, 2) for b in memory.reserved_range_bytes]
    assert timing["reserved_range_gib"][0] == newest["predicted_reserved_gib"]
    assert "pointToPoint calls record_stream on the 10 allocation(s)" in (memory.timing_note or "")
    assert "reserved_allocated_gib_at_lag" not in timing


def test_torch_2_6_gives_the_range_and_each_lag(predicted):
    """torch 2.6: TP's collectives touched allocations whose frees wait on the GPU; the lower
    end is the verdict's figure and 2.13's (the same requests in the same order), lag 0 replays
    it exactly, a full launch queue is the upper end exactly and higher, and holding blocks
    longer never lowers the peak allocated."""
    newest, older = predicted
    timing = older["gpu_timing"]
    assert timing["torch_version"] == "2.6"
    assert timing["collective_allocations"] > 0
    low, high = timing["reserved_range_gib"]
    assert low == older["predicted_reserved_gib"] == newest["predicted_reserved_gib"]
    assert timing["allocated_range_gib"][0] == older["predicted_allocated_gib"]
    at_lag = timing["reserved_allocated_gib_at_lag"]
    assert list(at_lag) == ["0", "8", str(_FULL_QUEUE)]
    assert at_lag["0"] == [low, older["predicted_allocated_gib"]]
    assert at_lag[str(_FULL_QUEUE)] == [high, timing["allocated_range_gib"][1]]
    assert at_lag["0"][1] <= at_lag["8"][1] <= at_lag[str(_FULL_QUEUE)][1]
    assert high > low  # TP's blocks held a full launch queue longer: a higher peak
