"""Tensor parallel (torchtitan's Llama plan) and FSDP2 x TP on a fake process group, in exact bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from oomkit.errors import ConfigError
from oomkit.prediction.models import PRESETS, StepOptions, tensor_parallel
from oomkit.prediction.models.llama import LlamaShape
from oomkit.prediction.models.presets import ModelPreset
from oomkit.prediction.tracing.distributed import fake_process_group, trace_distributed_step

# A tiny Llama: hidden 64, 4 heads of 16 (2 KV heads), FFN 128, vocabulary 256, 2 blocks.
_SHAPE = LlamaShape(
    hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256, tied=False,
    positions=128,
)
_BATCH, _SEQ = 2, 16


def _tiny(shape: LlamaShape = _SHAPE) -> ModelPreset:
    return ModelPreset("tiny", "Tiny Llama", shape, _SEQ, "test", default_precision="bf16-mixed")


@pytest.fixture
def tiny(monkeypatch):
    """build_tp_preset_step builds the tiny Llama whatever preset it is named."""
    monkeypatch.setattr(tensor_parallel, "shaped_preset", lambda name, options: _tiny())


def _options(**changes) -> StepOptions:
    return dataclasses.replace(
        StepOptions(batch_size=_BATCH, seq_len=_SEQ, precision="fp32"), **changes
    )


def _local_parameter_numel(shape: LlamaShape, tp: int) -> int:
    """Rank 0's parameter elements under the plan: every Linear and the embedding / tp (colwise
    rows, rowwise columns, vocabulary rows), the RMSNorm weights replicated whole."""
    h, kv = shape.hidden, shape.kv_heads * shape.hidden // shape.heads
    linears = h * h + 2 * kv * h + h * h + 3 * h * shape.intermediate
    per_block = linears // tp + 2 * h
    return 2 * shape.vocab * h // tp + shape.layers * per_block + h


def _build(mesh_shape, options, name="tiny"):
    from torch._subclasses.fake_tensor import FakeTensorMode

    sizes, names = mesh_shape
    world = 1
    for size in sizes:
        world *= size
    with fake_process_group(world, mesh_shape=sizes, mesh_dim_names=names) as mesh:
        with FakeTensorMode():
            built = tensor_parallel.build_tp_preset_step(name, options, mesh)
    assert not dist.is_initialized()
    return built


def _record(mesh_shape, options, steps=1):
    sizes, _ = mesh_shape
    world = 1
    for size in sizes:
        world *= size

    def build(mesh):
        built = tensor_parallel.build_tp_preset_step("tiny", options, mesh)
        return built.step_fn, built.track

    return trace_distributed_step(build, world_size=world, mesh_shape=mesh_shape, steps=steps)


def _before_step_bytes(recording, category: str) -> int:
    before = recording.events[: recording.step_starts[0]]
    return sum(e.size for e in before if dict(e.tags)["category"] == category)


def test_plan_shards_colwise_rows_rowwise_columns_and_replicates_norms(tiny):
    """tp=2: q/k/v/gate/up keep half their rows, o/down half their columns, norms whole."""
    model = _build(((2,), ("tp",)), _options()).track[0]
    block = model.layers[0]
    local = {name: tuple(p.to_local().shape) for name, p in block.named_parameters()}
    assert local["self_attn.q_proj.weight"] == (32, 64)  # 2 of 4 heads of 16
    assert local["self_attn.k_proj.weight"] == (16, 64)  # 1 of 2 KV heads
    assert local["self_attn.o_proj.weight"] == (64, 32)
    assert local["mlp.gate_proj.weight"] == local["mlp.up_proj.weight"] == (64, 64)
    assert local["mlp.down_proj.weight"] == (64, 64)
    assert local["input_layernorm.weight"] == (64,)
    assert str(block.input_layernorm.weight.placements) == "(Replicate(),)"
    assert tuple(model.embed_tokens.weight.to_local().shape) == (128, 64)  # vocabulary rows
    assert tuple(model.lm_head.weight.to_local().shape) == (128, 64)
    assert _local_parameter_numel(_SHAPE, 2) == sum(p.to_local().numel() for p in model.parameters())


def test_tied_head_stays_tied_after_the_plan(monkeypatch):
    """A tied LM head (Llama 3.2 1B/3B) is the embedding's one vocabulary-sharded DTensor."""
    tied = dataclasses.replace(_SHAPE, tied=True)
    monkeypatch.setattr(tensor_parallel, "shaped_preset", lambda name, options: _tiny(tied))
    model = _build(((2,), ("tp",)), _options()).track[0]
    assert model.lm_head.weight is model.embed_tokens.weight
    assert tuple(model.lm_head.weight.to_local().shape) == (128, 64)


