"""Activation checkpointing of a preset's blocks: full, or torchtitan's selective per-op policy.

``selective-op`` is run for real, as torchtitan applies it
(torchtitan/models/llama3/infra/parallelize.py ``_apply_ac_to_transformer_block`` and
torchtitan/distributed/activation_checkpoint.py ``_apply_op_sac``): every transformer block is
wrapped in torch's ``checkpoint_wrapper`` (``use_reentrant=False``, ``preserve_rng_state=False``)
with a ``context_fn`` made by ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
Its policy saves the outputs of the ops in :data:`SAVE_OPS` (matmuls, the SDPA kernels,
reduce-scatter, ``max``) except every second ``aten.mm`` of the block, and recomputes every
other op in backward. The memory follows from what torch's own SAC dispatch mode keeps alive
(torch/utils/checkpoint.py ``_CachingTorchDispatchMode``: a MUST_SAVE output is stored, detached,
until the recomputation takes it back), so the recorder sees it as it sees any other tensor.

Where it may differ: the policy sees the ops the recorder dispatches; torchtitan's Llama has no
biases, so its projections are ``aten.mm``, while GPT-2's biased ``nn.Linear`` dispatches
``aten.addmm``, which the policy (as torchtitan's) does not save. ``full`` keeps the models'
own ``checkpoint(block, ...)`` call, with torch's default ``preserve_rng_state=True``, which
stashes host RNG state only (no device memory), except in the sharded steps
(FSDP / TP / DDP, which follow torchtitan's ``parallelize``): there
:func:`apply_checkpointing` (``as_torchtitan``) wraps each block as torchtitan's ``FullAC`` does
(``early_stop=False``: the whole block is recomputed), so with ``--compile`` the compiled unit
is the checkpointed block and its recompute runs in the compiled backward, as in torchtitan.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from oomkit.errors import ConfigError
from oomkit.prediction.models.options import Checkpointing

__all__ = [
    "BLOCK_LISTS",
    "SAVE_OPS",
    "apply_checkpointing",
    "block_list",
    "save_ops",
    "selective_op_context",
    "selective_op_policy",
]

# The attribute of each preset model class holding the blocks its forward loop checkpoints
# (prediction/models: gpt2.py GPT2.h, llama.py Llama.layers, bert.py Bert.layer, vit.py
# ViT.layers, resnet.py ResNet.blocks).
BLOCK_LISTS: dict[str, str] = {
    "GPT2": "h",
    "Llama": "layers",
    "Bert": "layer",
    "ViT": "layers",
    "ResNet": "blocks",
}

# torchtitan/models/llama3/infra/parallelize.py ``_op_sac_save_list``: the ops whose outputs
# selective op AC saves (by name; ops this torch lacks are skipped by :func:`save_ops`).
SAVE_OPS: tuple[str, ...] = (
    "aten.mm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    # torchtitan: "for low precision training, it's useful to always save the result of max"
    "aten.max.default",
)


def save_ops() -> frozenset[Any]:
    """The :data:`SAVE_OPS` overloads this torch has."""
    found = []
    for name in SAVE_OPS:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


def selective_op_policy(
    counts: dict[str, int], saved: frozenset[Any] | None = None
) -> Callable[..., Any]:
    """torchtitan's per-op policy over one checkpointed call's ``counts`` of ``aten.mm``.

    _apply_op_sac ``_custom_policy``: forward and recomputation count their ``mm`` calls
    separately; an op of ``saved`` is MUST_SAVE unless it is an even-numbered ``mm`` ("saves
    output of all compute ops, except every second mm"); everything else PREFER_RECOMPUTE.
    (Its first rule, MUST_SAVE for a CUDA-to-CPU ``_to_copy`` (offloading), never applies here:
    the presets copy nothing to the host.)
    """
    from torch.utils.checkpoint import CheckpointPolicy

    ops = save_ops() if saved is None else saved
    mm = torch.ops.aten.mm.default

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
        if func == mm:
            counts[key] += 1
        to_save = func in ops and not (func == mm and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_op_context() -> Any:
    """A ``context_fn`` for ``torch.utils.checkpoint``: fresh mm counts per checkpointed call
    (torchtitan ``selective_checkpointing_context_fn``)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(selective_op_policy(defaultdict(int)))


def block_list(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The preset's transformer blocks (its :data:`BLOCK_LISTS` list), or None where the
    model's class has none."""
    attribute = BLOCK_LISTS.get(type(model).__name__)
    blocks = getattr(model, attribute, None) if attribute is not None else None
    return blocks if isinstance(blocks, torch.nn.ModuleList) else None


def apply_checkpointing(
    model: torch.nn.Module, mode: Checkpointing, *, train: bool = True, as_torchtitan: bool = False
) -> None:
    """Make ``model`` (a preset) checkpoint its blocks as ``mode`` says, before any sharding.

    ``full`` sets the flag every preset's forward reads (``checkpoint(block, ...)`` per block),
    or with ``as_torchtitan`` (the sharded steps, which follow torchtitan's ``parallelize``)
    wraps each block as torchtitan 0.3.0 does (torchtitan/distributed/activation_checkpoint.py
    ``FullAC._wrap_block``: ``ptd_checkpoint_wrapper`` with ``preserve_rng_state`` its config's
    default ``True`` and ``early_stop=False``). ``early_stop=False`` recomputes the whole block
    in backward, where torch's default stops at the last tensor backward needs
    (torch/utils/checkpoint.py ``checkpoint``'s ``early_stop``), so the block's last ops'
    outputs are made again for a moment; with ``--compile`` the wrapped block is what is
    compiled (``apply_compile`` after ``apply_ac``), so dynamo traces the checkpoint as a
    higher-order op and the recompute runs inside the compiled backward.
    ``selective-op`` replaces each block of its :data:`BLOCK_LISTS` list by torch's
    ``checkpoint_wrapper`` with :func:`selective_op_context` (torchtitan ``apply_ac``), so FSDP2
    applied afterwards shards the wrappers, as torchtitan's order (AC, then FSDP) does. A step
    that does not train (``train=False``) is left as it is: checkpointing only changes what
    backward needs (the presets' own ``full`` path checks ``self.training`` likewise).

    Raises:
        ConfigError: ``selective-op`` on a model whose blocks are not known.
    """
    if mode == "none" or not train:
        return
    blocks = block_list(model)
    if mode == "full":
        if as_torchtitan and blocks is not None:
            _wrap_each(blocks, preserve_rng_state=True, early_stop=False)
        else:
            model.checkpointing = True  # type: ignore[assignment]  # every preset reads this flag
        return
    if blocks is None:
        raise ConfigError(
            f"--checkpointing selective-op wraps the blocks of the built-in presets; "
            f"{type(model).__name__} has no known block list. Use --checkpointing full"
        )
    _wrap_each(blocks, context_fn=selective_op_context, preserve_rng_state=False)


def _wrap_each(blocks: torch.nn.ModuleList, **checkpoint_kwargs: Any) -> None:
    """Each block replaced by torch's ``checkpoint_wrapper`` (non-reentrant) around it, with
    ``checkpoint_kwargs`` for its ``torch.utils.checkpoint.checkpoint`` calls."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for index, block in enumerate(blocks):
        blocks[index] = checkpoint_wrapper(block, **checkpoint_kwargs)
