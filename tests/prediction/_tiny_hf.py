"""The tiny transformers configs the model and tracing tests build on the meta device.

Importable from every test below tests/prediction: ``tests/prediction/conftest.py`` puts this
folder on ``sys.path`` (pytest's default ``prepend`` import mode inserts a conftest's folder).
"""

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


def tiny_gpt2_config(**extra: Any) -> Any:
    """A ``transformers.GPT2Config``: 2 layers, 64 wide, 4 heads, 1000 tokens, 128 positions,
    token 0 as both BOS and EOS."""
    import transformers

    return transformers.GPT2Config(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=1000,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )


def tiny_bert_config(**extra: Any) -> Any:
    """A ``transformers.BertConfig``: 2 layers, hidden 64, MLP 128, 4 heads, 1000 tokens, 128
    positions."""
    import transformers

    return transformers.BertConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=1000,
        max_position_embeddings=128,
        **extra,
    )
