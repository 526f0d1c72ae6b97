"""`oomkit predict PRESET --dp N`: rank 0 of a preset replicated with DDP, and its refusals."""

from __future__ import annotations

import json

import pytest

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

# ResNet-50's bottleneck layout with one block a stage (torchvision's resnet with layers
# [1, 1, 1, 1]): 10,064,936 parameters (resnet_parameter_count; 25,557,032 for [3, 4, 6, 3]),
# all fp32 here: 3 buckets of DDP's 25 MiB (the first 1 MiB), as ResNet-50's ~5 are.
_RESNET_PARAMETERS = 10_064_936


@pytest.fixture(scope="module")
def resnet_ddp_json():
    """ResNet (one bottleneck a stage) over 2 DDP replicas, two steps (the buckets are rebuilt
    in the second)."""
    import contextlib
    import dataclasses
    import io
    from types import MappingProxyType

    from oomkit.prediction.models import presets

    base = presets.get_preset("resnet50")
    tiny = dataclasses.replace(base, name="resnet-tiny", title="ResNet tiny",
                               shape=dataclasses.replace(base.shape, blocks=(1, 1, 1, 1)))
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(presets, "PRESETS", MappingProxyType({**presets.PRESETS, "resnet-tiny": tiny}))
        code = main(
            ["predict", "resnet-tiny", "--dp", "2", "--batch", "2", "--image-size", "32",
             "--steps", "2", "--json"]
        )
    return code, json.loads(out.getvalue())


def test_ddp_prediction_is_rank_0_with_gradient_buckets(resnet_ddp_json):
    """The result names the layout and the buckets; the buckets hold every fp32 gradient."""
    import torch.distributed as dist

    code, data = resnet_ddp_json
    assert code == 0
    assert data["target"]["parallel"] == {"fsdp": 1, "tp": 1, "dp": 2, "pp": 1, "cp": 1}
    assert data["description"] == (
        "ResNet tiny, batch 2, image 32, fp32, adamw, train, DDP over 2 replicas "
        "(buckets 25 MiB (first 1 MiB)), rank 0"
    )
    bucket_bytes = data["by_category_bytes"]["ddp_bucket"]
    # Each of the 3 buckets is one block; at most 2 MiB of rounding in all.
    assert data["by_category_bytes"]["parameter"] >= 4 * _RESNET_PARAMETERS
    assert 4 * _RESNET_PARAMETERS <= bucket_bytes <= 4 * _RESNET_PARAMETERS + 2 * 2**20
    assert any(w.startswith("DDP: every replica holds") for w in data["warnings"])
    assert not any("ranks differ" in w for w in data["warnings"])
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["predict", "llama3-8b", "--dp", "2", "--tp", "2"], "HSDP x TP"),
        (["predict", "gpt2-124m", "--bucket-cap-mb", "5"], "go with --dp N"),
        (["predict", "gpt2-124m", "--gradient-as-bucket-view", "--fsdp", "2"], "go with --dp N"),
        (["predict", "gpt2-124m", "--dp", "2", "--mode", "inference"], "--mode train"),
        (["predict", "--dp", "2", "--hf", "gpt2"], "--hf models are not sharded by oomkit yet"),
    ],
)
def test_ddp_refusals_exit_2(argv, message, capsys):
    """What --dp does not model is refused with exit 2 and says what to do."""
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("cap", ["0", "-3", "inf", "nan", "x"])
def test_bad_bucket_cap_is_a_usage_error(cap, capsys):
    """--bucket-cap-mb takes a finite number of MiB above 0; anything else exits 2, naming it."""
    assert main(["predict", "gpt2-124m", "--dp", "2", "--bucket-cap-mb", cap]) == 2
    err = capsys.readouterr().err
    assert "--bucket-cap-mb (parallel.bucket_cap_mb): " in err and f"got '{cap}'" in err
