"""Presets sharded with FSDP2 per block + root (built under a fake process group, not traced)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from oomkit.errors import ConfigError
from oomkit.prediction.models import StepOptions
from oomkit.prediction.models.parallel import build_fsdp_preset_step
from oomkit.prediction.tracing.distributed import fake_process_group


def _built(name: str, world_size: int, **options):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_process_group(world_size) as mesh, FakeTensorMode():
        built = build_fsdp_preset_step(name, StepOptions(batch_size=2, seq_len=32, **options), mesh)
    assert not dist.is_initialized()
    return built


def test_llama_blocks_and_root_are_fsdp_units_with_padded_shards():
    """Llama 3.2 1B over 4 ranks: 17 units; each local shard has ceil(rows / 4) rows, fp32."""
    from torch.distributed.fsdp import FSDPModule

    built = _built("llama-1b", 4, precision="bf16-mixed")
    model, optimizer, ids, _labels = built.track
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    assert len(units) == 17 and units[0] is model and units[1] is model.layers[0]
    for param in model.parameters():
        local = param.to_local()
        assert local.dtype == torch.float32
        assert local.shape[0] == math.ceil(param.shape[0] / 4)
        assert local.shape[1:] == param.shape[1:]
    assert model.embed_tokens.weight.to_local().shape == (32064, 2048)  # 128256 / 4
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: sharded once
    assert optimizer.param_groups[0]["params"][0] is model.embed_tokens.weight
    assert tuple(ids.shape) == (2, 32)  # the per-rank batch
    assert "FSDP2 over 4 ranks (17 units: per block + root), rank 0" in built.description


def test_bf16_mixed_is_a_mixed_precision_policy_and_bf16_shards_bf16():
    """bf16-mixed gathers bf16 and reduces fp32; bf16 shards bf16 (tied) parameters, no policy."""
    mixed = _built("gpt2-124m", 2, precision="bf16-mixed").track[0]
    policy = mixed._get_fsdp_state()._mp_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    pure = _built("gpt2-124m", 2, precision="bf16").track[0]
    assert pure._get_fsdp_state()._mp_policy.param_dtype is None
    assert {p.to_local().dtype for p in pure.parameters()} == {torch.bfloat16}
    assert pure.lm_head.weight is pure.wte.weight  # still tied after the cast


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("resnet50", {}, "modelled for the GPT-2 and Llama presets"),
        ("gpt2-124m", {"precision": "fp16-mixed"}, "ShardedGradScaler"),
        ("gpt2-124m", {"mode": "generate"}, "train and inference"),
    ],
)
def test_refused(name, options, message):
    """What FSDP is not modelled for is a ConfigError, and the group is gone afterwards."""
    with pytest.raises(ConfigError, match=message):
        _built(name, 2, **options)
