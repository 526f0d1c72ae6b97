"""A nanoGPT-style training step for `oomkit predict examples/nanogpt_train.py:build`.

Written the way nanoGPT's train.py is: the autocast context and the GradScaler are built once,
outside the step, and the loss is read with ``.item()`` for logging. oomkit builds them as on a
CUDA machine (so ``ctx`` is a real bf16 autocast, not a silent fp32 step) and gives the logged
read a stand-in value, listed in the report.

    oomkit predict examples/nanogpt_train.py:build --batch 12 --seq 1024 --gpu a100-40gb
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT
        print(f"number of parameters: {sum(p.numel() for p in self.parameters()) / 1e6:.2f}M")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build(
    batch_size: int = 12,
    seq_len: int = 1024,
    n_layer: int = 12,
    n_head: int = 12,
    n_embd: int = 768,
    vocab_size: int = 50304,
    device=None,
):
    """GPT-2 124M (the defaults) as nanoGPT trains it: bf16 autocast, fused AdamW, clipping."""
    model = GPT(vocab_size, block_size=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), fused=True)
    # nanoGPT: ctx and scaler are made once, at module level, and reused by every step.
    ctx = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cuda", enabled=False)  # enabled only for float16, as nanoGPT
    x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)
    y = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)

    def step() -> None:
        with ctx:
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item()  # logged only: oomkit gives it a stand-in value and lists the line
        print(f"loss {lossf:.4f}")

    return step, (model, optimizer, x, y)
