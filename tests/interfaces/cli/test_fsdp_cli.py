"""`oomkit predict PRESET --fsdp N`: rank 0 of an FSDP2-sharded preset, and its refusals."""

from __future__ import annotations

import json

import pytest
from _parallel_helpers import FSDP_STEP, api_prediction, record_user_step, write_step

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def gpt2_fsdp2_json():
    """GPT-2 (124M's preset with one layer, width 256, vocabulary 8192: the layout, not the
    depth, is the point) sharded over 2 ranks, one step, as --json prints it."""
    import contextlib
    import dataclasses
    import io
    from types import MappingProxyType

    from oomkit.prediction.models import presets
    from oomkit.prediction.models.gpt2 import GPT2Shape

    shape = GPT2Shape(hidden=256, layers=1, heads=4, vocab=8192, positions=512)
    tiny = dataclasses.replace(presets.get_preset("gpt2-124m"), name="gpt2-tiny", title="GPT-2 tiny",
                               shape=shape)
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(presets, "PRESETS", MappingProxyType({**presets.PRESETS, "gpt2-tiny": tiny}))
        code = main(
            ["predict", "gpt2-tiny", "--fsdp", "2", "--batch", "1", "--seq", "16", "--steps", "1",
             "--json"]
        )
    return code, json.loads(out.getvalue())


def test_fsdp_prediction_is_rank_0_of_the_layout(gpt2_fsdp2_json):
    """The result names the layout, the per-rank batch and FSDP2's units; it fits an H100."""
    import torch.distributed as dist

    code, data = gpt2_fsdp2_json
    assert code == 0
    assert data["target"]["parallel"] == {"fsdp": 2, "tp": 1, "dp": 1, "pp": 1, "cp": 1}
    assert data["workload"]["options"]["batch_size"] == 1
    assert data["description"] == (
        "GPT-2 tiny, batch 1, seq 16, bf16-mixed, adamw, train, FSDP2 over 2 ranks "
        "(2 units: per block + root), rank 0"
    )
    assert any("rank 0 of a fake process group" in w for w in data["warnings"])
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["predict", "gpt2-124m", "--fsdp", "0"], "at least 1"),
        (["predict", "bert-base", "--fsdp", "2"], "modelled for the GPT-2 and Llama presets"),
        (["predict", "gpt2-124m", "--fsdp", "2", "--precision", "fp16-mixed"], "ShardedGradScaler"),
        (["predict", "--fsdp", "2", "--hf", "gpt2"], "--hf models are not sharded"),
        (["predict", "gpt2-124m", "--fsdp", "2", "--optimizer", "sgd", "--hf", "x"], "--hf"),
        (["predict", "gpt2-124m", "--fsdp", "2", "--lengths", "l.txt"], "--lengths"),
    ],
)
def test_fsdp_refusals_exit_2(argv, message, capsys):
    """What --fsdp does not model is refused with exit 2 and says what to do."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_user_function_takes_the_mesh_and_shards_itself(tmp_path, capsys):
    """A file.py:function gets mesh and world_size; rank 0 holds half of each fp32 weight."""
    path = write_step(tmp_path, "sharded", FSDP_STEP)
    code = main(["predict", f"{path}:build", "--fsdp", "2", "--batch", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["description"] == f"{path}:build(batch_size=2), FSDP2 over 2 ranks, rank 0"
    assert data["target"]["parallel"] == {"fsdp": 2, "tp": 1, "dp": 1, "pp": 1, "cp": 1}
    # Two 64x64 fp32 weights, 32 rows each on rank 0: 8 KiB apiece (512-byte multiples).
    assert data["by_category_bytes"]["parameter"] == 2 * 32 * 64 * 4


def test_user_function_that_does_not_shard_is_refused(tmp_path, capsys):
    """--fsdp with a function whose model is not sharded exits 2 saying to call fully_shard."""
    path = write_step(tmp_path, "sharded", FSDP_STEP)
    assert main(["predict", f"{path}:plain", "--fsdp", "2"]) == 2
    assert "call fully_shard(block, mesh=mesh)" in capsys.readouterr().err


def test_user_function_prediction_matches_the_api(tmp_path, capsys):
    """The CLI's peaks are those of trace_distributed_step + predict_recording, to the byte."""
    path = write_step(tmp_path, "sharded_api", FSDP_STEP)
    assert main(["predict", f"{path}:build", "--fsdp", "4", "--batch", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    recording = record_user_step(path, ranks=4, world_size=4, batch_size=3)
    prediction = api_prediction(data, recording)
    assert data["peak_allocated_bytes"] == prediction.peak_allocated_bytes
    assert data["peak_reserved_bytes"] == prediction.peak_reserved_bytes
    assert data["by_category_bytes"]["parameter"] == 2 * 16 * 64 * 4  # 16 of 64 rows each


def test_dp_with_tp_alone_is_refused(capsys):
    """--dp with --tp and no --fsdp (DDP of a TP model) parses into the layout but predict
    refuses it plainly (HSDP, --dp with --fsdp, is modelled: test_hsdp_cli.py)."""
    from oomkit.interfaces.cli import main

    code = main(["predict", "llama3-8b", "--dp", "2", "--tp", "2", "--batch", "1", "--seq", "16"])
    assert code == 2
    assert "is not modelled: add --fsdp S" in capsys.readouterr().err
