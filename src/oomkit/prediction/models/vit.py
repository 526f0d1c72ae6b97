"""ViT-B/16 as torchvision builds it, written with plain torch modules.

Structure follows torchvision/models/vision_transformer.py (``VisionTransformer``,
``EncoderBlock``, ``MLPBlock``): a 16x16 stride-16 patch convolution, a class token, learned
position embeddings, pre-LayerNorm blocks (eps 1e-6) with exact GELU, dropout 0.0, and a linear
classification head on the class token. Attention mirrors ``nn.MultiheadAttention`` with
``need_weights=False`` (torch/nn/functional.py ``multi_head_attention_forward``: one packed input
projection whose q/k/v split is made contiguous, then SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from oomkit.prediction.models._attention import sdpa

__all__ = ["ViT", "ViTShape", "vit_parameter_count"]


@dataclass(frozen=True)
class ViTShape:
    """The sizes of a Vision Transformer.

    Attributes:
        hidden: ``hidden_dim``.
        mlp: ``mlp_dim``.
        layers: ``num_layers``.
        heads: ``num_heads``.
        patch: ``patch_size`` in pixels.
        image_size: input height and width in pixels (fixes the position-embedding length).
        classes: ``num_classes``.
    """

    hidden: int
    mlp: int
    layers: int
    heads: int
    patch: int = 16
    image_size: int = 224
    classes: int = 1000

    @property
    def tokens(self) -> int:
        """Sequence length: one per patch plus the class token."""
        return (self.image_size // self.patch) ** 2 + 1


def vit_parameter_count(shape: ViTShape) -> int:
    """Parameters of :class:`ViT` by arithmetic."""
    h, m = shape.hidden, shape.mlp
    patch_embed = 3 * shape.patch * shape.patch * h + h
    per_layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * m + m) + (m * h + h)
    return (
        patch_embed
        + h  # class token
        + shape.tokens * h  # position embedding
        + shape.layers * per_layer
        + 2 * h  # final LayerNorm
        + h * shape.classes
        + shape.classes
    )


class _Attention(nn.Module):
    def __init__(self, shape: ViTShape) -> None:
        super().__init__()
        self.heads = shape.heads
        self.in_proj = nn.Linear(shape.hidden, 3 * shape.hidden)
        self.out_proj = nn.Linear(shape.hidden, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        heads, head_dim = self.heads, hidden // self.heads
        # nn.MultiheadAttention(batch_first=True) works sequence-first: transpose (a view),
        # packed projection, then _in_projection_packed's contiguous q/k/v split.
        x = x.transpose(0, 1)
        proj = self.in_proj(x)
        proj = proj.unflatten(-1, (3, hidden)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        proj = proj.contiguous()
        q, k, v = (
            t.view(seq, batch * heads, head_dim).transpose(0, 1).view(batch, heads, seq, head_dim)
            for t in (proj[0], proj[1], proj[2])
        )
        y = sdpa(q, k, v, causal=False, dropout_p=0.0)
        y = y.permute(2, 0, 1, 3).contiguous().view(batch * seq, hidden)
        y = self.out_proj(y).view(seq, batch, hidden)
        return y.transpose(0, 1)


class _Block(nn.Module):
    def __init__(self, shape: ViTShape) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.hidden, eps=1e-6)
        self.self_attention = _Attention(shape)
        self.ln_2 = nn.LayerNorm(shape.hidden, eps=1e-6)
        self.mlp_1 = nn.Linear(shape.hidden, shape.mlp)
        self.mlp_2 = nn.Linear(shape.mlp, shape.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.ln_1(x))
        return x + self.mlp_2(F.gelu(self.mlp_1(self.ln_2(x))))


class ViT(nn.Module):
    """Vision Transformer classifier returning logits ``[batch, classes]``."""

    def __init__(self, shape: ViTShape) -> None:
        super().__init__()
        h = shape.hidden
        self.shape = shape
        self.checkpointing = False
        self.conv_proj = nn.Conv2d(3, h, kernel_size=shape.patch, stride=shape.patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, h))
        self.pos_embedding = nn.Parameter(torch.empty(1, shape.tokens, h).normal_(std=0.02))
        self.layers = nn.ModuleList(_Block(shape) for _ in range(shape.layers))
        self.ln = nn.LayerNorm(h, eps=1e-6)
        self.head = nn.Linear(h, shape.classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits for ``images`` ``[batch, 3, image_size, image_size]``."""
        batch = images.shape[0]
        x = self.conv_proj(images)  # [batch, hidden, n_h, n_w]
        x = x.reshape(batch, self.shape.hidden, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(batch, -1, -1), x], dim=1)
        x = x + self.pos_embedding
        for block in self.layers:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln(x)[:, 0])
