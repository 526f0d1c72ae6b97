"""vLLM's KV cache from the bytes left for it: blocks, tokens, concurrency, the longest request.

The rules of ``vllm/v1/core/kv_cache_utils.py``: layers of one attention kind share a spec whose
page is ``block_size`` tokens of one layer (``AttentionSpec.page_size_bytes``); with one kind,
``num_blocks = available // (page_size * num_layers)`` (``_get_kv_cache_config_uniform_type``);
with full and sliding-window layers mixed, layers are split into groups of the smallest kind's
layer count, every group shares the same blocks, and ``num_blocks = available // (page_size *
group_size)`` (``_get_kv_cache_groups_uniform_page_size`` / ``get_kv_cache_config``). A request
of ``max_model_len`` tokens needs ``cdiv(max_model_len, block_size)`` blocks of a full-attention
group and ``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1`` of a
sliding one (``FullAttentionSpec`` / ``SlidingWindowSpec.max_memory_usage_bytes``);
``check_enough_kv_cache_memory`` refuses to start when that exceeds what is available, and
``estimate_max_model_len`` binary-searches the longest that fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from oomkit.prediction.serving.model_spec import ServingModel

__all__ = ["KvLayout", "kv_layout"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KvLayout:
    """How one rank's KV cache is laid out in blocks.

    Attributes:
        block_size: tokens a block holds.
        page_size_bytes: one block of one layer (``AttentionSpec.page_size_bytes``).
        group_size: layers sharing one block (all layers with one attention kind).
        num_groups: KV cache groups (1 with one attention kind).
        full_groups: groups of full-attention layers.
        sliding_window: the window of the sliding groups, in tokens (``None``: none).
        bytes_per_block: ``page_size_bytes * group_size``: what one more block costs.
    """

    block_size: int
    page_size_bytes: int
    group_size: int
    num_groups: int
    full_groups: int
    sliding_window: int | None

    @property
    def bytes_per_block(self) -> int:
        return self.page_size_bytes * self.group_size

    def num_blocks(self, available_bytes: int) -> int:
        """Blocks ``available_bytes`` holds (0 when none is available)."""
        return max(0, available_bytes // self.bytes_per_block)

    def blocks_per_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` tokens takes, over every group."""
        full = _cdiv(num_tokens, self.block_size) * self.full_groups
        sliding_groups = self.num_groups - self.full_groups
        if not sliding_groups or self.sliding_window is None:
            return full
        window_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, num_tokens)
        return full + (_cdiv(window_tokens, self.block_size) + 1) * sliding_groups

    def bytes_per_request(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """KV bytes one request of ``num_tokens`` needs (``max_memory_usage_bytes``)."""
        return self.blocks_per_request(num_tokens, max_num_batched_tokens) * self.bytes_per_block

    def tokens(self, num_blocks: int) -> int:
        """vLLM's "GPU KV cache size: N tokens": ``num_blocks // num_groups * block_size``."""
        return num_blocks // self.num_groups * self.block_size

    def max_concurrency(self, num_blocks: int, max_model_len: int, max_num_batched_tokens: int) -> float:
        """vLLM's "Maximum concurrency for N tokens per request": blocks over blocks a request
        of ``max_model_len`` takes (``get_max_concurrency_for_kv_cache_config``)."""
        per_request = self.blocks_per_request(max_model_len, max_num_batched_tokens)
        return num_blocks / per_request if per_request else math.inf

    def longest_request(self, available_bytes: int, max_model_len: int, max_num_batched_tokens: int) -> int:
        """The longest ``max_model_len`` whose one request fits (``estimate_max_model_len``),
        0 when not even one token does."""
        lo, hi, best = 1, max_model_len, 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.bytes_per_request(mid, max_num_batched_tokens) <= available_bytes:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best


def kv_layout(model: ServingModel, *, kv_bytes: int, tp: int, block_size: int) -> KvLayout:
    """The block layout of ``model``'s KV cache on one rank.

    Args:
        model: the config's figures.
        kv_bytes: bytes a KV element takes (``kv_dtype_bytes``).
        tp: tensor-parallel size.
        block_size: tokens a block holds (``--block-size``; vLLM's default 16).
    """
    page = block_size * model.kv_bytes_per_token_per_layer(kv_bytes, tp)
    sliding = model.num_sliding_layers
    full = model.num_layers - sliding
    if sliding == 0 or full == 0:
        return KvLayout(
            block_size=block_size,
            page_size_bytes=page,
            group_size=model.num_layers,
            num_groups=1,
            full_groups=1 if full else 0,
            sliding_window=model.sliding_window if sliding else None,
        )
    group = min(full, sliding)
    full_groups = _cdiv(full, group)
    return KvLayout(
        block_size=block_size,
        page_size_bytes=page,
        group_size=group,
        num_groups=full_groups + _cdiv(sliding, group),
        full_groups=full_groups,
        sliding_window=model.sliding_window,
    )
