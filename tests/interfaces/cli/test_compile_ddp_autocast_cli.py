"""`oomkit predict PRESET --dp 2 --compile` under bf16-mixed: where autocast's weight casts go.

Compiled blocks under DDP and autocast hold more bytes tagged ``activation`` than the eager
step (232960 against 150016 on the tiny Llama), and fewer bytes in all. This is PyTorch's
behaviour, not the DDPOptimizer's and not the recorder's:

- Eager: autocast casts each fp32 weight once into its weight-cast cache
  (aten/src/ATen/autocast_mode.cpp ``cached_cast``: a leaf that requires grad), so the bf16
  copies are ``autocast_cache`` bytes; the matmul saves that same copy for backward.
- Compiled: AOTAutograd traces autocast into the joint graph, where each cast is an explicit
  ``prims.convert_element_type`` node with no cache. The min-cut partitioner does not recompute
  it in backward, as the cast's user there (the weight-gradient matmul's transpose) is not
  fusible with it (torch/_functorch/partitioners.py ``should_ban_recomputation``: "materialized
  in backward"), so the bf16 copy is a forward output saved for backward, an ``activation``.
  torch.compile of the whole model on one GPU saves them the same way.
- The DDPOptimizer (torch/_dynamo/backends/distributed.py ``DDPOptimizer.compile_fn``) splits a
  captured graph only where its parameters pass DDP's first bucket (1 MiB): a tiny block's
  graph is one bucket, compiled as it is ("bypass split/fuse logic if there is only one
  bucket"), so it does not change what is saved.
"""

from __future__ import annotations

import json

import pytest
from _parallel_helpers import FFN, HIDDEN, KV, LAYERS, VOCAB

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

BF16_BYTES = 2
# The 7 matrices of one block (wq, wo: HIDDEN x HIDDEN; wk, wv: KV x HIDDEN; w1, w2, w3:
# HIDDEN x FFN), cast to bf16: 73728 bytes.
BLOCK_CASTS_BYTES = (2 * HIDDEN * HIDDEN + 2 * KV * HIDDEN + 3 * HIDDEN * FFN) * BF16_BYTES
# The LM head cast (VOCAB x HIDDEN); the embedding is not an autocast op, so it is not cast.
HEAD_CAST_BYTES = VOCAB * HIDDEN * BF16_BYTES


def _predict(argv, capsys):
    code = main(["predict", "llama3-8b", "--dp", "2", *argv, "--batch", "1", "--seq", "16",
                 "--steps", "2", "--json"])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def _largest(data, *categories):
    """The most bytes of ``categories`` held together at any point of the JSON timeline."""
    return max(
        sum(point["by_category_bytes"].get(c, 0) for c in categories) for point in data["timeline"]
    )


def test_compiled_blocks_save_autocast_weight_casts_as_activations(tiny_llama, capsys, monkeypatch):
    """Eager bf16-mixed DDP: 150016 activation bytes and 180224 in autocast's cache (the 2
    blocks' weight casts and the LM head's). Compiled blocks: 232960 activation bytes, of which
    147456 are the blocks' bf16 weight copies their compiled forward saves for backward, and
    32768 in the cache (the eager LM head's cast only); the rest of the activations, 85504
    bytes, is fewer than eager's, and both together 265728 against eager's 330240. Each
    block's graph passed through the DDPOptimizer as one bucket, unsplit."""
    from torch._dynamo.backends import distributed

    buckets: list[int] = []
    original = distributed.DDPOptimizer.compile_fn

    def counting_compile_fn(self, gm, example_inputs, **configs):
        compiled = original(self, gm, example_inputs, **configs)
        buckets.append(len(self.buckets))
        return compiled

    eager = _predict([], capsys)
    monkeypatch.setattr(distributed.DDPOptimizer, "compile_fn", counting_compile_fn)
    compiled = _predict(["--compile"], capsys)

    assert "bf16-mixed" in compiled["description"]
    assert buckets and set(buckets) == {1}  # the DDP path was taken, and it split nothing
    assert _largest(eager, "activation") == 150016
    assert _largest(eager, "autocast_cache") == LAYERS * BLOCK_CASTS_BYTES + HEAD_CAST_BYTES == 180224
    assert _largest(compiled, "activation") == 232960
    assert _largest(compiled, "autocast_cache") == HEAD_CAST_BYTES == 32768
    assert 232960 - LAYERS * BLOCK_CASTS_BYTES == 85504 < 150016
    assert _largest(eager, "activation", "autocast_cache") == 330240
    assert _largest(compiled, "activation", "autocast_cache") == 265728
    assert eager["peak_allocated_bytes"] == compiled["peak_allocated_bytes"]
