"""A fit search builds its model once and shares it: every probe predicts what a fresh build does."""

from __future__ import annotations

import dataclasses

import pytest

from oomkit.core.target import Target
from oomkit.plan.batch_probe import less_margin, predict_built
from oomkit.plan.batch_search import max_batch_size

torch = pytest.importorskip("torch")

from oomkit.prediction.models import StepOptions, build_preset_step  # noqa: E402
from oomkit.prediction.models import presets as presets_module  # noqa: E402
from oomkit.prediction.models.gpt2 import GPT2Shape  # noqa: E402
from oomkit.prediction.models.lora_options import LoraOptions  # noqa: E402

GiB = 2**30


@pytest.fixture
def gpt2_builds(monkeypatch):
    """Counts GPT-2 models constructed (the preset family's build), whoever builds them."""
    count = [0]
    family = presets_module._FAMILIES[GPT2Shape]

    def counting(shape):
        count[0] += 1
        return family.build(shape)

    monkeypatch.setitem(
        presets_module._FAMILIES, GPT2Shape, dataclasses.replace(family, build=counting)
    )
    return count


@pytest.fixture
def two_block_gpt2(monkeypatch):
    """Preset gpt2-124m built two blocks deep (its shape otherwise), undone after the test: for
    the tests that count builds and compare peaks with fresh builds', whatever the depth.
    Returns the shape."""
    import types

    preset = presets_module.PRESETS["gpt2-124m"]
    shallow = dataclasses.replace(preset, shape=dataclasses.replace(preset.shape, layers=2))
    monkeypatch.setattr(
        presets_module, "PRESETS", types.MappingProxyType({**presets_module.PRESETS, "gpt2-124m": shallow})
    )
    return shallow.shape


def _search_then_compare(options: StepOptions, gpu: str, builds: list[int], start: int, most: int):
    """Run the search (cached) from ``start`` up to ``most``, then predict afresh the batch it
    answers and its last two probes (those that reused the model most); return the result."""

    def build(batch):
        return build_preset_step("gpt2-124m", dataclasses.replace(options, batch_size=batch))

    result = max_batch_size(
        build, target=Target.resolve(gpu), steps=2, margin_bytes=0, start_batch=start, max_batch=most
    )
    assert builds[0] == 1  # one model for every probe of the search
    searched = less_margin(result.target, result.margin_bytes)
    assert searched is not None
    chosen = {result.batch_size, *result.probe_order[-2:]}
    compared = [p for p in result.curve if p.batch_size in chosen]
    assert len(compared) == len(chosen)
    for probe in compared:
        fresh = predict_built(build, "train step", probe.batch_size, target=searched, steps=2)
        assert (probe.train.peak_allocated_bytes, probe.train.peak_reserved_bytes) == (
            fresh.peak_allocated_bytes,
            fresh.peak_reserved_bytes,
        ), probe.batch_size
        assert probe.train.required_bytes == fresh.required_bytes
        assert probe.fits == fresh.fits
    assert builds[0] == 1 + len(compared)  # the fresh predictions built one model each
    return result


def test_gpt2_search_builds_once_and_every_probe_equals_a_fresh_build(gpt2_builds):
    """GPT-2 124M at seq 64 on a 4 GiB GPU (batch 32 fits, 33 does not; searched from 30 to 34
    to keep the test short): one model for the search; each probe's peaks equal an uncached
    prediction at that batch, byte for byte (the answer and the last two probes are compared)."""
    options = StepOptions(batch_size=1, seq_len=64, precision="bf16-mixed")
    result = _search_then_compare(options, "4GiB", gpt2_builds, 30, 34)
    # 32 and 31 fit only with an allocator retry: 30, the largest without, is the answer.
    assert result.probe_order == (30, 34, 32, 33, 31) and result.batch_size == 30
    assert result.with_retries_batch_size == 32


