"""The catalog of built-in model presets and how each is built and stepped."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from oomkit.errors import OomkitError, UnknownPresetError
from oomkit.prediction.models.bert import Bert, BertShape, bert_buffer_count, bert_parameter_count
from oomkit.prediction.models.gpt2 import GPT2, GPT2Shape, gpt2_parameter_count
from oomkit.prediction.models.llama import (
    Llama,
    LlamaShape,
    llama_buffer_count,
    llama_parameter_count,
)
from oomkit.prediction.models.lora import prepare_finetune
from oomkit.prediction.models.model_cache import cached_model, model_cache_key
from oomkit.prediction.models.options import BuiltStep, Precision, StepOptions
from oomkit.prediction.models.resnet import (
    ResNet,
    ResNetShape,
    resnet_buffer_count,
    resnet_parameter_count,
)
from oomkit.prediction.models.selective_ac import apply_checkpointing
from oomkit.prediction.models.steps import ModelRunner, Task, build_step, model_dtype
from oomkit.prediction.models.vit import ViT, ViTShape, vit_parameter_count

__all__ = [
    "ModelPreset",
    "PRESETS",
    "build_preset_step",
    "get_preset",
    "presets_of_hub_name",
    "presets_said_for",
    "shaped_preset",
]


@dataclass(frozen=True)
class _Family:
    task: Task
    build: Callable[[Any], torch.nn.Module]
    parameter_count: Callable[[Any], int]
    buffer_count: Callable[[Any], tuple[int, int]] = lambda shape: (0, 0)  # (float, int64)


_FAMILIES: dict[type, _Family] = {
    GPT2Shape: _Family("causal_lm", GPT2, gpt2_parameter_count),
    LlamaShape: _Family("causal_lm", Llama, llama_parameter_count, llama_buffer_count),
    BertShape: _Family("masked_lm", Bert, bert_parameter_count, bert_buffer_count),
    ViTShape: _Family("image_classification", ViT, vit_parameter_count),
    ResNetShape: _Family(
        "image_classification", ResNet, resnet_parameter_count, resnet_buffer_count
    ),
}


@dataclass(frozen=True)
class ModelPreset:
    """One built-in model: its published shape and defaults.

    Attributes:
        name: catalog key, e.g. ``"gpt2-124m"``.
        title: human name, e.g. ``"GPT-2 124M"``.
        shape: the family's shape record (``GPT2Shape``, ``LlamaShape``, ...).
        default_seq_len: tokens per sequence when ``StepOptions.seq_len`` is ``None`` (text).
        source: where the shape comes from.
        default_precision: the precision ``oomkit predict``/``fit`` use without
            ``--precision``: ``bf16-mixed`` for the decoder LLMs (GPT-2, Llama), as they are
            trained today, ``fp32`` for the others. ``StepOptions`` itself defaults to fp32.
        default_batch_size: the batch ``oomkit predict`` uses without ``--batch``: 4 for Llama
            (batch 8 of Llama 3.2 1B at seq 2048 leaves under 1 GiB on an H100), else
            ``StepOptions``' 8.
        hub_name: the Hugging Face hub model whose ``config.json`` gives the shape
            (``meta-llama/Llama-3.1-8B``); None where the shape comes from elsewhere.
    """

    name: str
    title: str
    shape: Any
    default_seq_len: int | None
    source: str
    default_precision: Precision = "fp32"
    default_batch_size: int = 8
    hub_name: str | None = None

    @property
    def task(self) -> Task:
        """``causal_lm``, ``masked_lm`` or ``image_classification``."""
        return _FAMILIES[type(self.shape)].task

    def parameter_count(self) -> int:
        """Parameters by arithmetic from the shape (tied weights once); builds nothing."""
        return _FAMILIES[type(self.shape)].parameter_count(self.shape)

    def buffer_count(self) -> tuple[int, int]:
        """Elements of persistent-or-not registered buffers: (floating point, int64)."""
        return _FAMILIES[type(self.shape)].buffer_count(self.shape)

    def build(self) -> torch.nn.Module:
        """Construct the module under the current default device (e.g. ``torch.device("meta")``)."""
        return _FAMILIES[type(self.shape)].build(self.shape)


def _gpt2(name: str, title: str, hf_name: str, hidden: int, layers: int, heads: int) -> ModelPreset:
    shape = GPT2Shape(hidden=hidden, layers=layers, heads=heads)
    return ModelPreset(
        name,
        title,
        shape,
        1024,
        f"{hf_name} config.json on the Hugging Face hub",
        default_precision="bf16-mixed",
        hub_name=hf_name,
    )


# Llama shapes from the published config.json files on the Hugging Face hub. Llama 3.x also has
# rope_scaling "llama3", which changes inv_freq's values only, not any tensor's size.
_LLAMA3 = {"vocab": 128256, "positions": 131072, "rope_theta": 500000.0, "rms_eps": 1e-5}


def _llama(name: str, title: str, hf_name: str, **sizes: Any) -> ModelPreset:
    shape = LlamaShape(**sizes)
    return ModelPreset(
        name,
        title,
        shape,
        2048,
        f"{hf_name} config.json on the Hugging Face hub",
        default_precision="bf16-mixed",
        default_batch_size=4,
        hub_name=hf_name,
    )


_LLAMA_8B = _llama(
    "llama-8b",
    "Llama 3.1 8B",
    "meta-llama/Llama-3.1-8B",
    hidden=4096,
    intermediate=14336,
    layers=32,
    heads=32,
    kv_heads=8,
    tied=False,
    **_LLAMA3,
)

_ALL: tuple[ModelPreset, ...] = (
    _gpt2("gpt2-124m", "GPT-2 124M", "openai-community/gpt2", 768, 12, 12),
    _gpt2("gpt2-355m", "GPT-2 355M", "openai-community/gpt2-medium", 1024, 24, 16),
    _gpt2("gpt2-774m", "GPT-2 774M", "openai-community/gpt2-large", 1280, 36, 20),
    _gpt2("gpt2-1.5b", "GPT-2 1.5B", "openai-community/gpt2-xl", 1600, 48, 25),
    _llama(
        "llama-1b",
        "Llama 3.2 1B",
        "meta-llama/Llama-3.2-1B",
        hidden=2048,
        intermediate=8192,
        layers=16,
        heads=32,
        kv_heads=8,
        tied=True,
        **_LLAMA3,
    ),
    _llama(
        "llama-3b",
        "Llama 3.2 3B",
        "meta-llama/Llama-3.2-3B",
        hidden=3072,
        intermediate=8192,
        layers=28,
        heads=24,
        kv_heads=8,
        tied=True,
        **_LLAMA3,
    ),
    _LLAMA_8B,
    # The Llama 3.1 family under torchtitan's names (torchtitan/models/llama3/__init__.py
    # llama3_configs "8B", "70B", "405B": dim, n_layers, n_heads, n_kv_heads, and the FFN width
    # compute_ffn_hidden_dim(dim, multiple_of, ffn_dim_multiplier) gives: 4096/1024/1.3 ->
    # 14336, 8192/4096/1.3 -> 28672, 16384/4096/1.2 -> 53248; vocab_size 128256, rope theta
    # 500000, max_seq_len 131072), equal to meta-llama/Llama-3.1-{8B,70B,405B} config.json.
    # llama3-8b is llama-8b under torchtitan's name.
    dataclasses.replace(_LLAMA_8B, name="llama3-8b"),
    _llama(
        "llama3-70b",
        "Llama 3.1 70B",
        "meta-llama/Llama-3.1-70B",
        hidden=8192,
        intermediate=28672,
        layers=80,
        heads=64,
        kv_heads=8,
        tied=False,
        **_LLAMA3,
    ),
    _llama(
        "llama3-405b",
        "Llama 3.1 405B",
        "meta-llama/Llama-3.1-405B",
        hidden=16384,
        intermediate=53248,
        layers=126,
        heads=128,
        kv_heads=8,
        tied=False,
        **_LLAMA3,
    ),
    _llama(
        "llama-13b",
        "Llama 2 13B",
        "meta-llama/Llama-2-13b-hf",
        hidden=5120,
        intermediate=13824,
        layers=40,
        heads=40,
        kv_heads=40,
        tied=False,
        vocab=32000,
        positions=4096,
        rope_theta=10000.0,
        rms_eps=1e-5,
    ),
    ModelPreset(
        "bert-base",
        "BERT base",
        BertShape(hidden=768, intermediate=3072, layers=12, heads=12),
        512,
        "google-bert/bert-base-uncased config.json on the Hugging Face hub",
    ),
    ModelPreset(
        "bert-large",
        "BERT large",
        BertShape(hidden=1024, intermediate=4096, layers=24, heads=16),
        512,
        "google-bert/bert-large-uncased config.json on the Hugging Face hub",
    ),
    ModelPreset(
        "vit-b16",
        "ViT-B/16",
        ViTShape(hidden=768, mlp=3072, layers=12, heads=12),
        None,
        "torchvision/models/vision_transformer.py vit_b_16",
    ),
    ModelPreset(
        "resnet50", "ResNet-50", ResNetShape(), None, "torchvision/models/resnet.py resnet50"
    ),
)

PRESETS: Mapping[str, ModelPreset] = MappingProxyType({p.name: p for p in _ALL})


def presets_of_hub_name(name: str) -> list[str]:
    """The presets whose shape is the hub model ``name``'s (its ``config.json``), matched
    ignoring case: what to predict where that config cannot be loaded (offline)."""
    return [p.name for p in _ALL if p.hub_name is not None and p.hub_name.lower() == name.lower()]


def presets_said_for(name: str) -> str:
    """``"; a preset has its shapes: `oomkit predict llama-8b` or ..."``, for an error that
    could not load the hub model ``name``'s config; ``""`` where no preset has them."""
    same = " or ".join(f"`oomkit predict {p}`" for p in presets_of_hub_name(name))
    return f"; a preset has its shapes: {same}" if same else ""


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name`` (case-insensitive).

    Raises:
        UnknownPresetError: no such preset; the message lists close names and all names.
    """
    preset = PRESETS.get(name.lower())
    if preset is not None:
        return preset
    close = difflib.get_close_matches(name.lower(), list(PRESETS), n=3, cutoff=0.5)
    hint = f"Did you mean {', '.join(close)}? " if close else ""
    raise UnknownPresetError(
        f"unknown model preset {name!r}. {hint}Presets: {', '.join(PRESETS)}. For another "
        "Hugging Face model use build_hf_step (CLI: --hf NAME)"
    )


def build_preset_step(name: str, options: StepOptions, device: str = "meta") -> BuiltStep:
    """Build a preset on ``device`` and return its step for ``options``.

    Args:
        name: a key of :data:`PRESETS`, e.g. ``"gpt2-124m"``.
        options: batch size, lengths, precision, optimizer, checkpointing, mode.
        device: where the model and inputs live; ``"meta"`` (default) allocates nothing, so an
            8B-parameter model builds instantly.

    Returns:
        The step function, the objects to track, a description and the parameter count.

    Raises:
        UnknownPresetError: ``name`` is not a preset.
        OomkitError: the options do not fit the model (a sequence longer than its positions,
            ``generate`` on an encoder or vision model).
    """
    if options.precision is None:  # a preset's own precision is fp32
        options = dataclasses.replace(options, precision="fp32")
    if options.checkpoint_reentrant:
        raise OomkitError(
            "the presets checkpoint with use_reentrant=False only; reentrant checkpointing is "
            "modelled for Hugging Face models (build_hf_step, --hf). Drop "
            "StepOptions(checkpoint_reentrant=True)"
        )
    if options.hf_class is not None or options.attn_implementation not in (None, "sdpa"):
        raise OomkitError(
            "StepOptions.hf_class and attn_implementation choose how a Hugging Face model is "
            "built (build_hf_step, --hf); the presets are their own classes and run SDPA. Drop "
            "them, or predict the model with --hf and its config"
        )
    preset = shaped_preset(name, options)
    seq_len = options.seq_len or preset.default_seq_len or 0
    image_size = options.image_size or 224
    _check_lengths(preset, options, seq_len)

    def build() -> tuple[torch.nn.Module, str]:
        with torch.device(device):
            model = preset.build()
        model = model.to(dtype=model_dtype(options.precision))
        apply_checkpointing(model, options.checkpointing, train=options.mode == "train")
        return model, prepare_finetune(model, options, preset.title)  # quantize, LoRA

    # Within a batch search, built once and shared by its probes (model_cache.py).
    model, title = cached_model(model_cache_key("preset", preset, options, device), build)
    runner = _runner(preset, model)
    return build_step(
        runner, options, title=title, seq_len=seq_len, image_size=image_size, device=device
    )


def shaped_preset(name: str, options: StepOptions) -> ModelPreset:
    """The preset with its shape adjusted to ``options`` (ViT's image size sets its positions).

    Raises:
        UnknownPresetError: ``name`` is not a preset.
        OomkitError: a ViT image size that is not a multiple of its patch size.
    """
    preset = get_preset(name)
    shape = preset.shape
    if isinstance(shape, ViTShape) and options.image_size not in (None, shape.image_size):
        if options.image_size % shape.patch:
            raise OomkitError(
                f"{preset.title} cuts images into {shape.patch}-pixel patches; image_size "
                f"{options.image_size} is not a multiple of {shape.patch}. Example: "
                f"StepOptions(image_size={shape.patch * (options.image_size // shape.patch + 1)})"
            )
        # torchvision vit_b_16(image_size=...) sizes pos_embedding for that many patches.
        shape = dataclasses.replace(shape, image_size=options.image_size)
        preset = dataclasses.replace(preset, shape=shape)
    return preset


def _check_lengths(preset: ModelPreset, options: StepOptions, seq_len: int) -> None:
    positions = getattr(preset.shape, "positions", None)
    generating = options.mode == "generate" and preset.task == "causal_lm"
    total = seq_len + (options.new_tokens if generating else 0)
    if preset.task != "image_classification" and positions is not None and total > positions:
        raise OomkitError(
            f"{preset.title} has {positions} positions but the step needs {total} tokens "
            f"(seq_len {seq_len}"
            + (f" + new_tokens {options.new_tokens}" if generating else "")
            + f"); use StepOptions(seq_len=...) of at most {positions} in total"
        )


def _runner(preset: ModelPreset, model: Any) -> ModelRunner:
    task = preset.task
    shape = preset.shape
    classes = int(getattr(shape, "vocab", 0) or getattr(shape, "classes", 0))
    if task == "causal_lm":
        return ModelRunner(
            model,
            task,
            classes,
            forward=model,
            new_cache=model.new_cache,
            decode=lambda ids, cache, keep: model(ids, cache=cache, logits_to_keep=keep),
        )
    return ModelRunner(model, task, classes, forward=model)
