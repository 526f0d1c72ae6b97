"""What a serving engine reads from a Hugging Face ``config.json``: layers, heads, KV cache shape.

``read_serving_model(path)`` reads a local config directory or ``config.json`` (no network, no
transformers), or a Llama preset's published config, into a frozen ``ServingModel``. Its KV-cache figures follow vLLM's KV cache specs
(``vllm/v1/kv_cache_interface.py`` ``AttentionSpec.page_size_bytes``: ``2 * block_size *
num_kv_heads * head_size * dtype_size`` a layer; ``MLAAttentionSpec``: one latent of
``kv_lora_rank + qk_rope_head_dim`` a token, no V) and SGLang's cell size
(``model_runner.py`` ``profile_max_num_token``: ``num_kv_heads * head_dim * layers * 2 *
element_size``, or ``(kv_lora_rank + qk_rope_head_dim) * layers * element_size`` for MLA).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from oomkit.errors import OomkitError

__all__ = [
    "DTYPE_BYTES",
    "ServingConfigError",
    "ServingModel",
    "dtype_bytes",
    "kv_dtype_bytes",
    "read_serving_model",
]

LayerKind = Literal["full", "sliding"]


class ServingConfigError(OomkitError, ValueError):
    """A model config or an engine flag the serving prediction cannot use."""


# Bytes per element of the dtypes vLLM and SGLang accept for --dtype / --kv-cache-dtype
# (vllm/utils STR_DTYPE_TO_TORCH_DTYPE; the fp8 kv-cache dtypes store one byte an element).
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
}


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (``"bfloat16"`` -> 2).

    Raises:
        ServingConfigError: the name is not a dtype the engines accept.
    """
    key = name.lower().removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ServingConfigError(
            f"unknown dtype {name!r}; use one of auto, bfloat16, float16, float32 "
            "(or, for the KV cache, fp8, fp8_e4m3, fp8_e5m2)"
        )
    return DTYPE_BYTES[key]


def kv_dtype_bytes(kv_cache_dtype: str, model_dtype: str) -> int:
    """Bytes per KV-cache element: ``auto`` is the model's dtype (vLLM ``CacheConfig.cache_dtype``,
    SGLang ``ServerArgs.kv_cache_dtype``); ``fp8*`` is one byte."""
    if kv_cache_dtype.lower() == "auto":
        return dtype_bytes(model_dtype)
    return dtype_bytes(kv_cache_dtype)


