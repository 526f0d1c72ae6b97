"""ModelCache: a model built once per search, reused only while it is as built, recorded identically."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest
from _tiny_hf import tiny_llama_config

torch = pytest.importorskip("torch")

from oomkit.core.target import Target  # noqa: E402
from oomkit.plan.batch_probe import record_step  # noqa: E402
from oomkit.prediction.models import StepOptions, build_hf_step, build_preset_step, presets  # noqa: E402
from oomkit.prediction.models.bert import BertShape  # noqa: E402
from oomkit.prediction.models.gpt2 import GPT2Shape  # noqa: E402
from oomkit.prediction.models.lora_options import LoraOptions  # noqa: E402
from oomkit.prediction.models.model_cache import (  # noqa: E402
    ModelCache,
    active_model_cache,
    cached_model,
    model_cache_key,
)

H100 = Target.resolve("h100")


@pytest.fixture
def small_presets(monkeypatch):
    """One-block forms of the GPT-2, ResNet-50 and BERT presets (``gpt2-tiny``, ``resnet-tiny``,
    ``bert-tiny``), added to the preset table for the test: what is shared (the module, its
    BatchNorm buffers, its GradScaler-clipped fp16 step) does not depend on the depth, and one
    block records in a fraction of the full preset's time."""
    small = {
        "gpt2-tiny": ("gpt2-124m", GPT2Shape(hidden=128, layers=1, heads=4, vocab=1024, positions=64)),
        "resnet-tiny": ("resnet50", dataclasses.replace(presets.get_preset("resnet50").shape, blocks=(1, 1, 1, 1))),
        "bert-tiny": ("bert-base", BertShape(hidden=128, intermediate=512, layers=1, heads=4, vocab=1024)),
    }
    table = dict(presets.PRESETS)
    for name, (base, shape) in small.items():
        table[name] = dataclasses.replace(presets.get_preset(base), name=name, shape=shape)
    monkeypatch.setattr(presets, "PRESETS", MappingProxyType(table))


def _linear_builder(made):
    def build():
        with torch.device("meta"):
            model = torch.nn.Linear(4, 4)
        made.append(model)
        return model, "linear"

    return build


def _probe(cache, key, made):
    """One probe's request: the cache opened, one model asked for."""
    with cache.active():
        return cache.get(key, _linear_builder(made))


def test_a_key_is_built_once_and_reused_with_fresh_grads():
    """Two probes asking for one key build once; the second gets the same module, grads cleared."""
    made = []
    cache = ModelCache()
    model, title = _probe(cache, "k", made)
    model.weight.grad = torch.empty(4, 4, device="meta")
    again, again_title = _probe(cache, "k", made)
    assert again is model and (title, again_title) == ("linear", "linear")
    assert model.weight.grad is None
    assert (cache.builds, cache.reuses, len(made)) == (1, 1, 1)
    other, _ = _probe(cache, "other", made)
    assert other is not model and cache.builds == 2


def test_two_alike_models_in_one_probe_stay_two():
    """A builder that makes two models with the same key in one probe (a DPO policy and its
    reference) gets two distinct modules, and the same two again in the next probe."""
    made = []
    cache = ModelCache()
    with cache.active():
        first = cache.get("k", _linear_builder(made))[0]
        second = cache.get("k", _linear_builder(made))[0]
    assert first is not second and cache.builds == 2
    with cache.active():
        again = (cache.get("k", _linear_builder(made))[0], cache.get("k", _linear_builder(made))[0])
    assert again == (first, second) and (cache.builds, cache.reuses) == (2, 2)


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.register_forward_hook(lambda *a: None),
        lambda m: setattr(m, "cached_mask", torch.ones(2, device="meta")),
        lambda m: m.register_buffer("running", torch.zeros(4, device="meta")),
        lambda m: m.weight.requires_grad_(False),
        lambda m: setattr(m.weight, "data", torch.empty(4, 4, device="meta")),
    ],
    ids=["hook", "attribute", "buffer", "requires_grad", "new-storage"],
)
def test_a_model_changed_since_it_was_built_is_built_again(change):
    """A hook, a tensor cached on the module, a new buffer, a frozen weight or a swapped storage:
    the model differs from a fresh build, so the next get builds a new one."""
    made = []
    cache = ModelCache()
    model, _ = _probe(cache, "k", made)
    change(model)
    rebuilt, _ = _probe(cache, "k", made)
    assert rebuilt is not model and (cache.builds, cache.reuses) == (2, 0)
    assert _probe(cache, "k", made)[0] is rebuilt  # the new one is kept


