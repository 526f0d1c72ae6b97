"""`oomkit fit --fsdp N` (rank 0's per-rank batch) and `fit --smallest-gpu --global-batch B`."""

from __future__ import annotations

import pytest
from _parallel_helpers import cli_json

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")


@pytest.fixture
def gpt2_tiny(monkeypatch):
    """A one-layer GPT-2 (width 256, vocabulary 8192, 512 positions) as preset gpt2-tiny: the
    search over ranks and GPU counts, not the depth, is what these tests are about."""
    import dataclasses
    from types import MappingProxyType

    from oomkit.prediction.models import presets
    from oomkit.prediction.models.gpt2 import GPT2Shape

    base = presets.get_preset("gpt2-124m")
    shape = GPT2Shape(hidden=256, layers=1, heads=4, vocab=8192, positions=512)
    preset = dataclasses.replace(base, name="gpt2-tiny", title="GPT-2 tiny", shape=shape)
    monkeypatch.setattr(presets, "PRESETS", MappingProxyType({**presets.PRESETS, "gpt2-tiny": preset}))
    return "gpt2-tiny"


def test_fit_fsdp_searches_the_per_rank_batch_of_rank_0(gpt2_tiny):
    """GPT-2 (one layer) over 2 FSDP2 ranks: batch 2 per rank (the bound) fits an H100, and the
    answer is rank 0's sharded step."""
    code, data = cli_json(
        ["fit", gpt2_tiny, "--fsdp", "2", "--seq", "16", "--batch", "2", "--max-batch", "2",
         "--steps", "1", "--json"]
    )
    assert code == 0
    assert data["batch_size"] == 2
    assert data["description"] == (
        "GPT-2 tiny, batch 2, seq 16, bf16-mixed, adamw, train, FSDP2 over 2 ranks "
        "(2 units: per block + root), rank 0"
    )
    assert any("rank 0 of a fake process group" in w for w in data["warnings"])
    assert data["parallel"]["layout"] == "FSDP2 2"
    assert data["parallel"]["global_batch_size"] == 4
    assert data["verdict"].endswith("global batch 4 over 2 data-parallel ranks")


def test_smallest_gpu_global_batch_tabulates_counts(gpt2_tiny):
    """Global batch 2 up to 4 GPUs: counts 1 and 2 recorded once each, 4 skipped; GPT-2 (one
    layer) fits the smallest catalog GPU at one GPU already."""
    code, data = cli_json(
        ["fit", gpt2_tiny, "--smallest-gpu", "--global-batch", "2", "--max-gpus", "4",
         "--seq", "16", "--steps", "1", "--json"]
    )
    assert code == 0
    assert [(r["gpu_count"], r["per_rank_batch"]) for r in data["rows"]] == [(1, 2), (2, 1)]
    assert data["skipped_counts"] == [4] and data["traces"] == 2
    assert "FSDP2 over 2 ranks" in data["rows"][1]["description"]
    assert data["least_memory"]["gpu_count"] == 1
    smallest = data["rows"][0]["candidates"][0]
    assert smallest["fits"] and data["least_memory"]["gpu"] == smallest["gpu"]
    assert len(data["rows"][0]["candidates"]) == len(data["rows"][1]["candidates"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fit", "gpt2-124m", "--global-batch", "8"], "--global-batch goes with --smallest-gpu"),
        (["fit", "gpt2-124m", "--smallest-gpu", "--global-batch", "8", "--fsdp", "2"], "drop"),
        (["fit", "gpt2-124m", "--fsdp", "2", "--smallest-gpu", "--batch", "2"], "--global-batch"),
        (["fit", "gpt2-124m", "--fsdp", "2", "--tp", "2"], "--tp is modelled for the Llama presets"),
    ],
)
def test_refusals_exit_2(argv, message, capsys):
    """Flag combinations fit cannot answer are refused before anything is recorded."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err
