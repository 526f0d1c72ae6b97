"""BERT with its masked-language-model head, written with plain torch modules.

Shapes and structure follow transformers' ``BertForMaskedLM`` (models/bert/modeling_bert.py):
word + position + token-type embeddings, post-LayerNorm encoder layers with exact GELU, dropout
0.1 on hidden states and attention probabilities, and an MLM head (dense, GELU, LayerNorm,
decoder tied to the word embeddings plus its own bias). No pooler: ``BertForMaskedLM`` builds
``BertModel(add_pooling_layer=False)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from oomkit.prediction.models._attention import sdpa
from oomkit.prediction.models._dropout import FusedDropout

__all__ = ["Bert", "BertShape", "bert_buffer_count", "bert_parameter_count"]


@dataclass(frozen=True)
class BertShape:
    """The sizes of a BERT model (names as in transformers' ``BertConfig``).

    Attributes:
        hidden: ``hidden_size``.
        intermediate: ``intermediate_size``.
        layers: ``num_hidden_layers``.
        heads: ``num_attention_heads``.
        vocab: ``vocab_size``.
        positions: ``max_position_embeddings``.
        token_types: ``type_vocab_size``.
        dropout: ``hidden_dropout_prob`` = ``attention_probs_dropout_prob``.
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int = 30522
    positions: int = 512
    token_types: int = 2
    dropout: float = 0.1


def bert_parameter_count(shape: BertShape) -> int:
    """Parameters of :class:`Bert` by arithmetic (the tied decoder weight counts once)."""
    h, i = shape.hidden, shape.intermediate
    embeddings = (shape.vocab + shape.positions + shape.token_types) * h + 2 * h
    per_layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    mlm_head = h * h + h + 2 * h + shape.vocab  # transform dense, LayerNorm, decoder bias
    return embeddings + shape.layers * per_layer + mlm_head


def bert_buffer_count(shape: BertShape) -> tuple[int, int]:
    """Buffer elements: ``position_ids`` and ``token_type_ids`` (int64, ``positions`` each)."""
    return 0, 2 * shape.positions


class _Layer(nn.Module):
    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        h = shape.hidden
        self.heads = shape.heads
        self.attention_dropout = shape.dropout
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)
        self.attention_output = nn.Linear(h, h)
        self.attention_norm = nn.LayerNorm(h, eps=1e-12)
        self.intermediate = nn.Linear(h, shape.intermediate)
        self.output = nn.Linear(shape.intermediate, h)
        self.output_norm = nn.LayerNorm(h, eps=1e-12)
        self.dropout = FusedDropout(shape.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        head_dim = hidden // self.heads
        q, k, v = (
            proj(x).view(batch, seq, self.heads, head_dim).transpose(1, 2)
            for proj in (self.query, self.key, self.value)
        )
        dropout_p = self.attention_dropout if self.training else 0.0
        y = sdpa(q, k, v, causal=False, dropout_p=dropout_p)
        y = y.transpose(1, 2).reshape(batch, seq, hidden)
        # BertSelfOutput / BertOutput: dense, dropout, LayerNorm(residual + x) (post-norm).
        x = self.attention_norm(self.dropout(self.attention_output(y)) + x)
        z = self.output(F.gelu(self.intermediate(x)))
        return self.output_norm(self.dropout(z) + x)


class Bert(nn.Module):
    """BERT encoder with MLM head, returning logits ``[batch, seq, vocab]``."""

    position_ids: torch.Tensor
    token_type_ids: torch.Tensor

    def __init__(self, shape: BertShape) -> None:
        super().__init__()
        h = shape.hidden
        self.shape = shape
        self.checkpointing = False
        self.word_embeddings = nn.Embedding(shape.vocab, h)
        self.position_embeddings = nn.Embedding(shape.positions, h)
        self.token_type_embeddings = nn.Embedding(shape.token_types, h)
        self.embedding_norm = nn.LayerNorm(h, eps=1e-12)
        self.dropout = FusedDropout(shape.dropout)
        # BertEmbeddings registers both as non-persistent int64 buffers of max positions.
        self.register_buffer("position_ids", torch.arange(shape.positions), persistent=False)
        self.register_buffer(
            "token_type_ids", torch.zeros(shape.positions, dtype=torch.long), persistent=False
        )
        self.layer = nn.ModuleList(_Layer(shape) for _ in range(shape.layers))
        self.transform = nn.Linear(h, h)
        self.transform_norm = nn.LayerNorm(h, eps=1e-12)
        self.decoder = nn.Linear(h, shape.vocab)
        self.decoder.weight = self.word_embeddings.weight  # tied (BertForMaskedLM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """MLM logits for every position of ``ids`` ``[batch, seq]``."""
        seq = ids.shape[1]
        x = (
            self.word_embeddings(ids)
            + self.token_type_embeddings(self.token_type_ids[:seq].expand(ids.shape[0], seq))
            + self.position_embeddings(self.position_ids[:seq])
        )
        x = self.dropout(self.embedding_norm(x))
        for layer in self.layer:
            if self.checkpointing and self.training:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        x = self.transform_norm(F.gelu(self.transform(x)))
        return self.decoder(x)