def test_lora_search_builds_once_and_every_probe_equals_a_fresh_build(gpt2_builds):
    """The same with LoRA adapters (r 8 on c_attn, frozen base) on 2 GiB (batch 14 fits, 15 does
    not): one build, identical peaks."""
    options = StepOptions(batch_size=1, seq_len=64, precision="bf16-mixed", lora=LoraOptions(r=8))
    result = _search_then_compare(options, "2GiB", gpt2_builds, 12, 16)
    # 14 fits only with an allocator retry: 13, the largest without, is the answer.
    assert result.probe_order == (12, 16, 14, 15, 13) and result.batch_size == 13
    assert result.with_retries_batch_size == 14
    assert "LoRA" in result.description


def test_builders_outside_a_search_build_a_model_each_time(gpt2_builds):
    """Without a search around it, build_preset_step builds a new model per call."""
    options = StepOptions(batch_size=2, seq_len=32)
    first = build_preset_step("gpt2-124m", options)
    second = build_preset_step("gpt2-124m", options)
    assert gpt2_builds[0] == 2
    assert first.track[0] is not second.track[0]


def test_smallest_gpu_builds_once_for_every_compute_capability(gpt2_builds, two_block_gpt2):
    """smallest_gpu traces once per compute capability (RTX 4090 sm_89, A100 sm_80) with one
    shared model; each GPU's peak reserved equals a fresh build's prediction on that GPU.
    (GPT-2 two blocks deep: ``two_block_gpt2``.)"""
    from oomkit.core.gpus import get_gpu
    from oomkit.core.target import Target
    from oomkit.plan.batch_search import smallest_gpu

    options = StepOptions(batch_size=2, seq_len=32, precision="bf16-mixed")

    def build(batch):
        return build_preset_step("gpt2-124m", dataclasses.replace(options, batch_size=batch))

    candidates = (get_gpu("rtx4090"), get_gpu("a100-40gb"))
    result = smallest_gpu(build, 2, candidates=candidates, margin_bytes=0)
    assert result.traces == 2 and gpt2_builds[0] == 1
    for fit in result.candidates:
        fresh = predict_built(
            build, "train step", 2, target=Target.resolve(fit.gpu), steps=2
        )
        assert fit.peak_reserved_bytes == fresh.required_bytes, fit.gpu.name
    assert gpt2_builds[0] == 3


def test_a_builder_making_two_alike_models_keeps_both(gpt2_builds, two_block_gpt2):
    """A step with a policy and a frozen reference copy of one preset (DPO-style) records two
    models in every probe: the search builds two, and its peaks equal fresh builds'. (GPT-2
    two blocks deep: ``two_block_gpt2``; batch 4 fits 6 GiB as the whole model's did, so the
    search from 4 to 5 probes both.)"""
    from oomkit.prediction.models.gpt2 import gpt2_parameter_count


    def build(batch):
        options = StepOptions(batch_size=batch, seq_len=16)
        policy = build_preset_step("gpt2-124m", options)
        reference = build_preset_step("gpt2-124m", options).track[0]
        reference.requires_grad_(False)
        return policy.step_fn, (*policy.track, reference)

    result = max_batch_size(
        build, target=Target.resolve("6GiB"), margin_bytes=0, start_batch=4, max_batch=5
    )
    # Built once per probe each, and the reference frozen after the build: the cache sees the
    # changed signature and rebuilds it, so its requires_grad starts as a fresh build's.
    assert result.probe_order == (4, 5)
    assert gpt2_builds[0] == 3  # the policy once, the reference (changed by the builder) twice
    searched = less_margin(result.target, result.margin_bytes)
    chosen = {result.batch_size, *result.probe_order[-2:]}
    compared = [p for p in result.curve if p.batch_size in chosen]
    assert len(compared) == len(chosen)
    for probe in compared:
        fresh = predict_built(build, "train step", probe.batch_size, target=searched, steps=2)
        assert probe.train.required_bytes == fresh.required_bytes
        assert probe.train.peak_allocated_bytes == fresh.peak_allocated_bytes
    # two models' fp32 weights (the whole GPT-2 124M: 124,439,808 parameters each)
    assert probe.train.peak_allocated_bytes > 4 * gpt2_parameter_count(two_block_gpt2) * 2
