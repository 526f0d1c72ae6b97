"""A Hugging Face ``Trainer`` fine-tuning a causal LM, for `oomkit predict examples/hf_trainer.py:build`.

The builder returns the ``Trainer`` itself. ``TrainingArguments(bf16=True)`` builds as on a GPU
(oomkit emulates one CUDA device while the builder runs), and oomkit runs ``trainer.train()``
one optimizer step at a time: accelerate's bf16 autocast and its fp32 copy of the model's
outputs, the Trainer's gradient clipping, accumulation and loss logging all run. Nothing is
saved: oomkit cancels the Trainer's checkpoints while it runs it.

    oomkit predict examples/hf_trainer.py:build --batch 4 --seq 1024 --gpu a100-80gb
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments


class TokenRows(Dataset):
    """Tokenized rows as a tokenizer returns them, made on the CPU (as read from disk)."""

    def __init__(self, rows: int, seq_len: int, vocab_size: int) -> None:
        self.rows, self.seq_len, self.vocab_size = rows, seq_len, vocab_size

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab_size, (self.seq_len,), device="cpu")
        mask = torch.ones(self.seq_len, dtype=torch.long, device="cpu")
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def llama_config(
    seq_len: int, hidden_size: int, num_hidden_layers: int, vocab_size: int
) -> LlamaConfig:
    """A Llama config of this width and depth (heads of 64, grouped-query attention by 4)."""
    return LlamaConfig(
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 4,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=max(hidden_size // 64, 1),
        num_key_value_heads=max(hidden_size // 256, 1),
        vocab_size=vocab_size,
        max_position_embeddings=max(seq_len, 2048),
    )


def build(
    batch_size: int = 4,
    seq_len: int = 1024,
    hidden_size: int = 1024,
    num_hidden_layers: int = 8,
    vocab_size: int = 32000,
    gradient_accumulation_steps: int = 1,
):
    """A small Llama-shaped model in fp32 weights, trained with bf16 mixed precision."""
    config = llama_config(seq_len, hidden_size, num_hidden_layers, vocab_size)
    model = AutoModelForCausalLM.from_config(config)
    args = TrainingArguments(
        output_dir=str(Path(tempfile.gettempdir()) / "oomkit-example-hf-trainer"),
        bf16=True,
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_grad_norm=1.0,
        learning_rate=2e-5,
        optim="adamw_torch",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=TokenRows(1000, seq_len, vocab_size))
