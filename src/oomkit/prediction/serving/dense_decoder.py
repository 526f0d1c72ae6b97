"""vLLM's dense decoder (Llama, Mistral, Qwen2, Qwen3) on one rank, on meta, without transformers.

The allocations of vLLM's own modules, not of transformers' eager ones
(``vllm/model_executor/models/llama.py`` ``LlamaModel`` / ``LlamaDecoderLayer`` /
``LlamaAttention`` / ``LlamaMLP``): one fused QKV projection (``QKVParallelLinear``) whose output
is split into views; RoPE applied in place (``RotaryEmbedding.forward_cuda``); attention writing
into one ``[tokens, heads x head_dim]`` output (``Attention.forward``: ``torch.empty`` then the
backend fills it; FlashAttention's fp32 log-sum-exp beside it); ``fused_add_rms_norm`` updating
the residual and the hidden states in place, after the first layer's ``rms_norm`` into a new
tensor; one fused gate-up projection (``MergedColumnParallelLinear``) and ``SiluAndMul`` into a
``[tokens, intermediate]`` output. Qwen3's per-head q/k norms make new q and k tensors. Built
without transformers, so ``oomkit serve`` on these families imports torch only.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from oomkit.prediction.serving.model_spec import ServingModel

__all__ = ["DENSE_FAMILIES", "dense_decoder"]

# model_type -> (qkv has a bias, q/k have per-head RMSNorms); all SwiGLU MLPs with RMSNorm.
DENSE_FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


def dense_decoder(model: ServingModel, tp: int, dtype: str) -> Any | None:
    """The rank's decoder as vLLM builds it, on meta; ``None`` for other families (the caller
    builds those with transformers) or configs with features this builder does not model."""
    raw = model.raw.get("text_config") or model.raw
    family = DENSE_FAMILIES.get(model.model_type)
    if family is None or model.is_mla or raw.get("attention_bias") or raw.get("mlp_bias"):
        return None
    intermediate = raw.get("intermediate_size")
    if not isinstance(intermediate, int) or intermediate % tp:
        return None
    return _build(model, tp, dtype, intermediate // tp, *family)


def _build(model: ServingModel, tp: int, dtype: str, intermediate: int, qkv_bias: bool,
           qk_norm: bool) -> Any:
    import torch
    from torch import nn

    torch_dtype = {"float16": torch.float16, "float32": torch.float32}.get(dtype, torch.bfloat16)
    heads = model.num_attention_heads // tp
    kv_heads = model.kv_heads_per_rank(tp)
    head_dim = model.head_dim
    hidden = model.hidden_size
    vocab = model.vocab_size
    tied = bool((model.raw.get("text_config") or model.raw).get("tie_word_embeddings", False))

    def weight(*shape: int) -> nn.Parameter:
        return nn.Parameter(torch.empty(shape, dtype=torch_dtype, device="meta"),
                            requires_grad=False)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.input_layernorm = weight(hidden)
            self.post_attention_layernorm = weight(hidden)
            self.qkv_proj = weight((heads + 2 * kv_heads) * head_dim, hidden)
            if qkv_bias:
                self.qkv_bias = weight((heads + 2 * kv_heads) * head_dim)
            if qk_norm:
                self.q_norm = weight(head_dim)
                self.k_norm = weight(head_dim)
            self.o_proj = weight(hidden, heads * head_dim)
            self.gate_up_proj = weight(2 * intermediate, hidden)
            self.down_proj = weight(hidden, intermediate)

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = weight(vocab, hidden)
            self.layers = nn.ModuleList(Layer() for _ in range(model.num_layers))
            self.norm = weight(hidden)

        def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
            del use_cache
            ids = input_ids.reshape(-1)
            tokens = ids.shape[0]
            x = nn.functional.embedding(ids, self.embed_tokens)
            residual = None
            layers: list[Any] = list(self.layers)
            for layer in layers:
                if residual is None:  # rms_norm(x) into a new tensor; x becomes the residual
                    residual, x = x, torch.empty_like(x)
                else:  # fused_add_rms_norm: residual += x, x = norm(residual), in place
                    residual.add_(x)
                qkv = torch.matmul(x, layer.qkv_proj.t())
                if qkv_bias:
                    qkv.add_(layer.qkv_bias)
                q, k, _v = qkv.split([heads * head_dim, kv_heads * head_dim,
                                      kv_heads * head_dim], dim=-1)
                if qk_norm:  # Qwen3: RMSNorm per head makes new q and k
                    q, k = torch.empty_like(q), torch.empty_like(k)
                out = torch.empty((tokens, heads * head_dim), dtype=x.dtype, device=x.device)
                lse = torch.empty((heads, tokens), dtype=torch.float32, device=x.device)
                del q, k, _v, qkv, lse
                x = torch.matmul(out, layer.o_proj.t())
                del out
                residual.add_(x)
                gate_up = torch.matmul(x, layer.gate_up_proj.t())
                act = torch.empty((tokens, intermediate), dtype=x.dtype, device=x.device)
                del gate_up
                x = torch.matmul(act, layer.down_proj.t())
                del act
            if residual is not None:
                residual.add_(x)
            return SimpleNamespace(last_hidden_state=x.unsqueeze(0))

    class Head(nn.Module):
        def __init__(self, embedding: nn.Parameter | None) -> None:
            super().__init__()
            self.weight = embedding if embedding is not None else weight(vocab, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.matmul(x, self.weight.t())

    class DecoderLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Body()
            self.lm_head = Head(self.model.embed_tokens if tied else None)
            self.config = SimpleNamespace(hidden_size=hidden, intermediate_size=intermediate)

        def get_output_embeddings(self) -> nn.Module:
            return self.lm_head

    return DecoderLM()
