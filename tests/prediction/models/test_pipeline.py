"""Pipeline parallel: torchtitan's stage split and torch's real schedules on a fake group, in bytes."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomkit.core.target import ParallelLayout
from oomkit.errors import ConfigError
from oomkit.prediction.models import StepOptions, pipeline
from oomkit.prediction.models.llama import LlamaShape
from oomkit.prediction.models.presets import ModelPreset
from oomkit.prediction.tracing.distributed import trace_distributed_step

# A tiny Llama: hidden 64, 4 heads (2 KV heads), FFN 128, vocabulary 256, 4 blocks.
_SHAPE = LlamaShape(
    hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=256, tied=False,
    positions=128,
)
_SEQ = 16


@pytest.fixture
def tiny(monkeypatch):
    """build_pipeline_preset_step builds the tiny Llama whatever preset it is named."""
    preset = ModelPreset("tiny", "Tiny Llama", _SHAPE, _SEQ, "test", default_precision="fp32")
    monkeypatch.setattr(pipeline, "shaped_preset", lambda name, options: preset)


@functools.cache
def _record(schedule, rank, microbatches, batch, *, stages_per_rank=None, fsdp=1):
    """(recording, built step) of the tiny Llama's pipeline (``tiny`` in effect): once per
    arguments, for the tests that read the same one (they only read it)."""
    layout = ParallelLayout(pp=2, fsdp=fsdp)
    options = StepOptions(batch_size=batch, seq_len=_SEQ, precision="fp32")
    pipe = pipeline.PipelineOptions(2, schedule, microbatches, stages_per_rank)
    built = []

    def build(mesh):
        step = pipeline.build_pipeline_preset_step("tiny", options, mesh, pipe)
        built.append(step)
        return step.step_fn, step.track

    recording = trace_distributed_step(
        build, world_size=layout.world_size, mesh_shape=layout.mesh_shape, rank=rank
    )
    return recording, built[0]


def _live_peak_bytes(recording, category="activation"):
    """The most bytes of ``category`` alive at once over the recording."""
    live = peak = 0
    sizes: dict[int, int] = {}
    for event in recording.events:
        if event.tag("category") != category:
            continue
        if event.action == "alloc":
            sizes[event.address] = event.size
            live += event.size
            peak = max(peak, live)
        elif event.action == "free_requested" and event.address in sizes:
            live -= sizes.pop(event.address)
    return peak


def test_1f1b_keeps_pp_micro_batches_in_flight_on_stage_0_gpipe_all(tiny):
    """Stage 0 of PP 2, M=4: 1F1B keeps 2 micro-batches' activations, GPipe 4 (exact bytes)."""
    one, _ = _record("gpipe", 0, 1, 1)
    per_micro_batch = _live_peak_bytes(one)
    assert per_micro_batch > 0
    gpipe, _ = _record("gpipe", 0, 4, 4)
    one_f_one_b, built = _record("1f1b", 0, 4, 4)
    # torch/distributed/pipelining/schedules.py Schedule1F1B: stage s warms up with
    # min(M, pp - s) forwards before its first backward; GPipe runs all M forwards first.
    assert _live_peak_bytes(gpipe) == 4 * per_micro_batch
    assert _live_peak_bytes(one_f_one_b) == 2 * per_micro_batch
    assert _live_peak_bytes(gpipe) - _live_peak_bytes(one_f_one_b) == 2 * per_micro_batch
    assert "stage(s) 0 with blocks 0-1" in built.description


def test_last_stage_holds_one_micro_batch_under_1f1b(tiny):
    """Stage 1 (last) of PP 2, M=4: GPipe holds 4 micro-batches; 1F1B one, plus the logits and
    loss of each finished one, which the schedule keeps until the step ends."""
    per_micro_batch = _live_peak_bytes(_record("gpipe", 1, 1, 1)[0])
    gpipe, _ = _record("gpipe", 1, 4, 4)
    one_f_one_b, built = _record("1f1b", 1, 4, 4)
    assert _live_peak_bytes(gpipe) == 4 * per_micro_batch
    # torch/distributed/pipelining/stage.py forward_one_chunk: the last stage appends each
    # output to output_chunks (for merge_output_chunks); schedules.py _maybe_compute_loss
    # appends each loss to _internal_losses. fp32 logits [1, seq, vocab] and a 4-byte loss.
    kept_bytes = 1 * _SEQ * _SHAPE.vocab * 4 + 4
    assert _live_peak_bytes(one_f_one_b) == per_micro_batch + 3 * kept_bytes
    assert "stage(s) 1 with blocks 2-3" in built.description


def test_stage_parameters_are_the_stage_blocks(tiny):
    """Rank 0 holds the embedding and blocks 0-1; rank 1 blocks 2-3, the norm and LM head."""
    h, kv = _SHAPE.hidden, _SHAPE.kv_heads * _SHAPE.hidden // _SHAPE.heads
    block = 2 * h * h + 2 * kv * h + 3 * h * _SHAPE.intermediate + 2 * h
    _, first = _record("1f1b", 0, 2, 2)
    _, last = _record("1f1b", 1, 2, 2)
    assert first.parameter_count == _SHAPE.vocab * h + 2 * block
    assert last.parameter_count == 2 * block + h + _SHAPE.vocab * h


def test_interleaved_runs_two_stages_per_rank(tiny):
    """Interleaved 1F1B with V=2: rank 0 runs stages 0 and 2 of 4 (torchtitan's loop order)."""
    recording, built = _record("interleaved-1f1b", 0, 4, 4, stages_per_rank=2)
    h, kv = _SHAPE.hidden, _SHAPE.kv_heads * _SHAPE.hidden // _SHAPE.heads
    block = 2 * h * h + 2 * kv * h + 3 * h * _SHAPE.intermediate + 2 * h
    # 4 blocks + 2 end weights over 4 stages: [0], [1, 2], [3], [] (+ norm, LM head).
    assert pipeline.stage_layers(4, 4) == ((0,), (1, 2), (3,), ())
    assert built.parameter_count == _SHAPE.vocab * h + 2 * block
    assert "stage(s) 0, 2 with blocks 0-0; 3-3" in built.description
    assert _live_peak_bytes(recording) > 0


