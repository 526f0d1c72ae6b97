"""The tiny Llama config the model tests build on the meta device (2 layers, hidden 64, GQA)."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(
    *, vocab_size: int = 1000, max_position_embeddings: int = 256, **extra: Any
) -> Any:
    """A ``transformers.LlamaConfig``: 2 layers, hidden 64, MLP 128, 4 heads, 2 key/value heads."""
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        **extra,
    )