@dataclass(frozen=True)
class ServingModel:
    """The figures of one model's ``config.json`` that the engines' memory accounting reads.

    Attributes:
        name: where the config came from.
        model_type: ``config.model_type`` (``"llama"``).
        num_layers: decoder layers (``num_hidden_layers``).
        hidden_size: model width.
        num_attention_heads: query heads.
        num_kv_heads: key/value heads (``num_key_value_heads``; the query heads when absent).
        head_dim: per head (``head_dim``, else ``hidden_size // num_attention_heads``).
        vocab_size: the embedding's rows.
        max_position_embeddings: the model's context, the engines' default ``max_model_len``.
        config_dtype: ``torch_dtype`` / ``dtype`` of the config (``"bfloat16"``).
        layer_kinds: per layer, ``"full"`` or ``"sliding"`` attention.
        sliding_window: the window of sliding layers, in tokens; ``None`` without.
        kv_lora_rank: MLA's latent width (DeepSeek-V2/V3); ``None`` for MHA/GQA.
        qk_rope_head_dim: MLA's decoupled RoPE width; ``None`` for MHA/GQA.
        rotary_dim: the width vLLM's RoPE cos/sin cache has (``head_dim`` times
            ``partial_rotary_factor``).
        quantization: the config's own ``quantization_config`` (a dict) or ``None``.
        raw: the whole (text) config, for the weight builder.
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    config_dtype: str
    layer_kinds: tuple[LayerKind, ...]
    sliding_window: int | None
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    rotary_dim: int
    quantization: dict[str, Any] | None
    raw: dict[str, Any]

    @property
    def is_mla(self) -> bool:
        """Whether attention keeps one compressed latent a token (DeepSeek-style MLA)."""
        return self.kv_lora_rank is not None

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one tensor-parallel rank holds: ``max(1, kv_heads // tp)`` (vLLM
        ``ModelConfig.get_num_kv_heads``: heads are replicated when tp exceeds them)."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token_per_layer(self, kv_bytes: int, tp: int = 1) -> int:
        """KV-cache bytes one token takes in one attention layer on one rank.

        MHA/GQA: K and V, ``2 * kv_heads_per_rank * head_dim * kv_bytes`` (vLLM
        ``AttentionSpec.page_size_bytes`` over ``block_size``). MLA: the latent and the RoPE
        key, ``(kv_lora_rank + qk_rope_head_dim) * kv_bytes``, not split by tp
        (``MLAAttentionSpec``; SGLang ``MLATokenToKVPool``).
        """
        if self.kv_lora_rank is not None:
            return (self.kv_lora_rank + (self.qk_rope_head_dim or 0)) * kv_bytes
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim * kv_bytes

    def kv_bytes_per_token(self, kv_bytes: int, tp: int = 1) -> int:
        """KV-cache bytes one token takes over every layer on one rank (SGLang's cell size)."""
        return self.num_layers * self.kv_bytes_per_token_per_layer(kv_bytes, tp)

    @property
    def num_sliding_layers(self) -> int:
        """Layers with sliding-window attention."""
        return sum(kind == "sliding" for kind in self.layer_kinds)


def _preset_config(source: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A Llama preset's ``config.json`` as its hub repository publishes it (its fields that
    serving reads), where ``source`` names one and no such path exists; else ``None``.

    The presets' shapes are those files' (``models/presets.py``). ``rope_scaling`` is left
    out: it changes RoPE's values, not the size of any tensor (vLLM's rotary cache is
    ``max_position_embeddings x rotary_dim`` either way).

    Raises:
        ServingConfigError: a preset that is not a decoder language model vLLM and SGLang
            serve as Llama (GPT-2, BERT, ViT, ResNet).
    """
    name = os.fspath(source)
    if Path(name).exists():
        return None
    from oomkit.prediction.models.llama import LlamaShape
    from oomkit.prediction.models.presets import PRESETS

    preset = PRESETS.get(name.lower())
    if preset is None:
        return None
    shape = preset.shape
    if not isinstance(shape, LlamaShape):
        llamas = ", ".join(p for p, v in PRESETS.items() if isinstance(v.shape, LlamaShape))
        raise ServingConfigError(
            f"the preset {name!r} ({preset.title}) is not a model oomkit serve takes by name: "
            f"it takes the Llama presets ({llamas}) or a model's config.json"
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": shape.positions,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_eps,
        "tie_word_embeddings": shape.tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "bfloat16",
    }


def _config_file(source: str | os.PathLike[str]) -> Path:
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    text = os.fspath(source)
    cached = _hf_cache_config(text)
    if cached is not None:
        return cached
    raise ServingConfigError(
        f"no config.json at {text!r}, and it is not in the local Hugging Face cache; "
        "oomkit serve reads no network: download the model's config.json (e.g. "
        f"`huggingface-cli download {text} config.json --local-dir ./model`) and pass that "
        "directory or file"
    )


def _hf_cache_config(name: str) -> Path | None:
    """``config.json`` of a hub name in the local Hugging Face cache (HF_HUB_CACHE /
    HF_HOME/hub / ~/.cache/huggingface/hub, ``models--org--name/snapshots/*/``), if any."""
    if name.count("/") != 1 or name.startswith((".", "/")):
        return None
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", os.path.join(home, "hub")))
    snapshots = hub / ("models--" + name.replace("/", "--")) / "snapshots"
    if not snapshots.is_dir():
        return None
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _positive_int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ServingConfigError(
            f"{where}: {key} must be a positive integer; got {value!r}. Is this a decoder "
            "language model's config.json?"
        )
    return value


def _layer_kinds(config: dict[str, Any], num_layers: int) -> tuple[tuple[LayerKind, ...], int | None]:
    """Which layers slide, and the window: ``layer_types`` (transformers' per-layer list),
    else ``sliding_window`` with ``sliding_window_pattern`` (every Nth layer full, Gemma 3),
    else Mistral/Qwen2's ``sliding_window`` (with ``use_sliding_window`` where present)."""
    window = config.get("sliding_window")
    window = window if isinstance(window, int) and window > 0 else None
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        kinds: tuple[LayerKind, ...] = tuple(
            "sliding" if "sliding" in str(kind) else "full" for kind in types
        )
        return kinds, window if "sliding" in kinds else None
    full: LayerKind = "full"
    sliding: LayerKind = "sliding"
    if window is None or config.get("use_sliding_window") is False:
        return (full,) * num_layers, None
    pattern = config.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:
        pattern_kinds: tuple[LayerKind, ...] = tuple(
            full if (i + 1) % pattern == 0 else sliding for i in range(num_layers)
        )
        return pattern_kinds, window
    return (sliding,) * num_layers, window


def read_serving_model(source: str | os.PathLike[str]) -> ServingModel:
    """Read a model's ``config.json`` (a directory, the file, or a hub name in the local cache).

    Raises:
        ServingConfigError: no config is found, or it lacks the figures the engines need.
    """
    preset = _preset_config(source)
    if preset is not None:
        config, path = preset, Path(f"{os.fspath(source)} (preset)")
    else:
        path = _config_file(source)
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ServingConfigError(f"could not read {path} as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ServingConfigError(f"{path} holds no JSON object; is it a model's config.json?")
    outer = config
    # A multimodal config keeps the language model under text_config (vLLM serves that part).
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    where = str(path)
    num_layers = _positive_int(text, "num_hidden_layers", where)
    hidden = _positive_int(text, "hidden_size", where)
    heads = _positive_int(text, "num_attention_heads", where)
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or hidden // heads
    vocab = _positive_int(text, "vocab_size", where)
    max_positions = text.get("max_position_embeddings") or outer.get("max_position_embeddings")
    if not isinstance(max_positions, int) or max_positions <= 0:
        raise ServingConfigError(
            f"{where}: no max_position_embeddings; pass --max-model-len explicitly"
        )
    dtype = text.get("dtype") or text.get("torch_dtype") or outer.get("torch_dtype") or "float32"
    kinds, window = _layer_kinds(text, num_layers)
    kv_lora_rank = text.get("kv_lora_rank")
    rope_dim = text.get("qk_rope_head_dim")
    partial = text.get("partial_rotary_factor", 1.0)
    rotary_dim = int(head_dim * partial) if isinstance(partial, int | float) else head_dim
    if isinstance(rope_dim, int) and kv_lora_rank:
        rotary_dim = rope_dim
    quant = outer.get("quantization_config") or text.get("quantization_config")
    return ServingModel(
        name=os.fspath(source),
        model_type=str(text.get("model_type") or outer.get("model_type") or "unknown"),
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        vocab_size=vocab,
        max_position_embeddings=max_positions,
        config_dtype=str(dtype).removeprefix("torch."),
        layer_kinds=kinds,
        sliding_window=window,
        kv_lora_rank=int(kv_lora_rank) if isinstance(kv_lora_rank, int) and kv_lora_rank else None,
        qk_rope_head_dim=int(rope_dim) if isinstance(rope_dim, int) and kv_lora_rank else None,
        rotary_dim=rotary_dim,
        quantization=quant if isinstance(quant, dict) else None,
        raw=config,
    )
