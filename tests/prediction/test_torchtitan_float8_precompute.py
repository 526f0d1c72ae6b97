"""torchao's ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step, recorded.

``precompute_float8_dynamic_scale_for_fsdp`` on ``float8_block_linears`` (with float8
all-gather, as torchtitan 0.2.2 ran it) gives torchtitan's optimizers container the post-step
hook of torchtitan 0.2.2's trainer: torchao's function takes the N float8 weights' local amax
in one ``_foreach_norm``, stacks, all-reduces once and keeps one float32 tensor of N scales;
the next all-gathers cast each shard with its scale instead of computing it (``abs`` of the
fp32 shard, ``max``, an all-reduce and the scale's arithmetic per weight). The job: llama3's
debug model cut to 2 blocks (``_torchtitan_two_blocks``), FSDP 2, tensorwise, the blocks'
linears in Float8 and gathered in float8, recorded for 2 steps with the precompute off and on.
"""

from __future__ import annotations

import collections

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
    float8_block_linears_override,
)

from oomkit.errors import ConfigError  # noqa: E402
from oomkit.prediction._torchtitan_env import (  # noqa: E402
    SUPPORTED_TORCHTITAN,
    cuda_capability,
    import_torchtitan,
    torchtitan_version,
)
from oomkit.prediction.torchtitan_job import TorchtitanJob  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

_FSDP = 2
# CUDACachingAllocator.cpp kMinBlockSize: a request under 512 bytes takes a 512-byte block
_MIN_BLOCK_BYTES = 512
# float32 (the weights' shards, the scales and amaxes) and float64 (torchao's scale arithmetic:
# fsdp_utils.py precompute_float8_dynamic_scale_for_fsdp, float8_utils.py amax_to_scale)
_FP32_BYTES, _FP64_BYTES = 4, 8


def _override(precompute: bool) -> tuple[str, ...]:
    return float8_block_linears_override(all_gather=True, precompute=precompute)


@pytest.fixture(scope="module")
def recorded():
    """precompute off / on -> (recording, prediction) of two train steps on an H100 (off is
    test_torchtitan_float8_allgather.py's all-gather job, recorded once for both)."""
    out = {}
    for precompute in (False, True):
        job = TorchtitanJob(*TWO_BLOCKS, SMALL_STEP + _override(precompute), world_size=_FSDP)
        recording, _, prediction = recorded_job(job)
        out[precompute] = (recording, prediction)
    return out


def _step_allocs(recording, step: int) -> collections.Counter:
    """(phase, op, requested bytes) of each allocation of step ``step`` (1-based)."""
    starts = (*recording.step_starts, len(recording.events))
    return collections.Counter(
        (event.tag("phase"), event.tag("op"), event.size)
        for event in recording.events[starts[step - 1]:starts[step]]
        if event.action == "alloc"
    )


