"""Gradient accumulation under FSDP2: a reduce-scatter per micro-batch, shards summed in place."""

from __future__ import annotations

import pytest

from oomkit.core.gpus import get_gpu
from oomkit.core.target import Target
from oomkit.errors import ConfigError
from oomkit.prediction.models import StepOptions, parallel
from oomkit.prediction.models.llama import LlamaShape
from oomkit.prediction.models.presets import ModelPreset
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.tracing.distributed import trace_distributed_step

_SHAPE = LlamaShape(
    hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256, tied=False,
    positions=128,
)


@pytest.fixture
def tiny(monkeypatch):
    """build_fsdp_preset_step builds the tiny Llama whatever preset it is named."""
    preset = ModelPreset("tiny", "Tiny Llama", _SHAPE, 16, "test", default_precision="fp32")
    monkeypatch.setattr(parallel, "shaped_preset", lambda name, options: preset)


def _predict(grad_accum):
    options = StepOptions(batch_size=2, seq_len=16, precision="fp32", grad_accum=grad_accum)

    def build(mesh):
        built = parallel.build_fsdp_preset_step("tiny", options, mesh)
        return built.step_fn, built.track

    recording = trace_distributed_step(build, world_size=2)
    prediction = predict_recording(recording, target=Target(get_gpu("h100")))
    scatters = sum(
        1 for e in recording.events
        if e.action == "alloc" and e.tag("category") == "reduce_scatter_buffer"
    )
    return prediction, scatters


def _sharded_gradient_bytes(prediction):
    """The gradients alive when the optimizer step starts: FSDP2's sharded ones only."""
    return prediction.peak_allocated_at.by_category_bytes.get("gradient", 0)


def test_each_micro_batch_reduce_scatters_and_later_ones_add_in_place(tiny):
    """K micro-batches reduce-scatter K times per FSDP unit (torchtitan never turns the sync
    off); from the second on the shards add in place, so K=3 peaks exactly as K=2 does."""
    one, one_scatters = _predict(1)
    two, two_scatters = _predict(2)
    three, three_scatters = _predict(3)
    units = _SHAPE.layers + 1  # fully_shard per block + root
    assert (one_scatters, two_scatters, three_scatters) == (units, 2 * units, 3 * units)
    assert two.peak_allocated_bytes > one.peak_allocated_bytes
    assert three.peak_allocated_bytes == two.peak_allocated_bytes
    assert three.peak_reserved_bytes == two.peak_reserved_bytes
    assert "accumulate 2" in (two.description or "") or two.workload is None


def test_k2_peak_adds_the_first_micro_batch_shards_held_through_the_second(tiny):
    """K=2 peaks in the second micro-batch's backward, where the first one's sharded
    gradients (fp32, half of each parameter over FSDP 2, 512-byte blocks) are held."""
    one, _ = _predict(1)
    two, _ = _predict(2)
    h, kv = _SHAPE.hidden, _SHAPE.kv_heads * _SHAPE.hidden // _SHAPE.heads
    shapes = [(_SHAPE.vocab, h), (_SHAPE.vocab, h), (h,)]  # embedding, LM head, norm
    for _ in range(_SHAPE.layers):
        shapes += [(h, h), (kv, h), (kv, h), (h, h), (_SHAPE.intermediate, h),
                   (_SHAPE.intermediate, h), (h, _SHAPE.intermediate), (h,), (h,)]
    shard_blocks = 0
    for shape in shapes:
        rows = shape[0]
        numel = 1
        for n in shape:
            numel *= n
        shard = -(-rows // 2) * (numel // rows) * 4
        shard_blocks += -(-shard // 512) * 512
    at_two = two.peak_allocated_at.by_category_bytes
    assert at_two["gradient"] >= shard_blocks
    assert _sharded_gradient_bytes(two) > _sharded_gradient_bytes(one)


def test_clipping_is_still_refused(tiny):
    """max_grad_norm under FSDP (DTensor clipping) stays refused, naming what to drop."""
    options = StepOptions(batch_size=2, seq_len=16, precision="fp32", max_grad_norm=1.0)

    def build(mesh):
        built = parallel.build_fsdp_preset_step("tiny", options, mesh)
        return built.step_fn, built.track

    with pytest.raises(ConfigError, match="does not model gradient clipping"):
        trace_distributed_step(build, world_size=2)
