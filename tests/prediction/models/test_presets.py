"""Preset catalog: published parameter counts, building on meta, lookup errors, length checks."""

from __future__ import annotations

import pytest
import torch

from oomkit.errors import OomkitError, UnknownPresetError
from oomkit.prediction.models import PRESETS, StepOptions, build_preset_step, get_preset

# Published parameter counts (tied embeddings counted once).
PUBLISHED = {
    "gpt2-124m": 124_439_808,  # openai-community/gpt2
    "gpt2-355m": 354_823_168,  # gpt2-medium
    "gpt2-774m": 774_030_080,  # gpt2-large
    "gpt2-1.5b": 1_557_611_200,  # gpt2-xl
    "llama-1b": 1_235_814_400,  # Llama 3.2 1B
    "llama-3b": 3_212_749_824,  # Llama 3.2 3B
    "llama-8b": 8_030_261_248,  # Llama 3.1 8B
    "llama3-8b": 8_030_261_248,  # Llama 3.1 8B under torchtitan's name
    "llama3-70b": 70_553_706_496,  # Llama 3.1 70B
    "llama3-405b": 405_853_388_800,  # Llama 3.1 405B
    "llama-13b": 13_015_864_320,  # Llama 2 13B
    "bert-base": 109_514_298,  # BertForMaskedLM bert-base-uncased (~110M)
    "bert-large": 335_174_458,  # BertForMaskedLM bert-large-uncased (~340M)
    "vit-b16": 86_567_656,  # torchvision vit_b_16
    "resnet50": 25_557_032,  # torchvision resnet50
}


def test_catalog_names():
    """The catalog holds exactly the fifteen presets of the contract."""
    assert set(PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_arithmetic_parameter_count_matches_published(name):
    """Each preset's config arithmetic gives its published parameter count."""
    assert PRESETS[name].parameter_count() == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_built_model_has_published_parameter_count(name):
    """The module built on meta has exactly the published number of parameters."""
    with torch.device("meta"):
        model = PRESETS[name].build()
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


@pytest.mark.parametrize("name", ["resnet50", "bert-base", "llama-8b"])
def test_buffer_count_matches_built_model(name):
    """Buffer arithmetic (float, int64 elements) matches the built module's buffers."""
    with torch.device("meta"):
        model = PRESETS[name].build()
    floats = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    ints = sum(b.numel() for b in model.buffers() if b.dtype == torch.int64)
    assert PRESETS[name].buffer_count() == (floats, ints)


def test_llama_8b_builds_on_meta_with_gqa_shapes():
    """Llama 3.1 8B's k_proj has 8 KV heads of 128: a 1024 x 4096 weight; untied head."""
    built = build_preset_step("llama-8b", StepOptions(batch_size=1, mode="inference"))
    model = built.track[0]
    assert model.layers[0].self_attn.k_proj.weight.shape == (1024, 4096)
    assert model.lm_head.weight is not model.embed_tokens.weight
    assert built.parameter_count == 8_030_261_248


def test_gpt2_head_is_tied():
    """GPT-2's LM head shares the token embedding's storage."""
    built = build_preset_step("gpt2-124m", StepOptions(batch_size=1, mode="inference"))
    model = built.track[0]
    assert model.lm_head.weight is model.wte.weight


def test_unknown_preset_lists_close_names():
    """A misspelt preset raises UnknownPresetError (a ValueError) naming the closest presets."""
    with pytest.raises(UnknownPresetError, match="Did you mean gpt2-124m"):
        get_preset("gpt2-124")
    assert issubclass(UnknownPresetError, ValueError)


def test_description_names_every_option():
    """The description reads as the contract's example."""
    built = build_preset_step("gpt2-124m", StepOptions(precision="bf16-mixed"))
    assert built.description == "GPT-2 124M, batch 8, seq 1024, bf16-mixed, adamw, train"


def test_sequence_longer_than_positions_is_refused():
    """GPT-2 has 1024 positions: a 1000-token prompt plus 100 new tokens does not fit."""
    options = StepOptions(seq_len=1000, mode="generate", new_tokens=100)
    with pytest.raises(OomkitError, match="1024 positions but the step needs 1100 tokens"):
        build_preset_step("gpt2-124m", options)


def test_generate_needs_a_decoder():
    """Generation on BERT is refused with a message naming what can generate."""
    with pytest.raises(OomkitError, match="cannot generate"):
        build_preset_step("bert-base", StepOptions(batch_size=1, mode="generate"))


def test_vit_image_size_must_be_a_patch_multiple():
    """ViT-B/16 refuses a 100-pixel image (not a multiple of 16) and suggests 112."""
    with pytest.raises(OomkitError, match="image_size=112"):
        build_preset_step("vit-b16", StepOptions(image_size=100))


def test_vit_image_size_sets_position_embedding():
    """ViT-B/16 at 384 pixels has 577 positions: 24*24 patches + the class token."""
    built = build_preset_step("vit-b16", StepOptions(batch_size=1, image_size=384))
    assert built.track[0].pos_embedding.shape == (1, 577, 768)
    assert built.parameter_count == 86_567_656 + (577 - 197) * 768