def test_each_optimizer_step_ends_with_torchaos_one_precompute_of_all_scales(recorded):
    """What the precompute adds to each step, in the optimizer step (torchtitan's container
    post-hook): one float32 amax per float8 weight (``_foreach_norm``), their stack, its
    all-reduce and clamp, the float64 upcast, ``finfo.max / amax`` (reciprocal, mul) and the
    float32 scales, N of each; before the amaxes, the foreach kernel's float partials, N times
    the chunks of 65,536 elements in the largest local shard (the FFN's 768 x 256 over 2 ranks:
    98,304 elements, 2 chunks); and it takes nothing away from the step it ends."""
    linears = debug_block_parameters()[0]
    weights = 2 * len(linears)  # the two blocks' float8 linears; the head is bf16
    chunks = -(-max(linears.values()) // _FSDP // 65536)
    assert chunks == 2
    expected = collections.Counter({
        ("optimizer", "aten._foreach_norm.Scalar", weights * chunks * _FP32_BYTES): 1,
        ("optimizer", "aten._foreach_norm.Scalar", _FP32_BYTES): weights,
        ("optimizer", "aten.stack.default", weights * _FP32_BYTES): 1,
        ("optimizer", "_c10d_functional.all_reduce.default", weights * _FP32_BYTES): 1,
        ("optimizer", "aten.clamp.default", weights * _FP32_BYTES): 1,
        ("optimizer", "aten._to_copy.default", weights * _FP64_BYTES): 1,
        ("optimizer", "aten.reciprocal.default", weights * _FP64_BYTES): 1,
        ("optimizer", "aten.mul.Tensor", weights * _FP64_BYTES): 1,
        ("optimizer", "aten._to_copy.default", weights * _FP32_BYTES): 1,
    })
    (off, _), (on, _) = recorded[False], recorded[True]
    assert _step_allocs(on, 1) - _step_allocs(off, 1) == expected
    assert not _step_allocs(off, 1) - _step_allocs(on, 1)  # step 1 all-gathers cast as before
    on_step2 = _step_allocs(on, 2) - _step_allocs(off, 2)
    assert on_step2 == expected


def test_each_steps_scales_outlive_the_next_precompute(recorded):
    """The N float32 scales of step 1's post-step (each weight's ``_precomputed_scale`` a view
    of them) are not freed when step 2's precompute replaces them: the step's all-gathers put
    views of them in FSDP2's unsharded float8 weights (torchao fsdp_utils.py
    ``fsdp_post_all_gather``: ``out._scale = scale``) and in each parameter's all-gather
    metadata, which only the next all-gather replaces. Both steps' scales are live at the end."""
    recording, _ = recorded[True]
    weights = 2 * len(debug_block_parameters()[0])
    scales = [
        (index, event.address)
        for index, event in enumerate(recording.events)
        if event.action == "alloc" and event.tag("phase") == "optimizer"
        and event.tag("op") == "aten._to_copy.default" and event.size == weights * _FP32_BYTES
    ]
    assert len(scales) == 2
    (first_at, first), (second_at, second) = scales
    assert recording.step_starts[0] < first_at < recording.step_starts[1] < second_at
    assert first != second
    assert not [
        event for event in recording.events
        if event.action == "free_completed" and event.address in (first, second)
    ]


def test_the_all_gathers_cast_with_the_precomputed_scales(recorded):
    """Step 2 (after a precompute): each all-gather of a float8 weight, in the forward and in
    the backward, no longer computes its scale: ``abs`` of its fp32 shard, ``max``, the amax's
    all-reduce, the float64 upcast, clamp, reciprocal, mul and the float32 scale."""
    linears = debug_block_parameters()[0]
    weights = 2 * len(linears)
    expected: collections.Counter = collections.Counter()
    for phase in ("forward", "backward"):
        for elements in linears.values():
            expected[(phase, "aten.abs.default", elements // _FSDP * _FP32_BYTES)] += 2
        for op, size in (
            ("aten.max.default", _FP32_BYTES),
            ("_c10d_functional.all_reduce.default", _FP32_BYTES),
            ("aten._to_copy.default", _FP64_BYTES),
            ("aten.clamp.default", _FP64_BYTES),
            ("aten.reciprocal.default", _FP64_BYTES),
            ("aten.mul.Tensor", _FP64_BYTES),
            ("aten._to_copy.default", _FP32_BYTES),
        ):
            expected[(phase, op, size)] += weights
    (off, _), (on, _) = recorded[False], recorded[True]
    assert _step_allocs(off, 2) - _step_allocs(on, 2) == expected


def test_the_peak_drops_by_the_per_weight_scales_less_the_one_scales_block(recorded):
    """At the peak (step 2, the last block's backward) each of the 2 x 5 gathered float8
    weights holds its own float32 scale, a 512-byte block each, without the precompute; with
    it they are views of the one 40-byte scales tensor (a 512-byte block): 9 blocks less."""
    weights = 2 * len(debug_block_parameters()[0])
    (_, off), (_, on) = recorded[False], recorded[True]
    assert off.peak_allocated_at.step == on.peak_allocated_at.step == 2
    held_off = weights * _MIN_BLOCK_BYTES
    held_on = _MIN_BLOCK_BYTES  # weights * 4 bytes = 40, under kMinBlockSize
    assert off.peak_allocated_bytes - on.peak_allocated_bytes == held_off - held_on
    by_off, by_on = off.peak_allocated_at.by_category_bytes, on.peak_allocated_at.by_category_bytes
    assert by_off["temporary"] - by_on["temporary"] == held_off - held_on
    assert {k: v for k, v in by_off.items() if k != "temporary"} == {
        k: v for k, v in by_on.items() if k != "temporary"
    }


def test_the_recorder_finds_the_weight_without_reading_a_fake_scale():
    """torchao's ``__tensor_flatten__`` reads the precomputed scale's value (``if
    self._precomputed_scale``), which a fake scale has not; the recorder's storage of the
    wrapper is its weight's, found without it, with or without a scale set."""
    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from oomkit.prediction.tracing.fake_storages import fake_tensor_storage

    fsdp_utils = import_torchtitan("torchao.float8.fsdp_utils")
    with FakeTensorMode():
        weight = torch.empty(32, 16)
        wrapped = fsdp_utils.WeightWithDynamicFloat8CastTensor(weight, None, torch.float8_e4m3fn)
        assert fake_tensor_storage(wrapped, "meta") is weight.untyped_storage()
        wrapped._precomputed_scale = torch.empty(3)[1]
        with pytest.raises(DataDependentOutputException):
            wrapped.__tensor_flatten__()
        storage = fake_tensor_storage(wrapped, "meta")
        assert storage is weight.untyped_storage()
        assert storage.nbytes() == 32 * 16 * _FP32_BYTES


@settings(max_examples=25, deadline=None)
@given(
    in_features=st.sampled_from([16, 48, 256, 24]),
    all_gather=st.booleans(),
    precompute=st.booleans(),
    every_linear=st.booleans(),
)
def test_precompute_is_refused_without_float8_all_gather_and_kept_with_it(
    in_features, all_gather, precompute, every_linear
):
    """Without float8 all-gather the precompute is a ConfigError (torchtitan ran it only with
    it); with it, the converted linear's config and module carry it."""
    import torch

    from oomkit.prediction._torchtitan_float8 import float8_block_linears, float8_linears

    factory = float8_linears if every_linear else float8_block_linears
    linear = import_torchtitan("torchtitan.models.common.linear").Linear
    config = linear.Config(in_features=in_features, out_features=32)
    with cuda_capability((9, 0)):
        if precompute and not all_gather:
            with pytest.raises(ConfigError, match="enable_fsdp_float8_all_gather"):
                factory(config, recipe_name="tensorwise", enable_fsdp_float8_all_gather=False,
                        precompute_float8_dynamic_scale_for_fsdp=True)
            return
        swapped = factory(config, recipe_name="tensorwise", enable_fsdp_float8_all_gather=all_gather,
                          precompute_float8_dynamic_scale_for_fsdp=precompute)
    if in_features % 16:
        assert swapped is config
        return
    with torch.device("meta"):
        module = swapped.build()
    assert getattr(module, "precompute_float8_dynamic_scale_for_fsdp", False) is precompute


def test_the_cli_refuses_precompute_without_all_gather_in_one_line(capsys):
    """The refusal comes from inside the job (torchtitan's apply_overrides runs the factory):
    exit 2, one error line naming the field to add, no traceback."""
    from oomkit.interfaces.cli import main

    override = (
        f'{FLOAT8_FACTORIES}.float8_block_linears={{"recipe_name": "tensorwise", '
        '"precompute_float8_dynamic_scale_for_fsdp": true}'
    )
    code = main(["predict", "--torchtitan", "llama3:debugmodel", "--world-size", "2", "--gpu",
                 "h100", "--", *SMALL_STEP, "--override.imports", override])
    err = capsys.readouterr().err
    assert code == 2
    assert "enable_fsdp_float8_all_gather" in err and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("oomkit: error:")]
    assert len(errors) == 1 and err.strip().endswith(errors[0])  # progress lines before it
