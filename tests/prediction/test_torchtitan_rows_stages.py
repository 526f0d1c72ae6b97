"""benchmarks/torchtitan_rows.py ``--stages``: a pipeline row's every stage, the maximum compared.

torchtitan's table takes, for PP, "the maximum across all GPUs" (its footnote); the benchmark
predicted rank 0 (stage 0) only, and for the 405B 1F1B row stage 1 peaks higher (16 blocks to
stage 0's 15 and the embedding). These tests run the benchmark's own functions on llama3's
``debugmodel`` with FSDP 2 x PP 2 on 4 ranks, 1F1B, eager: torchtitan puts ``pp`` outermost in
its mesh, so ranks 0-1 run stage 0 and ranks 2-3 stage 1. The row's job (``llama3:
llama3_debugmodel``, 6 blocks) is recorded cut to its first 4 blocks (``_torchtitan_four_blocks``):
torchtitan's split counts the embedding and the head as a block each, so each stage still runs
a range of layers, in two thirds of the 6 blocks' time.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan")

from _torchtitan_small_job import debug_pp_row  # noqa: E402

from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)


_ROW = debug_pp_row("debugmodel-fsdp2-pp2-1f1b", fsdp=2, tp=1)
_BLOCKS = 4
_FOUR_BLOCKS = ("_torchtitan_four_blocks", "llama3_debug_four_blocks")


@pytest.fixture
def four_blocks(rows_module, monkeypatch):
    """The benchmark's rows module with the row's own job (the registry's debugmodel, as
    ``_job_name`` names it) swapped for the same model cut to its first 4 blocks."""
    job_name = rows_module._job_name

    def cut(row: dict) -> tuple[str, str]:
        assert job_name(row) == ("llama3", "llama3_debugmodel")
        return _FOUR_BLOCKS

    monkeypatch.setattr(rows_module, "_job_name", cut)
    return rows_module


def test_each_stage_first_rank_from_the_outermost_pp(rows_module):
    """``pp`` outermost: stage s starts at rank s * world / pp (the 405B rows: every 64th)."""
    assert rows_module._stage_ranks(_ROW) == (0, 2)
    row = {"gpus": 512, "layout": {"fsdp": 8, "tp": 8, "pp": 8, "cp": 1}}
    assert rows_module._stage_ranks(row) == (0, 64, 128, 192, 256, 320, 384, 448)
    assert rows_module._stage_ranks({"gpus": 8, "layout": {"fsdp": 8, "tp": 1}}) == (0,)


def test_stages_predicts_every_stage_and_keeps_the_highest(four_blocks):
    """Rank 2 runs stage 1 in torchtitan's own mesh; the row's figures are the higher stage's,
    each stage's peak is kept, and the wall time is both predictions'. Each stage runs half the
    blocks (2 of 4 here: layers 0-1 after the embedding, 2-3 before the norm and the head)."""
    got = four_blocks._predict_stages(_ROW, "cross_entropy")
    stages = got["stages"]
    half = _BLOCKS // 2
    assert [stage["rank"] for stage in stages] == [0, 2]
    assert f"this rank runs stage 0 (tok_embeddings, layers 0-{half - 1})" in stages[0]["description"]
    assert f"this rank runs stage 1 (layers {half}-{_BLOCKS - 1}, norm, lm_head)" in stages[1]["description"]
    assert "rank 2 of 4" in stages[1]["description"]
    peaks = [stage["predicted_reserved_gib"] for stage in stages]
    assert got["predicted_reserved_gib"] == max(peaks)
    assert got["peak_rank"] == got["rank"] == stages[peaks.index(max(peaks))]["rank"]
    assert got["wall_s"] == pytest.approx(sum(stage["wall_s"] for stage in stages), abs=0.11)
