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


def _live_at_backward_starts(recording):
    """Live bytes by category (512-byte blocks) where each backward starts."""
    live: dict[int, tuple[int, str]] = {}
    marks, phase = [], None
    for event in recording.events:
        if event.action == "alloc":
            if event.tag("phase") == "backward" and phase != "backward":
                totals: dict[str, int] = {}
                for size, category in live.values():
                    totals[category] = totals.get(category, 0) + size
                marks.append(totals)
            phase = event.tag("phase")
            live[event.address] = (-(-event.size // 512) * 512, event.tag("category"))
        elif event.action == "free_requested":
            live.pop(event.address, None)
    return marks


def _unit_shard_bytes(shapes):
    """One FSDP2 unit's reduce-scatter output over 2 ranks: the padded flat shard (chunk 0 of
    each parameter's rows, fp32), one allocation, in 512-byte blocks; the sharded gradients
    are views of it (reduce dtype = parameter dtype: _fsdp_collectives.py foreach_reduce)."""
    nbytes = 0
    for shape in shapes:
        rows, numel = shape[0], 1
        for n in shape:
            numel *= n
        nbytes += -(-rows // 2) * (numel // rows) * 4
    return -(-nbytes // 512) * 512


def test_the_second_micro_batch_holds_the_first_ones_sharded_gradients(tiny):
    """K=2: where micro-batch 2's backward starts, everything but the cuBLAS workspace (made
    in micro-batch 1's backward) is as at micro-batch 1's, plus the sharded gradients: one
    reduce-scatter output per FSDP unit (2 blocks + root), to the byte."""
    options = StepOptions(batch_size=2, seq_len=16, precision="fp32", grad_accum=2)

    def build(mesh):
        built = parallel.build_fsdp_preset_step("tiny", options, mesh)
        return built.step_fn, built.track

    first, second = _live_at_backward_starts(trace_distributed_step(build, world_size=2))
    h, kv, ffn, vocab = _SHAPE.hidden, _SHAPE.kv_heads * 16, _SHAPE.intermediate, _SHAPE.vocab
    block = [(h, h), (kv, h), (kv, h), (h, h), (ffn, h), (ffn, h), (h, ffn), (h,), (h,)]
    root = [(vocab, h), (vocab, h), (h,)]
    expected = _SHAPE.layers * _unit_shard_bytes(block) + _unit_shard_bytes(root)
    assert expected == 214528
    assert second.pop("gradient") == expected
    assert "gradient" not in first
    first.pop("workspace"), second.pop("workspace")
    assert second == first


def test_clipping_is_still_refused(tiny):
    """max_grad_norm under FSDP (DTensor clipping) stays refused, naming what to drop."""
    options = StepOptions(batch_size=2, seq_len=16, precision="fp32", max_grad_norm=1.0)

    def build(mesh):
        built = parallel.build_fsdp_preset_step("tiny", options, mesh)
        return built.step_fn, built.track

    with pytest.raises(ConfigError, match="does not model gradient clipping"):
        trace_distributed_step(build, world_size=2)