def test_keys_leave_out_the_batch_and_refuse_what_cannot_be_shared():
    """The batch and the sequence length are not part of the key (the image size and the mode
    are); off the meta device or under torch.compile: no key."""
    a = model_cache_key("preset", "gpt2-124m", StepOptions(batch_size=2), "meta")
    b = model_cache_key("preset", "gpt2-124m", StepOptions(batch_size=64), "meta")
    assert a is not None and a == b
    assert a == model_cache_key("preset", "gpt2-124m", StepOptions(batch_size=2, seq_len=8), "meta")
    assert a != model_cache_key("preset", "vit-b16", StepOptions(image_size=384), "meta")
    assert a != model_cache_key("preset", "gpt2-124m", StepOptions(image_size=384), "meta")
    assert a != model_cache_key("preset", "gpt2-124m", StepOptions(mode="inference"), "meta")
    assert model_cache_key("preset", "gpt2-124m", StepOptions(batch_size=2), "cpu") is None
    assert model_cache_key("preset", "gpt2-124m", StepOptions(compile=True), "meta") is None
    assert model_cache_key("preset", ["unhashable"], StepOptions(), "meta") is None


def test_cached_model_uses_the_active_cache_only_while_open():
    """cached_model builds every time outside ``active()``, once inside it."""
    made = []
    cache = ModelCache()
    assert active_model_cache() is None
    cached_model("k", _linear_builder(made))
    with cache.active():
        assert active_model_cache() is cache
        first, _ = cached_model("k", _linear_builder(made))
        cached_model(None, _linear_builder(made))  # no key: never shared
    with cache.active():
        second, _ = cached_model("k", _linear_builder(made))
    assert active_model_cache() is None
    assert first is second and len(made) == 3 and cache.builds == 1


def _same_recordings(build, batches):
    """Each batch recorded with a shared model and with a fresh one: event for event equal."""
    cache = ModelCache()
    for batch in batches:
        shared, fresh = (
            record_step(build, "train step", batch, target=H100, steps=2, models=models)[0]
            for models in (cache, None)
        )
        assert shared == fresh, batch
    return cache


def test_steps_of_other_lengths_share_one_model_and_record_as_fresh_builds(small_presets):
    """GPT-2 (a one-block preset) and a Llama from a config at seq 16, 48, 32 (as --lengths records
    them): one model each, every recording event for event a fresh build's."""
    pytest.importorskip("transformers")
    builders = {
        "preset": lambda s: build_preset_step(
            "gpt2-tiny", StepOptions(batch_size=2, seq_len=s, precision="bf16-mixed")
        ),
        "hf": lambda s: build_hf_step(
            tiny_llama_config(bos_token_id=0, eos_token_id=0),
            StepOptions(batch_size=2, seq_len=s, precision="bf16-mixed"),
        ),
    }
    for name, build in builders.items():
        cache = ModelCache()
        for length in (16, 48, 32):

            def at_length(_batch, seq=length, make=build):
                return make(seq)

            shared, fresh = (
                record_step(at_length, "train step", 2, target=H100, steps=2, models=m)[0]
                for m in (cache, None)
            )
            assert shared == fresh, (name, length)
        assert (cache.builds, cache.reuses) == (1, 2), name


def test_resnet_with_batchnorm_buffers_records_identically_when_shared(small_presets):
    """ResNet's BatchNorm statistics (ResNet-50's bottlenecks, one per stage) are updated in
    place by every step; shared, its recordings at batch 2 then 3 still equal fresh builds',
    and it is built once."""
    cache = _same_recordings(
        lambda b: build_preset_step("resnet-tiny", StepOptions(batch_size=b, image_size=32)), (2, 3)
    )
    assert (cache.builds, cache.reuses) == (1, 1)


def test_bert_fp16_clipped_records_identically_when_shared(small_presets):
    """BERT (base's layout, one layer), fp16-mixed (GradScaler) with clipping: shared recordings equal fresh ones."""
    options = dict(seq_len=32, precision="fp16-mixed", max_grad_norm=1.0)
    cache = _same_recordings(
        lambda b: build_preset_step("bert-tiny", StepOptions(batch_size=b, **options)), (1, 2)
    )
    assert (cache.builds, cache.reuses) == (1, 1)


def test_hf_lora_model_from_a_config_records_identically_when_shared():
    """A Hugging Face Llama (a config built anew for every probe) with LoRA: one build, and
    recordings equal to fresh builds'."""
    pytest.importorskip("transformers")

    def config():
        return tiny_llama_config(bos_token_id=0, eos_token_id=0)

    options = dict(seq_len=32, precision="bf16-mixed", lora=LoraOptions(r=4))
    cache = _same_recordings(
        lambda b: build_hf_step(config(), StepOptions(batch_size=b, **options)), (1, 3, 2)
    )
    assert (cache.builds, cache.reuses) == (1, 2)
