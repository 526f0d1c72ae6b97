"""GPT-2 written with plain torch modules, with the published shapes of the four sizes.

Shapes follow OpenAI's released configs as transformers' ``GPT2Config`` records them
(transformers/models/gpt2/configuration_gpt2.py and the ``openai-community/gpt2*`` config.json):
vocabulary 50257, 1024 learned positions, LayerNorm, a 4x MLP with tanh-approximated GELU
(``activation_function="gelu_new"``), dropout 0.1 on embeddings, attention and residuals, and an
LM head tied to the token embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from oomkit.prediction.models._attention import GrowingKVCache, sdpa
from oomkit.prediction.models._dropout import FusedDropout

__all__ = ["GPT2", "GPT2Shape", "gpt2_parameter_count"]


@dataclass(frozen=True)
class GPT2Shape:
    """The sizes of a GPT-2 model.

    Attributes:
        hidden: model width (``n_embd``).
        layers: transformer blocks (``n_layer``).
        heads: attention heads (``n_head``).
        vocab: vocabulary size.
        positions: learned positions (``n_positions``), the longest sequence.
        dropout: ``resid_pdrop`` = ``embd_pdrop`` = ``attn_pdrop``.
    """

    hidden: int
    layers: int
    heads: int
    vocab: int = 50257
    positions: int = 1024
    dropout: float = 0.1


def gpt2_parameter_count(shape: GPT2Shape) -> int:
    """Parameters of :class:`GPT2` by arithmetic (the tied LM head counts once)."""
    h = shape.hidden
    per_layer = (
        2 * h  # ln_1 weight and bias
        + (h * 3 * h + 3 * h)  # c_attn: fused q, k, v with bias
        + (h * h + h)  # attention c_proj
        + 2 * h  # ln_2
        + (h * 4 * h + 4 * h)  # mlp c_fc
        + (4 * h * h + h)  # mlp c_proj
    )
    embeddings = shape.vocab * h + shape.positions * h
    return embeddings + shape.layers * per_layer + 2 * h  # + ln_f


class _Attention(nn.Module):
    def __init__(self, shape: GPT2Shape, layer: int) -> None:
        super().__init__()
        self.heads = shape.heads
        self.layer = layer
        self.dropout = shape.dropout
        self.c_attn = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.c_proj = nn.Linear(shape.hidden, shape.hidden)
        self.resid_dropout = FusedDropout(shape.dropout)

    def forward(self, x: torch.Tensor, cache: GrowingKVCache | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        head_dim = hidden // self.heads
        # transformers GPT2Attention.forward: split the fused projection, then heads first.
        q, k, v = (
            t.view(batch, seq, self.heads, head_dim).transpose(1, 2)
            for t in self.c_attn(x).split(hidden, dim=2)
        )
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        dropout_p = self.dropout if self.training else 0.0
        y = sdpa(q, k, v, causal=True, dropout_p=dropout_p)
        y = y.transpose(1, 2).contiguous().view(batch, seq, hidden)
        return self.resid_dropout(self.c_proj(y))


class _MLP(nn.Module):
    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.c_fc = nn.Linear(shape.hidden, 4 * shape.hidden)
        self.c_proj = nn.Linear(4 * shape.hidden, shape.hidden)
        self.dropout = FusedDropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gelu_new is the tanh approximation (transformers/activations.py NewGELUActivation).
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, shape: GPT2Shape, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.hidden, eps=1e-5)
        self.attn = _Attention(shape, layer)
        self.ln_2 = nn.LayerNorm(shape.hidden, eps=1e-5)
        self.mlp = _MLP(shape)

    def forward(self, x: torch.Tensor, cache: GrowingKVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 language model returning logits ``[batch, seq, vocab]``."""

    def __init__(self, shape: GPT2Shape) -> None:
        super().__init__()
        self.shape = shape
        self.checkpointing = False
        self.wte = nn.Embedding(shape.vocab, shape.hidden)
        self.wpe = nn.Embedding(shape.positions, shape.hidden)
        self.drop = FusedDropout(shape.dropout)
        self.h = nn.ModuleList(GPT2Block(shape, i) for i in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.hidden, eps=1e-5)
        self.lm_head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied (GPT2LMHeadModel._tied_weights_keys)

    def new_cache(self) -> GrowingKVCache:
        """An empty KV cache for :meth:`forward`."""
        return GrowingKVCache(self.shape.layers)

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
        x = self.drop(self.wte(ids) + self.wpe(positions))
        for block in self.h:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache)
        x = self.ln_f(x)
        if logits_to_keep is not None:
            x = x[:, -logits_to_keep:, :]
        return self.lm_head(x)