@pytest.fixture(scope="module")
def tp2_recording():
    """Rank 0 of tp=2, fp32, one training step, recorded (the tiny Llama in place of a preset)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tensor_parallel, "shaped_preset", lambda name, options: _tiny())
        return _record(((2,), ("tp",)), _options())


def test_rank0_parameter_bytes_are_the_plans(tp2_recording):
    """Parameters before step 0: exactly the plan's local elements in fp32 (53,568 x 4 bytes)."""
    assert _before_step_bytes(tp2_recording, "parameter") == 4 * _local_parameter_numel(_SHAPE, 2)
    assert _local_parameter_numel(_SHAPE, 2) == 53_568


def test_step_records_dtensor_collectives_on_the_current_stream(tp2_recording):
    """Sequence parallel: 5 all-gathers of [2, 16, 64] fp32 and 5 reduce-scatters to half of it
    a way (2 blocks x attention + MLP, and the LM head / embedding), on stream 0, no copies."""
    gathers, scatters, waits = [], [], []
    for event in tp2_recording.step_events(0):
        if event.action != "alloc":
            continue
        op = dict(event.tags).get("op", "")
        kind = {
            "_c10d_functional.all_gather_into_tensor.default": gathers,
            "_c10d_functional.reduce_scatter_tensor.default": scatters,
            "_c10d_functional.wait_tensor.default": waits,
        }.get(op)
        if kind is not None:
            kind.append((event.size, event.stream))
    full = _BATCH * _SEQ * _SHAPE.hidden * 4
    assert gathers == [(full, 0)] * 10
    assert scatters == [(full // 2, 0)] * 10
    assert waits == []  # wait_tensor returns its input (tracing/collectives.py)
    assert not any("existed before tracing" in w for w in tp2_recording.warnings)


def test_fsdp2_x_tp2_halves_the_tp_shards_again(tiny):
    """2-D fsdp 2 x tp 2: rank 0 holds the TP-local parameters / 2 (no padding: even rows)."""
    recording = _record(((2, 2), ("fsdp", "tp")), _options(precision="bf16-mixed"))
    assert _before_step_bytes(recording, "parameter") == 4 * _local_parameter_numel(_SHAPE, 2) // 2
    streams = {e.stream for e in recording.step_events(0) if e.action == "alloc"}
    assert streams - {0}  # FSDP2's all-gather / reduce-scatter streams
    assert any("world size 4" in w for w in recording.warnings)


def test_description_names_the_layout(tiny):
    """The step says TP degree, torchtitan's plan, the FSDP units and the rank."""
    built = _build(((2, 2), ("fsdp", "tp")), _options(precision="bf16-mixed"))
    assert built.description == (
        "Tiny Llama, batch 2, seq 16, bf16-mixed, adamw, train, tensor parallel over 2 ranks "
        "(torchtitan's Llama plan: sequence parallel, loss parallel), FSDP2 over 2 ranks "
        "(3 units: per block + root), rank 0 of 4"
    )


@pytest.mark.parametrize(
    ("mesh_shape", "options", "message"),
    [
        (((4,), ("tp",)), {}, "--tp 4 must divide Tiny Llama's KV heads 2"),
        (((2,), ("tp",)), {"seq_len": 15}, "sequence length 15"),
        (((2,), ("tp",)), {"mode": "generate"}, "train and inference"),
        (((2,), ("tp",)), {"precision": "fp16-mixed"}, "ShardedGradScaler"),
        (((2, 2), ("dp", "tp")), {}, "--tp with --dp"),
    ],
)
def test_refused(tiny, mesh_shape, options, message):
    """What TP is not modelled for is a ConfigError that names the size or flag."""
    with pytest.raises(ConfigError, match=message):
        _build(mesh_shape, _options(**options))


def test_non_llama_preset_is_refused():
    """GPT-2's fused c_attn has no plan here: --tp names the Llama presets."""
    with pytest.raises(ConfigError, match="modelled for the Llama presets"):
        _build(((2,), ("tp",)), _options(), name="gpt2-124m")


def test_llama3_presets_have_torchtitans_shapes():
    """llama3-8b/70b/405b: torchtitan llama3_configs' dims; FFN from compute_ffn_hidden_dim."""

    def ffn(dim: int, multiple_of: int, multiplier: float) -> int:
        # torchtitan/models/common compute_ffn_hidden_dim: int(2 * 4d / 3), * multiplier,
        # rounded up to a multiple.
        hidden = int(multiplier * int(2 * 4 * dim / 3))
        return multiple_of * -(-hidden // multiple_of)

    expected = {
        "llama3-8b": (4096, 32, 32, ffn(4096, 1024, 1.3)),
        "llama3-70b": (8192, 80, 64, ffn(8192, 4096, 1.3)),
        "llama3-405b": (16384, 126, 128, ffn(16384, 4096, 1.2)),
    }
    for name, (dim, layers, heads, width) in expected.items():
        shape = PRESETS[name].shape
        assert (shape.hidden, shape.layers, shape.heads, shape.intermediate) == (
            dim, layers, heads, width,
        )
        assert (shape.kv_heads, shape.vocab, shape.tied) == (8, 128256, False)
    assert PRESETS["llama3-8b"].shape == PRESETS["llama-8b"].shape
    assert [PRESETS[n].shape.intermediate for n in expected] == [14336, 28672, 53248]


def test_attention_views_take_the_local_heads(tiny):
    """SDPA on rank 0 runs 2 of the 4 heads: its output is [2, 2, 16, 16] fp32, never 4 heads."""
    recording = _record(((2,), ("tp",)), _options(mode="inference"))
    sizes = [
        e.size
        for e in recording.step_events(0)
        if e.action == "alloc" and "scaled_dot_product" in dict(e.tags).get("op", "")
    ]
    head_dim = _SHAPE.hidden // _SHAPE.heads
    local_heads = _SHAPE.heads // 2
    assert _BATCH * local_heads * _SEQ * head_dim * 4 in sizes
    assert _BATCH * _SHAPE.heads * _SEQ * head_dim * 4 not in sizes


def test_sharding_propagation_allocates_nothing(tp2_recording):
    """DTensor's shape propagation on global fake tensors is not device memory: the optimizer
    step allocates AdamW's two states and one sqrt temporary per local shard, and only DTensor's
    own redistributions besides (norm-gradient all-reduces, a replicate-to-shard copy)."""
    by_op: dict[str, int] = {}
    for event in tp2_recording.step_events(0):
        tags = dict(event.tags)
        if event.action == "alloc" and tags.get("phase") == "optimizer":
            by_op[tags["op"]] = by_op.get(tags["op"], 0) + event.size
    local_bytes = 4 * _local_parameter_numel(_SHAPE, 2)
    assert by_op.pop("aten.zeros_like.default") == 2 * local_bytes
    assert by_op.pop("aten._foreach_sqrt.default") == local_bytes
    assert "aten.empty_strided.default" not in by_op
    assert set(by_op) <= {"_c10d_functional.all_reduce.default", "aten.clone.default"}


@pytest.mark.parametrize(
    ("vocab", "note"),
    [
        # 260 / tp 2 = 130 local rows: FSDP over 2 divides them (world size 4 would not).
        (260, None),
        # 258 / tp 2 = 129 local rows: 65 and 64 over FSDP 2, though 258 global rows divide.
        (258, "ranks differ: 2 sharded parameter(s) have rows that 2 ranks do not divide"),
    ],
)
def test_fsdp_x_tp_uneven_shards_count_tp_local_rows_over_the_fsdp_degree(monkeypatch, vocab, note):
    """FSDP2 shards a TP DTensor's local rows over the FSDP degree (_fsdp_param.py
    _init_sharding_spec_tp): the embedding and LM head hold vocab / tp rows each."""
    shape = dataclasses.replace(_SHAPE, vocab=vocab)
    monkeypatch.setattr(tensor_parallel, "shaped_preset", lambda name, options: _tiny(shape))
    recording = _record(((2, 2), ("fsdp", "tp")), _options(precision="bf16-mixed"))
    found = [w for w in recording.warnings if w.startswith("ranks differ")]
    if note is None:
        assert found == []
    else:
        # One row of 64 fp32 values short on the last FSDP rank, per parameter.
        assert found[0].startswith(note)
        assert "up to 512 bytes less" in found[0]


def test_tp_checkpointing_follows_the_mode(tiny):
    """--tp with --checkpointing none recomputes nothing, full recomputes each block's matmuls
    and attention, selective-op (torchtitan's op policy) every other matmul and no attention;
    applied after the TP plan, as torchtitan's parallelize_llama does (before: a bare truth
    test on the mode made "none" checkpoint fully)."""
    counts = {}
    for mode in ("none", "full", "selective-op"):
        recording = _record(
            ((2,), ("tp",)), _options(precision="bf16-mixed", checkpointing=mode), steps=2
        )
        ops = [dict(e.tags).get("op") or "" for e in recording.step_events(1) if e.action == "alloc"]
        counts[mode] = (sum("mm" in op for op in ops), sum("scaled_dot" in op for op in ops))
    # 2 blocks: full re-runs the whole block, as torchtitan's FullAC wrapper does
    # (early_stop=False): its 7 matmul outputs (q, k, v, o, gate, up, down) and 5 attention
    # allocations per block (cuDNN's seed, offset, output, statistics and 256-byte workspace).
    # (torch's default early_stop=True stops once down's input, the SwiGLU product, is made
    # again: 6 matmuls a block, 58.)
    assert counts == {"none": (46, 18), "full": (46 + 2 * 7, 18 + 2 * 5), "selective-op": (52, 18)}
