"""A LightningModule trained with ``Trainer.fit``, for `oomkit predict examples/lightning_fit.py:build`.

The builder returns the trainer with what ``fit`` takes, ``(trainer, module, datamodule)``;
oomkit runs ``Trainer.fit`` one optimizer step at a time on one emulated CUDA GPU, so the
trainer's bf16-mixed precision plugin (CUDA autocast), gradient clipping, accumulation and
``self.log`` all run as they do on the GPU.

    oomkit predict examples/lightning_fit.py:build --batch 32 --seq 512 --gpu rtx4090
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class TinyLM(L.LightningModule):
    """A small causal transformer language model."""

    def __init__(self, vocab_size: int, d_model: int, n_layer: int, n_head: int, seq_len: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, n_head, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.embed(idx) + self.pos(pos)
        return self.head(self.blocks(x, is_causal=False))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        self.log("train_loss", loss, prog_bar=True)  # read with .item() for the progress bar
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


class RandomTokens(Dataset):
    """Token windows made on the CPU, as a real dataset reads them from disk."""

    def __init__(self, length: int, seq_len: int, vocab_size: int) -> None:
        self.length, self.seq_len, self.vocab_size = length, seq_len, vocab_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, self.vocab_size, (self.seq_len + 1,), device="cpu")
        return tokens[:-1], tokens[1:]


class Tokens(L.LightningDataModule):
    def __init__(self, batch_size: int, seq_len: int, vocab_size: int) -> None:
        super().__init__()
        self.batch_size, self.seq_len, self.vocab_size = batch_size, seq_len, vocab_size

    def train_dataloader(self) -> DataLoader:
        data = RandomTokens(64 * self.batch_size, self.seq_len, self.vocab_size)
        return DataLoader(data, batch_size=self.batch_size, shuffle=True)


def build(
    batch_size: int = 32,
    seq_len: int = 512,
    vocab_size: int = 32000,
    d_model: int = 512,
    n_layer: int = 6,
    precision: str = "bf16-mixed",
    accumulate_grad_batches: int = 1,
):
    """What a training script builds before ``trainer.fit(module, datamodule)``."""
    module = TinyLM(vocab_size, d_model, n_layer, max(d_model // 64, 1), seq_len)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        precision=precision,
        gradient_clip_val=1.0,
        accumulate_grad_batches=accumulate_grad_batches,
        max_epochs=1,
        enable_model_summary=False,
    )
    return trainer, module, Tokens(batch_size, seq_len, vocab_size)
