"""Builders for the trainer tests: the same small model through a trainer and in a plain loop.

Loaded by path, as ``oomkit predict file.py:function`` loads a user's file.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

VOCAB = 2048
WIDTH = 256


class Net(nn.Module):
    """Embedding, two MLP blocks, a vocabulary head: the loss needs the full logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                for _ in range(2)
            ]
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.mlp(self.emb(input_ids)))
        loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
        return {"loss": loss, "logits": logits}


class Tokens(Dataset):
    """Token windows made on the CPU, as a dataset read from disk makes them."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (self.seq_len,), device="cpu")
        return {"input_ids": ids, "labels": ids.clone()}


def plain(batch_size: int = 8, seq_len: int = 128, fp32_outputs: bool = False):
    """The plain loop: bf16 CUDA autocast, AdamW, clipping at 1.0, zero_grad(set_to_none)."""
    net = Net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    input_ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    labels = input_ids.clone()

    def loss_fn() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(input_ids, labels)
        if fp32_outputs:
            # What accelerate's prepare_model adds around an autocast forward
            # (utils/operations.py convert_outputs_to_fp32): fp32 copies of bf16 outputs.
            out = {k: v.float() if v.dtype == torch.bfloat16 else v for k, v in out.items()}
        return out["loss"]

    def step() -> None:
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (net, optimizer, input_ids, labels)


def plain_fp32_outputs(batch_size: int = 8, seq_len: int = 128):
    """The plain loop with accelerate's fp32 copy of the model's outputs."""
    return plain(batch_size, seq_len, fp32_outputs=True)


def hf_trainer(batch_size: int = 8, seq_len: int = 128, use_cpu: bool = False):
    """The same model through transformers' Trainer, bf16=True, logging every step."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        # Trainer.__init__ creates output_dir (trainer.py, "Hub & output"); nothing is saved in it.
        output_dir=str(Path(tempfile.gettempdir()) / "oomkit-trainer-test"),
        bf16=True,
        use_cpu=use_cpu,
        per_device_train_batch_size=batch_size,
        max_grad_norm=1.0,
        optim="adamw_torch",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
    )
    return Trainer(model=Net(), args=args, train_dataset=Tokens(seq_len))


def hf_trainer_emptying_the_cache(batch_size: int = 8, seq_len: int = 128, every: int = 2):
    """A Trainer with torch_empty_cache_steps=every: training_step empties the cache after the
    loss in the optimizer steps 0, every, 2 * every, ..."""
    trainer = hf_trainer(batch_size, seq_len)
    trainer.args.torch_empty_cache_steps = every
    return trainer


def hf_trainer_on_cpu(batch_size: int = 8, seq_len: int = 128):
    """A Trainer told to train on the CPU: refused."""
    return hf_trainer(batch_size, seq_len, use_cpu=True)


def _lightning_module(log: bool):
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.net(**batch)["loss"]
            if log:
                self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Module()


def lightning_fit(
    batch_size: int = 8,
    seq_len: int = 128,
    log: bool = True,
    strategy: str = "auto",
    precision: str = "bf16-mixed",
):
    """The same model as a LightningModule through Trainer.fit, bf16-mixed, clipping at 1.0."""
    import lightning as L

    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        gradient_clip_val=1.0,
        max_epochs=1,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    loader = DataLoader(Tokens(seq_len), batch_size=batch_size)
    return trainer, _lightning_module(log), loader


def lightning_fit_unlogged(batch_size: int = 8, seq_len: int = 128):
    """Trainer.fit with a training_step that logs nothing."""
    return lightning_fit(batch_size, seq_len, log=False)


def lightning_fit_fp16(batch_size: int = 8, seq_len: int = 128):
    """Trainer.fit with precision="16-mixed": fp16 autocast and a GradScaler."""
    return lightning_fit(batch_size, seq_len, precision="16-mixed")


def lightning_ddp(batch_size: int = 8, seq_len: int = 128):
    """A DDP strategy: refused (oomkit predicts one GPU)."""
    return lightning_fit(batch_size, seq_len, strategy="ddp")


def lightning_trainer_alone():
    """A Lightning Trainer returned without its module: refused."""
    return lightning_fit()[0]


def lightning_fit_accumulate(batch_size: int = 8, seq_len: int = 128):
    """Trainer.fit with accumulate_grad_batches=2: two micro-batches per optimizer step."""
    import lightning as L

    trainer, module, loader = lightning_fit(batch_size, seq_len, log=False)
    trainer = L.Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        max_epochs=1,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    return trainer, module, loader


def hf_trainer_accumulate(batch_size: int = 8, seq_len: int = 128):
    """The HF Trainer with gradient_accumulation_steps=2."""
    trainer = hf_trainer(batch_size, seq_len)
    trainer.args.gradient_accumulation_steps = 2
    return trainer
