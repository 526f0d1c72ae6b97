"""benchmarks/torchtitan_rows.py ``--stages``: a pipeline row's every stage, the maximum compared.

torchtitan's table takes, for PP, "the maximum across all GPUs" (its footnote); the benchmark
predicted rank 0 (stage 0) only, and for the 405B 1F1B row stage 1 peaks higher (16 blocks to
stage 0's 15 and the embedding). These tests run the benchmark's own functions on llama3's
``debugmodel`` (6 blocks) with FSDP 2 x PP 2 on 4 ranks, 1F1B, eager: torchtitan puts ``pp``
outermost in its mesh, so ranks 0-1 run stage 0 and ranks 2-3 stage 1.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

from _torchtitan_small_job import debug_pp_row  # noqa: E402

from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)


_ROW = debug_pp_row("debugmodel-fsdp2-pp2-1f1b", fsdp=2, tp=1)


def test_each_stage_first_rank_from_the_outermost_pp(rows_module):
    """``pp`` outermost: stage s starts at rank s * world / pp (the 405B rows: every 64th)."""
    assert rows_module._stage_ranks(_ROW) == (0, 2)
    row = {"gpus": 512, "layout": {"fsdp": 8, "tp": 8, "pp": 8, "cp": 1}}
    assert rows_module._stage_ranks(row) == (0, 64, 128, 192, 256, 320, 384, 448)
    assert rows_module._stage_ranks({"gpus": 8, "layout": {"fsdp": 8, "tp": 1}}) == (0,)


def test_stages_predicts_every_stage_and_keeps_the_highest(rows_module):
    """Rank 2 runs stage 1 in torchtitan's own mesh; the row's figures are the higher stage's,
    each stage's peak is kept, and the wall time is both predictions'."""
    got = rows_module._predict_stages(_ROW, "cross_entropy")
    stages = got["stages"]
    assert [stage["rank"] for stage in stages] == [0, 2]
    assert "this rank runs stage 0 (tok_embeddings, layers 0-2)" in stages[0]["description"]
    assert "this rank runs stage 1 (layers 3-5, norm, lm_head)" in stages[1]["description"]
    assert "rank 2 of 4" in stages[1]["description"]
    peaks = [stage["predicted_reserved_gib"] for stage in stages]
    assert got["predicted_reserved_gib"] == max(peaks)
    assert got["peak_rank"] == got["rank"] == stages[peaks.index(max(peaks))]["rank"]
    assert got["wall_s"] == pytest.approx(sum(stage["wall_s"] for stage in stages), abs=0.11)
