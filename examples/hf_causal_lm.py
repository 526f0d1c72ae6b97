"""A Hugging Face causal LM trained in a plain loop, for `oomkit predict examples/hf_causal_lm.py:build`.

The model is built from its config on the meta device (no download, no weights), called as a
tokenizer's batch calls it (``input_ids``, an all-ones ``attention_mask``, ``labels``), with
gradient checkpointing on. transformers' data-dependent mask checks are answered from what is
passed here (listed under the report's assumptions).

    oomkit predict examples/hf_causal_lm.py:build --batch 4 --seq 2048 --gpu h100
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig


def build(
    batch_size: int = 4,
    seq_len: int = 2048,
    hidden_size: int = 2048,
    num_hidden_layers: int = 16,
    vocab_size: int = 128256,
    gradient_checkpointing: bool = True,
    attention_mask: bool = True,
    device=None,
):
    """Llama-3.2-1B's shape (the defaults), in bf16 as its config's ``torch_dtype`` says."""
    config = LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=max(hidden_size // 64, 1),
        num_key_value_heads=max(hidden_size // 256, 1),
        vocab_size=vocab_size,
        max_position_embeddings=max(seq_len, 2048),
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    if gradient_checkpointing:
        # transformers 5 names it activation_checkpointing_enable; 4.x gradient_checkpointing_enable.
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    batch = {"input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), device=device)}
    if attention_mask:  # what a tokenizer or collator emits for unpadded rows
        batch["attention_mask"] = torch.ones(batch_size, seq_len, dtype=torch.long, device=device)
    batch["labels"] = batch["input_ids"].clone()

    def step() -> None:
        outputs = model(**batch)  # the model's own loss: logits upcast to fp32 inside
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (model, optimizer, batch)
