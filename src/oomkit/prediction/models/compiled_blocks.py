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
from oomkit.prediction.models.selective_ac import BLOCK_LISTS

__all__ = [
    "BLOCKS_COMPILED",
    "DDP_COMPILE_REFUSAL",
    "check_compiled_checkpointing",
    "compile_blocks",
    "compile_model_blocks",
    "compiled_loss",
    "with_torchtitan_dynamo_config",
    "eager_outside_blocks",
]

# The description's words for a sharded step compiled per block.
BLOCKS_COMPILED = "each block compiled (torchtitan apply_compile: fullgraph, Inductor)"

# Why DDP (--dp alone) with --compile is refused. A frame compiled inside DDP's forward goes
# through dynamo's DDPOptimizer (torch/_dynamo/backends/distributed.py DDPOptimizer.compile_fn,
# torch._dynamo.config.optimize_ddp = True by default), which splits each graph at DDP's bucket
# boundaries and runs the pieces on its own fake tensors while compiling; on the fake process
# group that compile-time run meets the recording's fake mode ("Mixing fake modes") and a
# data-dependent read, so the split graphs cannot be recorded as a GPU runs them.
DDP_COMPILE_REFUSAL = (
    "--compile with --dp alone (DDP) is not modelled: dynamo compiles inside DDP through its "
    "DDPOptimizer (torch/_dynamo/backends/distributed.py), which splits each compiled graph at "
    "the gradient buckets, and that split does not run on oomkit's fake process group. "
    "torchtitan replicates with HSDP instead (--dp R --fsdp S, which compiles per block), or "
    "predict DDP eagerly (drop --compile)"
)


def check_compiled_checkpointing(options: StepOptions) -> None:
    """Refuse selective-op checkpointing inside blocks compiled under tensor parallel.

    With TP, AOTAutograd's forward of a compiled selective-checkpointed block returns the TP
    device mesh among the values it saves for backward, and its ``CompiledFunction`` asserts
    that those are all tensors
    (torch/_functorch/_aot_autograd/runtime_wrappers.py ``_AutogradSavedState.save_from_forward``:
    "expected all tensors_saved_with_vc_check to be Tensors"), so the step does not run. FSDP2
    and HSDP without TP record (the compiled checkpoint's saved RNG state is host memory:
    ``prediction/tracing/fake_storages.py`` ``detach_saved``); ``full`` records with TP.

    Raises:
        ConfigError: ``--compile`` with ``--checkpointing selective-op`` and ``--tp``.
    """
    if options.compile and options.checkpointing == "selective-op" and options.mode == "train":
        raise ConfigError(
            "--compile with --checkpointing selective-op is not modelled with --tp yet "
            "(AOTAutograd's compiled checkpointed block saves the TP device mesh for backward "
            "and refuses it: torch/_functorch/_aot_autograd/runtime_wrappers.py "
            "save_from_forward); use --checkpointing full, or drop --compile or --tp"
        )


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
    """:func:`compile_blocks` on a preset's block list (``selective_ac.BLOCK_LISTS``).

    Raises:
        ConfigError: a model whose blocks are not known, naming ``flag`` (``--dp``).
    """
    attribute = BLOCK_LISTS.get(type(model).__name__)
    blocks = getattr(model, attribute, None) if attribute is not None else None
    if not isinstance(blocks, torch.nn.ModuleList):
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
