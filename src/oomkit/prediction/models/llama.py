"""Llama-style decoder written with plain torch modules: RMSNorm, RoPE, GQA, SwiGLU.

Mirrors transformers' modeling_llama.py (``LlamaRMSNorm``, ``LlamaRotaryEmbedding``,
``apply_rotary_pos_emb``, ``LlamaMLP``, ``LlamaAttention`` with the SDPA path) operation for
operation where it matters for memory; no biases, no dropout (``attention_dropout`` is 0.0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from oomkit.prediction.models._attention import GrowingKVCache, sdpa

__all__ = ["Llama", "LlamaShape", "llama_parameter_count"]


@dataclass(frozen=True)
class LlamaShape:
    """The sizes of a Llama-style model (names as in transformers' ``LlamaConfig``).

    Attributes:
        hidden: ``hidden_size``.
        intermediate: ``intermediate_size`` of the SwiGLU MLP.
        layers: ``num_hidden_layers``.
        heads: ``num_attention_heads``.
        kv_heads: ``num_key_value_heads`` (fewer than ``heads``: grouped-query attention).
        vocab: ``vocab_size``.
        tied: ``tie_word_embeddings``.
        positions: ``max_position_embeddings`` (RoPE has no table; this bounds ``seq_len``).
        rope_theta: RoPE base.
        rms_eps: ``rms_norm_eps``.
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    positions: int
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads


def llama_parameter_count(shape: LlamaShape) -> int:
    """Parameters of :class:`Llama` by arithmetic (a tied LM head counts once)."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    per_layer = (
        h * h  # q_proj
        + 2 * h * kv  # k_proj, v_proj (kv_heads heads each)
        + h * h  # o_proj
        + 3 * h * shape.intermediate  # gate_proj, up_proj, down_proj
        + 2 * h  # input_layernorm, post_attention_layernorm
    )
    head = 0 if shape.tied else shape.vocab * h
    return shape.vocab * h + shape.layers * per_layer + h + head  # + final norm


def llama_buffer_count(shape: LlamaShape) -> tuple[int, int]:
    """Buffer elements: RoPE's ``inv_freq`` (fp32, head_dim / 2), no int64 buffers."""
    return shape.head_dim // 2, 0


class RMSNorm(nn.Module):
    """transformers ``LlamaRMSNorm``: normalise in fp32, scale in the input dtype."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, shape: LlamaShape, layer: int) -> None:
        super().__init__()
        self.shape = shape
        self.layer = layer
        kv = shape.kv_heads * shape.head_dim
        self.q_proj = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.k_proj = nn.Linear(shape.hidden, kv, bias=False)
        self.v_proj = nn.Linear(shape.hidden, kv, bias=False)
        self.o_proj = nn.Linear(shape.hidden, shape.hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: GrowingKVCache | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        hd = self.shape.head_dim
        q = self.q_proj(x).view(batch, seq, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, hd).transpose(1, 2)
        # apply_rotary_pos_emb: q * cos + rotate_half(q) * sin, cos/sin broadcast over heads.
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        # transformers integrations/sdpa_attention.py use_gqa_in_sdpa: with no mask and
        # head_dim <= 256, SDPA gets enable_gqa=True instead of repeat_kv copies.
        gqa = self.shape.kv_heads != self.shape.heads
        y = sdpa(q, k, v, causal=True, dropout_p=0.0, enable_gqa=gqa)
        y = y.transpose(1, 2).reshape(batch, seq, -1).contiguous()
        return self.o_proj(y)


class _MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.up_proj = nn.Linear(shape.hidden, shape.intermediate, bias=False)
        self.down_proj = nn.Linear(shape.intermediate, shape.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, shape: LlamaShape, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden, shape.rms_eps)
        self.self_attn = _Attention(shape, layer)
        self.post_attention_layernorm = RMSNorm(shape.hidden, shape.rms_eps)
        self.mlp = _MLP(shape)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: GrowingKVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama-style causal language model returning logits ``[batch, seq, vocab]``."""

    inv_freq: torch.Tensor

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.checkpointing = False
        self.embed_tokens = nn.Embedding(shape.vocab, shape.hidden)
        self.layers = nn.ModuleList(LlamaBlock(shape, i) for i in range(shape.layers))
        self.norm = RMSNorm(shape.hidden, shape.rms_eps)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        if shape.tied:
            self.lm_head.weight = self.embed_tokens.weight
        # LlamaRotaryEmbedding: inv_freq is a non-persistent fp32 buffer of head_dim / 2.
        hd = shape.head_dim
        inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def new_cache(self) -> GrowingKVCache:
        """An empty KV cache for :meth:`forward`."""
        return GrowingKVCache(self.shape.layers)

    def _rope(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # LlamaRotaryEmbedding.forward: fp32 outer product of inv_freq and positions, duplicated
        # to head_dim, cos/sin cast to the activations' dtype.
        inv_freq = self.inv_freq.float()[None, :, None]
        freqs = (inv_freq @ positions.float()[None, None, :]).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        ids: torch.Tensor,
        cache: GrowingKVCache | None = None,
        logits_to_keep: int | None = None,
    ) -> torch.Tensor:
        """Logits for ``ids`` ``[batch, seq]``; with ``cache``, positions continue after it.

        ``logits_to_keep`` computes logits for the last tokens only, as generation does.
        """
        start = cache.length() if cache is not None else 0
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.embed_tokens(ids)
        cos, sin = self._rope(positions, x.dtype)
        for block in self.layers:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin, cache)
        x = self.norm(x)
        if logits_to_keep is not None:
            x = x[:, -logits_to_keep:, :]
        return self.lm_head(x)
