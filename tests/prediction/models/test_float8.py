"""Float8 linear training (torchao) under FSDP2 on a fake process group, in exact bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from oomkit.errors import ConfigError
from oomkit.prediction.models.float8 import FLOAT8_RECIPES, Float8Options, convert_to_float8

pytest.importorskip("torchao.float8")

# Two bias-free layers, 64 -> 128 -> 64: each weight has 8192 elements, 4096 per rank of 2.
WEIGHT_NUMEL = 64 * 128
TOKENS = 32


def _builder(float8: Float8Options | None):
    def build(mesh):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 64, bias=False)
        )
        if float8 is not None:
            assert convert_to_float8(model, float8) == ["0", "1"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters())
        batch = torch.randn(TOKENS, 64)

        def step():
            model(batch).float().sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, (model, optimizer, batch)

    return build


def _record(float8: Float8Options | None):
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    return trace_distributed_step(_builder(float8), world_size=2, steps=2)


def _forward(recording):
    """Step 1's events up to the loss."""
    events = []
    for event in recording.step_events(1):
        if dict(event.tags).get("op") == "aten.sum.default":
            break
        events.append(event)
    return events


def _gathers(events):
    return [
        (e.size, e.stream)
        for e in events
        if e.action == "alloc" and dict(e.tags)["category"] == "allgather_buffer"
    ]


@pytest.fixture(scope="module")
def recordings():
    return {
        "bf16": _record(None),
        "tensorwise": _record(Float8Options("tensorwise", skip=())),
        "all_gather": _record(Float8Options("tensorwise", all_gather=True, skip=())),
    }


def test_float8_all_gather_gathers_one_byte_per_element(recordings):
    """FSDP2 gathers each 8192-element weight as bf16 (2 bytes each: the all-gather output on
    its stream 1, then the unsharded parameter) without float8 all-gather, as fp8 (1 byte)
    with it (torchao fsdp_utils.py WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather)."""
    bf16 = [(WEIGHT_NUMEL * 2, 1), (WEIGHT_NUMEL * 2, 0)]
    fp8 = [(WEIGHT_NUMEL, 1), (WEIGHT_NUMEL, 0)]
    assert _gathers(_forward(recordings["bf16"])) == bf16 * 2
    assert _gathers(_forward(recordings["tensorwise"])) == bf16 * 2  # cast after the gather
    assert _gathers(_forward(recordings["all_gather"])) == fp8 * 2


def test_float8_all_gather_casts_the_shard_on_the_all_gather_stream(recordings):
    """With float8 all-gather, each layer's fp32 shard (4096 x 4 bytes) is cast on stream 1:
    its amax all-reduced over the group (one fp32), its fp8 shard 4096 bytes, its scale (4
    bytes) kept with the gathered weight."""
    events = _forward(recordings["all_gather"])
    on_side = [
        (e.size, dict(e.tags).get("op"))
        for e in events
        if e.action == "alloc" and e.stream == 1 and dict(e.tags)["category"] != "allgather_buffer"
    ]
    assert on_side[:2] == [(WEIGHT_NUMEL // 2 * 4, "aten.abs.default"), (4, "aten.max.default")]
    assert (4, "_c10d_functional.all_reduce.default") in on_side
    assert (WEIGHT_NUMEL // 2, "aten._to_copy.default") in on_side  # the fp8 shard


def test_the_forward_casts_input_and_weight_to_fp8_for_scaled_mm(recordings):
    """Without float8 all-gather the forward casts the gathered bf16 weight (through an fp32
    copy: 8192 x 4 bytes) and the input (32 x 64 bf16 -> 2048 fp8 bytes), then _scaled_mm
    makes a 32 x 128 bf16 output (8192 bytes; meta_scaled_mm's (M, N) of out_dtype). With it,
    only the input is cast: the weight arrives in fp8."""
    def sizes(events, op):
        return [e.size for e in events if e.action == "alloc" and dict(e.tags).get("op") == op]

    plain = _forward(recordings["tensorwise"])
    gathered = _forward(recordings["all_gather"])
    assert sizes(plain, "aten._scaled_mm.default") == [TOKENS * 128 * 2, TOKENS * 64 * 2]
    assert sizes(gathered, "aten._scaled_mm.default") == [TOKENS * 128 * 2, TOKENS * 64 * 2]
    fp32_weight = WEIGHT_NUMEL * 4
    assert fp32_weight in sizes([e for e in plain if e.stream == 0], "aten._to_copy.default")
    assert fp32_weight not in sizes([e for e in gathered if e.stream == 0], "aten._to_copy.default")
    assert TOKENS * 64 in sizes(plain, "aten._to_copy.default")  # the first input, in fp8


def test_the_first_scaled_mm_takes_the_cublaslt_workspace(recordings):
    """_scaled_mm runs through cuBLASLt (CUDABlas.cpp scaled_gemm), so step 0's first float8
    GEMM allocates the stream's workspace (32 MiB on an H100), as a bf16 mm does."""
    events = recordings["tensorwise"].step_events(0)
    ops = [dict(e.tags).get("op") for e in events if dict(e.tags)["category"] == "workspace"]
    assert ops[0] == "aten._scaled_mm.default"


def test_convert_follows_torchtitan_s_filter():
    """Linears whose dims are both multiples of 16 are swapped, except the skipped names."""
    from torchao.float8.float8_linear import Float8Linear

    model = torch.nn.ModuleDict({
        "up": torch.nn.Linear(64, 128),
        "odd": torch.nn.Linear(64, 24),
        "lm_head": torch.nn.Linear(128, 256),
    })
    with torch.device("meta"):
        assert convert_to_float8(model, Float8Options()) == ["up"]
    assert isinstance(model["up"], Float8Linear)
    assert not isinstance(model["odd"], Float8Linear)
    assert not isinstance(model["lm_head"], Float8Linear)


def test_no_eligible_layer_is_refused():
    """A model with no 16-aligned Linear: ConfigError saying to drop --float8."""
    with pytest.raises(ConfigError, match="drop --float8"):
        convert_to_float8(torch.nn.Linear(10, 10), Float8Options())


@given(recipe=st.sampled_from(FLOAT8_RECIPES), all_gather=st.booleans())
def test_float8_all_gather_only_with_tensorwise(recipe, all_gather):
    """torchao's float8 all-gather needs tensorwise scaling: any other pairing is refused."""
    if all_gather and recipe != "tensorwise":
        with pytest.raises(ConfigError, match="--float8-recipe tensorwise"):
            Float8Options(recipe, all_gather)
    else:
        assert Float8Options(recipe, all_gather).torchao_config() is not None


@given(recipe=st.text(min_size=1, max_size=12).filter(lambda r: r not in FLOAT8_RECIPES))
def test_unknown_recipes_are_refused(recipe):
    """Any other recipe name is refused, naming the known ones."""
    with pytest.raises(ConfigError, match="rowwise_with_gw_hp"):
        Float8Options(recipe)  # type: ignore[arg-type]
