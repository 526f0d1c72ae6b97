"""The examples at a test's size, and their plain equivalents, for ``oomkit predict FILE:function``.

Each ``small_*`` calls an example's ``build`` with a small model; each ``plain_*`` runs the
same model the way the example's answer should match (autocast entered inside the step, no
mask, no trainer). Loaded by path, as oomkit loads a user's file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import nanogpt_train  # noqa: E402

NANOGPT = {"n_layer": 2, "n_head": 4, "n_embd": 128, "vocab_size": 1024}
LLAMA = {"hidden_size": 128, "num_hidden_layers": 2, "vocab_size": 1024}
LIGHTNING = {"vocab_size": 1024, "d_model": 128, "n_layer": 2}


def small_nanogpt(batch_size: int, seq_len: int):
    """examples/nanogpt_train.py: autocast and GradScaler built once, loss.item() logged."""
    return nanogpt_train.build(batch_size, seq_len, **NANOGPT)


def plain_nanogpt(batch_size: int, seq_len: int):
    """The same GPT with torch.autocast entered inside the step and no .item()."""
    model = nanogpt_train.GPT(
        NANOGPT["vocab_size"], seq_len, NANOGPT["n_layer"], NANOGPT["n_head"], NANOGPT["n_embd"]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=True)
    x = torch.randint(0, NANOGPT["vocab_size"], (batch_size, seq_len))
    y = torch.randint(0, NANOGPT["vocab_size"], (batch_size, seq_len))

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (model, optimizer, x, y)


def small_hf_causal_lm(batch_size: int, seq_len: int):
    """examples/hf_causal_lm.py with a tokenizer's all-ones attention mask."""
    import hf_causal_lm

    return hf_causal_lm.build(batch_size, seq_len, **LLAMA)


def plain_hf_causal_lm(batch_size: int, seq_len: int):
    """The same model called without an attention mask (what an all-ones mask means)."""
    import hf_causal_lm

    return hf_causal_lm.build(batch_size, seq_len, attention_mask=False, **LLAMA)


def small_lightning(batch_size: int, seq_len: int):
    """examples/lightning_fit.py: (trainer, module, datamodule) through Trainer.fit."""
    import lightning_fit

    return lightning_fit.build(batch_size, seq_len, **LIGHTNING)


def plain_lightning(batch_size: int, seq_len: int):
    """The same TinyLM in a plain loop: bf16 CUDA autocast, AdamW, clipping at 1.0."""
    import lightning_fit

    module = lightning_fit.TinyLM(
        LIGHTNING["vocab_size"], LIGHTNING["d_model"], LIGHTNING["n_layer"], 2, seq_len
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-4)
    x = torch.randint(0, LIGHTNING["vocab_size"], (batch_size, seq_len))
    y = torch.randint(0, LIGHTNING["vocab_size"], (batch_size, seq_len))

    def loss_fn() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = module(x)
            return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def step() -> None:
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (module, optimizer, x, y)


def small_hf_trainer(batch_size: int, seq_len: int):
    """examples/hf_trainer.py: a transformers Trainer with bf16=True."""
    import hf_trainer

    return hf_trainer.build(batch_size, seq_len, **LLAMA)


def plain_hf_trainer(batch_size: int, seq_len: int):
    """The same Llama in a plain loop: bf16 autocast forward, accelerate's fp32 outputs."""
    import hf_trainer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_trainer.llama_config(seq_len, **LLAMA))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    ids = torch.randint(0, LLAMA["vocab_size"], (batch_size, seq_len))
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    def loss_fn() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        # accelerate's prepare_model: convert_outputs_to_fp32 around the autocast forward.
        logits = out.logits.float()
        del out.logits, logits
        return out.loss

    def step() -> None:
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (model, optimizer, batch)
