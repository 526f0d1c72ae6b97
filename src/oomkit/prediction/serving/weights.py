"""The weights one tensor-parallel rank of a serving engine holds, from a model built on meta.

``rank_model(model, tp, dtype)`` builds the transformers model one rank runs (heads and MLP
widths split by ``tp``, as vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` /
``RowParallelLinear`` split them) on the meta device; ``weight_bytes`` prices its parameters as
the engine stores them: linear weights in the quantized format (``--quantization fp8`` or the
config's own ``quantization_config``), embeddings and the LM head padded to a multiple of 64 rows
and split by ``tp`` (``vocab_parallel_embedding.py`` ``DEFAULT_VOCAB_PADDING_SIZE = 64``), norms
replicated, plus the RoPE cos/sin cache (``rotary_embedding.py``
``RotaryEmbedding._compute_cos_sin_cache``: ``max_position x rotary_dim``, in the model dtype,
one per model as ``get_rope`` caches it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from oomkit.errors import TorchRequiredError
from oomkit.prediction.serving.dense_decoder import dense_decoder
from oomkit.prediction.serving.model_spec import ServingConfigError, ServingModel, dtype_bytes

__all__ = ["WeightBytes", "linear_bits", "rank_model", "weight_bytes"]

# vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE: rows are padded to a multiple of 64.
VOCAB_PADDING = 64
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out", "word_embeddings")
# The widths split by tensor parallelism (config keys of transformers' decoder configs).
_SPLIT_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


@dataclass(frozen=True)
class WeightBytes:
    """Weights on one rank, by kind, in bytes.

    Attributes:
        linear_bytes: the linear layers' weights (quantized where the format says).
        embedding_bytes: embeddings and LM head (padded vocab rows over tp).
        other_bytes: norms, biases and other small parameters.
        rope_cache_bytes: the RoPE cos/sin cache buffer.
        quantization: the format the linear weights are stored in (``None``: the model dtype).
        bits_per_linear_weight: bits one linear weight takes, scales included.
    """

    linear_bytes: int
    embedding_bytes: int
    other_bytes: int
    rope_cache_bytes: int
    quantization: str | None
    bits_per_linear_weight: float

    @property
    def total_bytes(self) -> int:
        """Everything the rank loads (vLLM's "Model loading took ... GiB")."""
        return self.linear_bytes + self.embedding_bytes + self.other_bytes + self.rope_cache_bytes


def _quant_method(model: ServingModel, quantization: str | None) -> tuple[str | None, dict[str, Any]]:
    config = model.quantization or {}
    if quantization is not None:
        return quantization.lower(), config if quantization.lower() == str(
            config.get("quant_method", "")
        ).lower() else {}
    method = config.get("quant_method")
    return (str(method).lower() if method else None), config


def linear_bits(model: ServingModel, quantization: str | None, dtype: str) -> tuple[str | None, float]:
    """The format linear weights are stored in, and the bits a weight takes (scales included).

    fp8 (vLLM ``Fp8LinearMethod``, ``--quantization fp8`` or a checkpoint's ``fp8``): 8 bits.
    compressed-tensors: the config group's ``num_bits``, plus a bf16 scale a group when
    ``group_size`` is set. GPTQ/AWQ: ``bits`` plus an fp16 scale and a packed zero a group.
    MXFP4 (gpt-oss): 4 bits plus an 8-bit scale a 32-block. bitsandbytes: 4 bits plus an fp32
    absmax a 64-block, or 8 bits.

    Raises:
        ServingConfigError: a quantization method that is not modelled.
    """
    method, config = _quant_method(model, quantization)
    if method is None:
        return None, 8.0 * dtype_bytes(dtype)
    if method in {"fp8", "fbgemm_fp8", "modelopt", "ptpc_fp8"}:
        return method, 8.0
    if method == "compressed-tensors":
        groups = config.get("config_groups") or {}
        for group in groups.values() if isinstance(groups, dict) else ():
            weights = group.get("weights") or {}
            bits = weights.get("num_bits")
            if isinstance(bits, int):
                size = weights.get("group_size")
                extra = 16.0 / size if isinstance(size, int) and size > 0 else 0.0
                return method, bits + extra
        return method, 8.0
    if method in {"gptq", "awq", "gptq_marlin", "awq_marlin"}:
        bits = config.get("bits") or config.get("w_bit") or 4
        size = config.get("group_size") or config.get("q_group_size") or 128
        extra = (16.0 + bits) / size if size and size > 0 else 0.0
        return method, float(bits) + extra
    if method == "mxfp4":
        return method, 4.0 + 8.0 / 32
    if method == "bitsandbytes":
        if config.get("load_in_8bit"):
            return method, 8.0
        return method, 4.0 + 32.0 / 64
    raise ServingConfigError(
        f"quantization {method!r} is not modelled; oomkit serve knows fp8, compressed-tensors, "
        "gptq, awq, mxfp4 and bitsandbytes. Drop --quantization to price the weights unquantized"
    )


def _not_converted(model: ServingModel, quantization: str | None) -> tuple[str, ...]:
    """Module names a quantized checkpoint leaves unquantized (``ignore`` in compressed-tensors,
    ``modules_to_not_convert`` elsewhere); the LM head always stays in the model dtype."""
    _, config = _quant_method(model, quantization)
    names = list(config.get("ignore") or []) + list(config.get("modules_to_not_convert") or [])
    return tuple(str(name).removeprefix("re:") for name in names)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise TorchRequiredError(
            "oomkit serve builds the model on the meta device with transformers; install it "
            "with `pip install oomkit[hf]`"
        ) from exc
    return transformers


def rank_model(model: ServingModel, tp: int, dtype: str) -> Any:
    """The model one tensor-parallel rank runs, on the meta device.

    Llama, Mistral, Qwen2 and Qwen3 are built as vLLM builds them (``dense_decoder``); other
    families with transformers, where query heads, KV heads (at least 1: vLLM replicates them past their count) and the MLP
    widths are divided by ``tp``; the vocabulary is kept whole (the logits the sampler sees are
    gathered to the full vocabulary). Attention is SDPA, as oomkit traces it.

    Raises:
        ServingConfigError: ``tp`` does not divide the query heads (vLLM
            ``ModelConfig.verify_with_parallel_config`` refuses it), or transformers has no
            model for the config.
    """
    import torch

    if model.num_attention_heads % tp:
        raise ServingConfigError(
            f"--tensor-parallel-size {tp} does not divide the {model.num_attention_heads} "
            "attention heads; vLLM refuses it at start-up. Use a divisor of the head count"
        )
    dense = dense_decoder(model, tp, dtype)
    if dense is not None:  # vLLM's own module shapes, without importing transformers
        return dense
    transformers = _transformers()
    text = dict(model.raw.get("text_config") or model.raw)
    text.pop("quantization_config", None)
    text.update(
        num_attention_heads=model.num_attention_heads // tp,
        num_key_value_heads=model.kv_heads_per_rank(tp),
    )
    if not model.is_mla:  # MLA's head widths are their own fields (qk_nope/qk_rope/v_head_dim)
        text["head_dim"] = model.head_dim
    for key in _SPLIT_KEYS:
        if isinstance(text.get(key), int):
            text[key] = max(1, text[key] // tp)
    mapping = transformers.CONFIG_MAPPING
    if model.model_type not in mapping:
        raise ServingConfigError(
            f"transformers {transformers.__version__} has no model for model_type "
            f"{model.model_type!r}; upgrade transformers or pass a config of a supported model"
        )
    config = mapping[model.model_type].from_dict(text)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}.get(
        dtype, torch.float32
    )
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch_dtype, attn_implementation="sdpa"
        )