def test_fsdp_times_pp_shards_each_stage(tiny):
    """PP 2 x FSDP 2: rank 0's stage parameters are half of PP 2's alone (fp32, even rows)."""
    alone, _ = _record("1f1b", 0, 2, 2)
    sharded, built = _record("1f1b", 0, 2, 2, fsdp=2)

    def parameter_bytes(recording):
        before = recording.events[: recording.step_starts[0]]
        return sum(e.size for e in before if e.tag("category") == "parameter")

    assert parameter_bytes(sharded) * 2 == parameter_bytes(alone)
    assert "FSDP2 over 2 ranks per stage" in built.description


def test_tp_times_pp_shards_each_stage_and_keeps_loss_parallel(tiny):
    """PP 2 x TP 2, stage 0: the embedding's vocabulary rows and every block Linear / 2 (norms
    whole), as torchtitan's plan; the last stage's logits meta is a vocabulary-sharded DTensor."""
    layout = ParallelLayout(pp=2, tp=2)
    options = StepOptions(batch_size=2, seq_len=_SEQ, precision="fp32")
    built = []

    def build(mesh):
        step = pipeline.build_pipeline_preset_step(
            "tiny", options, mesh, pipeline.PipelineOptions(2, "1f1b", 2)
        )
        built.append(step)
        return step.step_fn, step.track

    trace_distributed_step(build, world_size=4, mesh_shape=layout.mesh_shape)
    h, kv = _SHAPE.hidden, _SHAPE.kv_heads * _SHAPE.hidden // _SHAPE.heads
    linears = 2 * h * h + 2 * kv * h + 3 * h * _SHAPE.intermediate
    local_numel = _SHAPE.vocab * h // 2 + 2 * (linears // 2 + 2 * h)
    assert sum(p.to_local().numel() for p in built[0].track[0].parameters()) == local_numel
    assert "tensor parallel over 2 ranks (loss parallel)" in built[0].description


def test_fsdp_times_tp_times_pp(tiny):
    """PP 2 x FSDP 2 x TP 2 (8 ranks), stage 0: the TP shards of the embedding and blocks
    halved again by FSDP2 (every size even here), sharded per block + stage, loss parallel."""
    layout = ParallelLayout(pp=2, fsdp=2, tp=2)
    options = StepOptions(batch_size=2, seq_len=_SEQ, precision="bf16-mixed")
    built = []

    def build(mesh):
        step = pipeline.build_pipeline_preset_step(
            "tiny", options, mesh, pipeline.PipelineOptions(2, "1f1b", 2)
        )
        built.append(step)
        return step.step_fn, step.track

    recording = trace_distributed_step(build, world_size=8, mesh_shape=layout.mesh_shape)
    h, kv = _SHAPE.hidden, _SHAPE.kv_heads * _SHAPE.hidden // _SHAPE.heads
    linears = 2 * h * h + 2 * kv * h + 3 * h * _SHAPE.intermediate
    tp_numel = _SHAPE.vocab * h // 2 + 2 * (linears // 2 + 2 * h)
    assert sum(p.to_local().numel() for p in built[0].track[0].parameters()) == tp_numel // 2
    # fp32 master shards: 4 bytes an element, each parameter's shard its own allocation.
    before = recording.events[: recording.step_starts[0]]
    assert sum(e.size for e in before if e.tag("category") == "parameter") == 4 * tp_numel // 2
    assert "FSDP2 over 2 ranks per stage" in built[0].description
    assert "tensor parallel over 2 ranks (loss parallel)" in built[0].description


def test_microbatches_must_divide_the_batch(tiny):
    """M=3 does not divide a local batch of 4: refused as torchtitan refuses it."""
    with pytest.raises(ConfigError, match="must divide the local batch 4"):
        _record("1f1b", 0, 3, 4)


def test_single_stage_schedule_refuses_stages_per_rank():
    """1F1B runs one stage per rank; interleaved needs two or more."""
    with pytest.raises(ConfigError, match="runs one stage per rank"):
        pipeline.PipelineOptions(2, "1f1b", None, 2).check()
    with pytest.raises(ConfigError, match="at least 2 stages per rank"):
        pipeline.PipelineOptions(2, "interleaved-1f1b", None, 1).check()


@given(stages=st.integers(1, 40), layers=st.integers(0, 40))
def test_stage_split_partitions_blocks_in_order_or_refuses(stages, layers):
    """Every split covers each block once, in order, or is refused with a ConfigError."""
    try:
        split = pipeline.stage_layers(stages, layers)
    except ConfigError as exc:
        assert "stage" in str(exc)
        assert stages > 1
        return
    assert len(split) == stages
    assert [b for stage in split for b in stage] == list(range(layers))


@given(pp=st.integers(1, 8), virtual=st.integers(1, 4), rank=st.integers(0, 7))
def test_loop_style_stage_ids(pp, virtual, rank):
    """Rank r of pp runs stages r, r + pp, ...: each stage exactly once across the ranks."""
    rank %= pp
    ids = pipeline.stage_ids_of_rank(rank, pp, pp * virtual)
    assert ids == tuple(rank + k * pp for k in range(virtual))
    every = sorted(s for r in range(pp) for s in pipeline.stage_ids_of_rank(r, pp, pp * virtual))
    assert every == list(range(pp * virtual))
