"""``torch.compile`` of each transformer block of a sharded preset, as torchtitan compiles it.

torchtitan compiles per block, not the whole model (torchtitan/distributed/compile.py
``apply_compile``: ``transformer_block.compile(backend=..., fullgraph=True)`` for every block of
``model.layers``), after tensor parallel and activation checkpointing and before FSDP / DDP
(torchtitan/models/llama3/parallelize.py ``parallelize_llama``'s order). ``Module.compile``
compiles the module's ``_call_impl`` in place (torch/nn/modules/module.py ``Module.compile``),
so the block keeps its identity and FSDP2's ``fully_shard`` applied afterwards registers its
hooks on the same module. FSDP2's hooks are not traced by dynamo (torch/_dynamo/config.py
``skip_fsdp_hooks = True``; torch/distributed/fsdp/_fully_shard/_fsdp_state.py
``_pre_forward`` / ``_post_forward`` are ``disable_if_config_true``): its all-gather, reshard
and reduce-scatter run eagerly around each compiled block, as on a GPU, and are recorded as the
eager FSDP2 step records them. What the compiled block allocates inside is recorded through the
compiled backend (``prediction/tracing/compile_backend.py``: the AOTAutograd partition run for
real, Inductor's fusion and buffer reuse emulated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from oomkit.errors import ConfigError
from oomkit.prediction.models.options import StepOptions
from oomkit.prediction.models.selective_ac import block_list

__all__ = [
    "BLOCKS_COMPILED",
    "compile_blocks",
    "compile_model_blocks",
    "compiled_loss",
    "with_torchtitan_dynamo_config",
    "eager_outside_blocks",
]

# The description's words for a sharded step compiled per block.
BLOCKS_COMPILED = "each block compiled (torchtitan apply_compile: fullgraph, Inductor)"


def compile_blocks(blocks: torch.nn.ModuleList) -> int:
    """``block.compile(fullgraph=True)`` for every block, in place; returns how many.

    Compiled lazily by dynamo at the first call, so the step must be recorded with compiled
    code recorded (``trace_distributed_step(..., compile=True)``), else it runs eagerly.

    Args:
        blocks: the transformer blocks (after TP and activation checkpointing, before FSDP).
    """
    for block in blocks:
        # torchtitan apply_compile: backend "inductor" (CompileConfig.backend's default).
        block.compile(backend="inductor", fullgraph=True)
    return len(blocks)


def compile_model_blocks(model: torch.nn.Module, flag: str) -> int:
    """:func:`compile_blocks` on a preset's block list (``selective_ac.BLOCK_LISTS``): after
    ``apply_checkpointing(..., as_torchtitan=True)``, the checkpoint wrappers (full or
    selective-op), as torchtitan compiles them.

    Raises:
        ConfigError: a model whose blocks are not known, naming ``flag`` (``--dp``).
    """
    blocks = block_list(model)
    if blocks is None:
        raise ConfigError(
            f"--compile with {flag} compiles each block of a built-in preset (torchtitan's "
            f"apply_compile); {type(model).__name__} has no known block list. Drop --compile"
        )
    return compile_blocks(blocks)


def compiled_loss(options: StepOptions) -> torch.nn.Module | None:
    """The training loss compiled, as torchtitan compiles it with the blocks
    (torchtitan/components/loss.py ``BaseLoss._maybe_compile``: ``torch.compile(self.fn)`` when
    ``"loss"`` is in ``CompileConfig.components``, which it is by default with ``"model"``);
    ``None`` (the step's eager ``CrossEntropyLoss``) without ``--compile``."""
    if not options.compile or options.mode != "train":
        return None
    # An OptimizedModule: still a module, so the recorder names what it allocates by it.
    return torch.compile(torch.nn.CrossEntropyLoss(), backend="inductor")  # type: ignore[return-value]


def with_torchtitan_dynamo_config(step_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``step_fn`` run with the dynamo settings torchtitan's ``apply_compile`` sets, for the
    step only (torchtitan sets them process-wide): ``capture_scalar_outputs = True`` and
    ``skip_fwd_side_effects_in_bwd_under_checkpoint = True`` (a compiled block under activation
    checkpointing: forward side effects are not replayed in the recompute, so the checkpoint
    higher-order op accepts them)."""

    def step(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(
            capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True
        ):
            return step_fn(*args, **kwargs)

    return step


def eager_outside_blocks(options: StepOptions) -> StepOptions:
    """``options`` for the step built around compiled blocks: the rest of the model (embedding,
    final norm, LM head) runs eagerly, as torchtitan's per-block compile leaves it, and the loss
    is compiled on its own (:func:`compiled_loss`); ``build_step`` would otherwise wrap the
    whole forward in ``torch.compile``."""
    return dataclasses.replace(options, compile=False) if options.compile else options