def weight_bytes(
    model: ServingModel, built: Any, *, tp: int, dtype: str, quantization: str | None
) -> WeightBytes:
    """Price ``built`` (from ``rank_model``) as the engine stores it on one rank.

    Raises:
        ServingConfigError: a quantization method that is not modelled.
    """
    method, bits = linear_bits(model, quantization, dtype)
    skip = _not_converted(model, quantization)
    element = dtype_bytes(dtype)
    padded_rows = math.ceil(model.vocab_size / VOCAB_PADDING) * VOCAB_PADDING // tp
    linear = embedding = other = 0.0
    for name, parameter in built.named_parameters():
        count = parameter.numel()
        if any(part in name for part in _EMBEDDING_NAMES):
            # VocabParallelEmbedding / ParallelLMHead: padded rows over tp, in the model dtype.
            embedding += count // model.vocab_size * padded_rows * element
        elif parameter.dim() >= 2:
            quantized = method is not None and not any(s and s in name for s in skip)
            if method == "mxfp4":  # gpt-oss: only the MoE experts are MXFP4
                quantized = "experts" in name
            linear += count * (bits / 8 if quantized else element)
        else:
            other += count * element
    rope = model.max_position_embeddings * model.rotary_dim * element
    return WeightBytes(
        linear_bytes=int(linear),
        embedding_bytes=int(embedding),
        other_bytes=int(other),
        rope_cache_bytes=rope,
        quantization=method,
        bits_per_linear_weight=bits if method is not None else 8.0 * element,
    )
