"""Float8 all-gather with FSDP2 through ``--override.imports``: torchao's weight wrapper, recorded.

``enable_fsdp_float8_all_gather`` on ``float8_linears`` / ``float8_block_linears`` builds each
converted linear as ``Float8AllGatherLinear``, whose weight is torchao's
``WeightWithDynamicFloat8CastTensor`` (as ``Float8Linear.from_float`` wraps it): FSDP2's
``fsdp_pre_all_gather`` casts the fp32 shard to float8 and gathers 1 byte per element where
it gathered bf16. The job: torchtitan's llama3 debugmodel cut to 2 blocks (a registry module
of one's own, as tests/prediction/test_torchtitan_job.py), FSDP 2, 2024's Float8 (tensorwise,
the blocks' linears, the LM head in bf16), recorded with the all-gather off and on, and
FSDP 2 x TP 2 with it on.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchtitan")

from _torchtitan_recordings import recorded_job  # noqa: E402
from _torchtitan_small_job import (  # noqa: E402
    FLOAT8_FACTORIES,
    SMALL_STEP,
    TWO_BLOCKS,
    debug_block_parameters,
    debug_model_on_meta,
    float8_block_linears_override,
)

from oomkit.core.target import Target  # noqa: E402
from oomkit.errors import ConfigError  # noqa: E402
from oomkit.prediction._torchtitan_env import (  # noqa: E402
    SUPPORTED_TORCHTITAN,
    cuda_capability,
    import_torchtitan,
    torchtitan_version,
)
from oomkit.prediction.torchtitan_job import TorchtitanJob, record_torchtitan_job  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

_FSDP = 2
# CUDACachingAllocator.cpp kMinBlockSize: a 4-byte float32 scale takes a 512-byte block
_MIN_BLOCK_BYTES = 512
# bf16 (FSDP2's param_dtype under torchtitan's mixed precision) and float8 e4m3
_BF16_BYTES, _FLOAT8_BYTES = 2, 1


def _overrides(all_gather: bool) -> tuple[str, ...]:
    """2024's Float8 with the all-gather on or off, no precompute (its default, said as
    test_torchtitan_float8_precompute.py says it: the all-gather job is recorded once for both)."""
    return float8_block_linears_override(all_gather=all_gather, precompute=False)


@pytest.fixture(scope="module")
def recorded():
    """all-gather on / off -> (recording, prediction) of two train steps on an H100."""
    out = {}
    for all_gather in (False, True):
        job = TorchtitanJob(*TWO_BLOCKS, SMALL_STEP + _overrides(all_gather), world_size=_FSDP)
        recording, _, prediction = recorded_job(job)
        out[all_gather] = (recording, prediction)
    return out


def _gathered_sizes(recording) -> set[int]:
    return {
        event.size for event in recording.events
        if event.action == "alloc" and event.tag("category") == "allgather_buffer"
    }


def test_each_blocks_linears_are_gathered_in_one_byte_per_element(recorded):
    """A block's all-gather output is world x its shard: bf16 for every parameter without it;
    with it, 1 byte per linear weight element and bf16 for the two norms (FSDP2 gathers mixed
    dtypes as bytes); each unsharded linear weight is its element count in bytes."""
    linears, others = debug_block_parameters()
    linear_elements, other_elements = sum(linears.values()), sum(others.values())
    off, on = _gathered_sizes(recorded[False][0]), _gathered_sizes(recorded[True][0])
    shard_off = (linear_elements * _BF16_BYTES + other_elements * _BF16_BYTES) // _FSDP
    shard_on = (linear_elements * _FLOAT8_BYTES + other_elements * _BF16_BYTES) // _FSDP
    assert _FSDP * shard_off in off and _FSDP * shard_off not in on
    assert _FSDP * shard_on in on and _FSDP * shard_on not in off
    assert {n * _BF16_BYTES for n in linears.values()} <= off
    assert {n * _FLOAT8_BYTES for n in linears.values()} <= on
    assert not {n * _FLOAT8_BYTES for n in linears.values()} & off
    # the root's embedding, final norm and LM head stay bf16 (2024's filter keeps the head)
    root = _block_root_sizes()
    assert root <= off and root <= on


def _block_root_sizes() -> set[int]:
    """The bf16 all-gathers outside the blocks: the embedding; the final norm with the head."""
    model = debug_model_on_meta()
    embedding = model.tok_embeddings.weight.numel()
    head_and_norm = model.lm_head.weight.numel() + model.norm.weight.numel()
    return {embedding * _BF16_BYTES, head_and_norm * _BF16_BYTES}


def test_the_peak_drops_by_one_blocks_linears_and_a_float8_weight_copy(recorded):
    """At the peak (step 2, the last block's backward, in w2) the unsharded weights of that
    block are held: 1 byte per linear element less with the all-gather. Without it, the step
    also holds the float8 copy its matmul casts from w2's gathered bf16 weight; with it the
    gathered bytes are that copy. With it, each float8 weight of the two blocks gathered in
    this backward keeps its float32 scale (10), less the scale of that w2 cast: 9 blocks."""
    linears, _ = debug_block_parameters()
    (_, off), (_, on) = recorded[False], recorded[True]
    assert off.peak_allocated_at.step == on.peak_allocated_at.step == 2
    gathered_off = off.peak_allocated_at.by_category_bytes["allgather_buffer"]
    gathered_on = on.peak_allocated_at.by_category_bytes["allgather_buffer"]
    block_linears = sum(linears.values())
    assert gathered_off - gathered_on == block_linears * (_BF16_BYTES - _FLOAT8_BYTES)
    w2_copy = linears["feed_forward.w2.weight"] * _FLOAT8_BYTES
    scales = 2 * len(linears) - 1
    temporary_off = off.peak_allocated_at.by_category_bytes["temporary"]
    temporary_on = on.peak_allocated_at.by_category_bytes["temporary"]
    assert temporary_off - temporary_on == w2_copy - scales * _MIN_BLOCK_BYTES
    assert off.peak_allocated_bytes - on.peak_allocated_bytes == (
        block_linears + w2_copy - scales * _MIN_BLOCK_BYTES
    )
    # nothing else moves: parameters, gradients, optimizer state, activations
    for category in ("parameter", "gradient", "optimizer_state", "activation"):
        assert (
            off.peak_allocated_at.by_category_bytes[category]
            == on.peak_allocated_at.by_category_bytes[category]
        )


def test_with_tp_each_rank_gathers_its_tp_shard_of_the_block_in_float8():
    """FSDP 2 x TP 2 (torchao's order: the wrapped weight is TP's local tensor, FSDP2 shards
    it): a block's all-gather is half of each linear's elements at 1 byte, and the two norms
    (replicated over TP) in bf16; each unsharded linear weight is its TP shard in bytes. One
    train step: its forward and backward gather every block's weights, and what a gather casts
    to is fixed when the weight is wrapped (at build), so a second step gathers the same."""
    tp = 2
    job = TorchtitanJob(
        *TWO_BLOCKS,
        _overrides(True) + SMALL_STEP + ("--parallelism.tensor_parallel_degree", str(tp)),
        world_size=_FSDP * tp,
    )
    recording, _ = record_torchtitan_job(job, target=Target.resolve("h100"), steps=1)
    linears, others = debug_block_parameters()
    gathered = _gathered_sizes(recording)
    block = sum(linears.values()) // tp * _FLOAT8_BYTES + sum(others.values()) * _BF16_BYTES
    assert block in gathered
    assert {n // tp * _FLOAT8_BYTES for n in linears.values()} <= gathered
    assert not {n // tp * _BF16_BYTES for n in linears.values()} & gathered


def test_a_rowwise_recipe_with_float8_all_gather_is_refused_in_torchaos_terms():
    """torchao allows float8 all-gather for tensorwise scaling only (config.py)."""
    from oomkit.prediction._torchtitan_float8 import float8_linears

    linear = import_torchtitan("torchtitan.models.common.linear").Linear
    config = linear.Config(in_features=256, out_features=256)
    with cuda_capability((9, 0)), pytest.raises(ConfigError, match="tensorwise"):
        float8_linears(config, recipe_name="rowwise", enable_fsdp_float8_all_gather=True)


def test_the_job_with_rowwise_float8_all_gather_is_a_config_error_not_a_crash():
    """The refusal reaches the caller as ConfigError (the CLI's exit 2), from inside the
    recording where torchtitan's apply_overrides runs the factory."""
    job = TorchtitanJob(
        "llama3", "debugmodel",
        ("--override.imports", f'{FLOAT8_FACTORIES}.float8_linears={{"enable_fsdp_float8_all_gather": true}}')
        + SMALL_STEP,
        world_size=_FSDP,
    )
    with pytest.raises(ConfigError, match="'rowwise' recipe scales the weight axiswise"):
        record_torchtitan_job(job, target=Target.resolve("h100"))


@settings(max_examples=25, deadline=None)
@given(
    in_features=st.integers(1, 512),
    out_features=st.integers(1, 512),
    all_gather=st.booleans(),
)
def test_the_weight_is_wrapped_exactly_when_float8_all_gather_is_asked(
    in_features, out_features, all_gather
):
    """A linear the converter swaps (dims multiples of 16) is built with torchao's weight
    wrapper iff all-gather is asked; its torchao config says so; another linear is kept."""
    import torch

    from oomkit.prediction._torchtitan_float8 import float8_block_linears

    linear = import_torchtitan("torchtitan.models.common.linear").Linear
    fsdp_utils = import_torchtitan("torchao.float8.fsdp_utils")
    config = linear.Config(in_features=in_features, out_features=out_features)
    with cuda_capability((9, 0)):
        swapped = float8_block_linears(
            config, recipe_name="tensorwise", enable_fsdp_float8_all_gather=all_gather
        )
    if in_features % 16 or out_features % 16:
        assert swapped is config
        return
    assert swapped._torchao_config.enable_fsdp_float8_all_gather is all_gather
    with torch.device("meta"):
        module = swapped.build()
    wrapped = isinstance(module.weight, fsdp_utils.WeightWithDynamicFloat8CastTensor)
    assert wrapped is all_gather
    assert tuple(module.weight.shape) == (out_features, in_features)
    assert module.weight.requires_grad
    if wrapped:
        assert module.weight._dtype == torch.float8_e4m3fn
