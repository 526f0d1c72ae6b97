"""Activation bytes of one GPT layer against Korthikanti et al. 2022's per-layer formula.

"Reducing Activation Recomputation in Large Transformer Models" (section 4.1) counts, for one
transformer layer with 16-bit activations, 1-byte dropout masks and an attention that
materialises the ``a x s x s`` score matrix (no flash attention), ``s*b*h*(34 + 5*a*s/h)`` bytes
stored for backward:

- attention, ``11*s*b*h + 5*a*s*s*b``: the QKV projection's input 2sbh; Q and K for Q K^T 4sbh;
  the softmax output 2as²b; its dropout mask as²b; the dropout output 2as²b and V 2sbh for the
  product with V; the output projection's input 2sbh and its dropout mask sbh;
- MLP, ``19*s*b*h``: the first linear's input 2sbh, the GeLU input 8sbh, the second linear's
  input 8sbh, the dropout mask sbh;
- two LayerNorms, ``4*s*b*h``: each stores its input 2sbh.

The layer below is written the way that formula's kernels run (Megatron-LM's layout
``[s, b, h]``, Q/K/V as views of one QKV output, explicit ``bmm``/``softmax``, and CUDA's fused
``native_dropout`` with its bool mask), in fp16 with dropout on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from oomkit.prediction.tracing import trace_step

S, B, H, A = 16, 2, 32, 4  # sequence, batch, hidden, attention heads


def _dropout(x: torch.Tensor) -> torch.Tensor:
    # On CUDA, aten::dropout runs the fused native_dropout, whose mask is bool (Dropout.cpp
    # is_fused_kernel_acceptable); on meta it would decompose into an input-dtype noise tensor.
    return torch.native_dropout(x, 0.1, True)[0]


class _MegatronLayer(nn.Module):
    """A pre-LayerNorm GPT layer with the math attention path of the paper's Megatron-LM."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(H)
        self.qkv = nn.Linear(H, 3 * H)
        self.proj = nn.Linear(H, H)
        self.ln_2 = nn.LayerNorm(H)
        self.fc_1 = nn.Linear(H, 4 * H)
        self.fc_2 = nn.Linear(4 * H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        d = h // A
        # Megatron ParallelAttention: per-head split of one QKV output; q, k, v stay views of it.
        qkv = self.qkv(self.ln_1(x)).view(s, b, A, 3 * d)
        q, k, v = qkv.split(d, dim=-1)
        q = q.reshape(s, b * A, d).transpose(0, 1)
        k = k.reshape(s, b * A, d).transpose(0, 1)
        v = v.reshape(s, b * A, d).transpose(0, 1)
        scores = torch.bmm(q, k.transpose(1, 2)) * (1.0 / math.sqrt(d))
        probs = _dropout(torch.softmax(scores, dim=-1))
        context = torch.bmm(probs, v).transpose(0, 1).reshape(s, b, h)
        x = x + _dropout(self.proj(context))
        mlp = self.fc_2(F.gelu(self.fc_1(self.ln_2(x))))
        return x + _dropout(mlp)


def _forward_backward(layer: nn.Module, x: torch.Tensor) -> None:
    layer(x).sum().backward()


def test_gpt_layer_activations_match_korthikanti_formula_plus_stated_differences():
    """One fp16 GPT layer saves s*b*h*(34 + 5as/h) bytes plus LayerNorm statistics (16sb)."""
    with torch.device("meta"):
        layer = _MegatronLayer().half()
    x = torch.empty(S, B, H, device="meta", dtype=torch.float16, requires_grad=True)
    recording = trace_step(_forward_backward, layer, x)
    formula_bytes = S * B * H * 34 + 5 * A * S * S * B  # s*b*h*(34 + 5*a*s/h)
    # Where the recording differs from the paper's count, term by term:
    # - the layer input x (the first LayerNorm's input, 2sbh in the formula) existed before the
    #   step, so it is recorded as "input", not "activation": -2sbh;
    # - the layer output (2sbh) outlives the layer and is recorded as an activation; the formula
    #   counts it in the next layer, as that layer's first LayerNorm input: +2sbh;
    # - each LayerNorm also saves its mean and rstd, fp32 of s*b elements each (aten
    #   native_layer_norm), which the paper leaves out as small: +2 * 2 * 4sb = +16sb;
    # - dropout masks are bool, 1 byte per element, as the formula assumes.
    layer_norm_stats_bytes = 2 * 2 * 4 * S * B
    expected = formula_bytes - 2 * S * B * H + 2 * S * B * H + layer_norm_stats_bytes
    assert recording.allocated_bytes("activation", phase="forward") == expected
    assert recording.allocated_bytes("input") == 2 * S * B * H
