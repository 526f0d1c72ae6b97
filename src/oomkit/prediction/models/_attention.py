"""Attention pieces shared by the decoder presets: SDPA call and a KV cache that grows by cat."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["GrowingKVCache", "sdpa"]


class GrowingKVCache:
    """Per-layer key/value cache that grows by ``torch.cat`` on every forward.

    Behaves as Hugging Face's ``DynamicCache`` does (transformers/cache_utils.py,
    ``DynamicLayer.update``: ``torch.cat([self.keys, key_states], dim=-2)``): each decode step
    allocates a new key and value tensor one token longer and frees the old ones, so for a moment
    both are alive. A preallocated ``StaticCache`` would instead allocate the full length once.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def length(self) -> int:
        """Tokens cached so far (layer 0)."""
        keys = self.keys[0]
        return 0 if keys is None else keys.shape[-2]

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[batch, kv_heads, new, head_dim]`` keys/values; return the whole cache."""
        old_keys, old_values = self.keys[layer], self.values[layer]
        if old_keys is not None and old_values is not None:
            keys = torch.cat([old_keys, keys], dim=-2)
            values = torch.cat([old_values, values], dim=-2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool,
    dropout_p: float,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` on ``[batch, heads, seq, head_dim]`` tensors.

    ``causal`` is dropped when one query attends to a longer cache: as in transformers
    (integrations/sdpa_attention.py, ``sdpa_attention_forward``: ``is_causal = query.shape[2] > 1``),
    a single new token sees every cached one, and SDPA's ``is_causal`` would align the mask to the
    top-left corner instead.
    """
    is_causal = causal and query.shape[-2] > 1
    if enable_gqa:
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=True
        )
    return F.scaled_dot_product_attention(
        query, key, value, dropout_p=dropout_p, is_causal=is_causal
    )
