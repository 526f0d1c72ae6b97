"""Presets sharded with FSDP2 as torchtitan shards them: one unit per transformer block + root.

``build_fsdp_preset_step(name, options, mesh)`` runs inside a (fake) process group and
``FakeTensorMode`` (``oomkit.prediction.tracing.distributed.trace_distributed_step``): it builds
the preset on the mesh's device, calls ``fully_shard`` on every transformer block and then on
the root (torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``), and makes the usual
step around it, so the optimizer holds the sharded parameters.

Precision as torchtitan does it: ``bf16-mixed`` keeps fp32 parameters and optimizer state and
gives FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (torchtitan's
``mixed_precision_param = "bfloat16"``, ``mixed_precision_reduce = "float32"``), without
``torch.autocast``; ``fp32`` and ``bf16`` shard the parameters as they are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from oomkit.errors import ConfigError
from oomkit.prediction.models.compiled_blocks import (
    BLOCKS_COMPILED,
    compile_model_blocks,
    compiled_loss,
    eager_outside_blocks,
    with_torchtitan_dynamo_config,
)
from oomkit.prediction.models.float8 import Float8Options, convert_to_float8, float8_words
from oomkit.prediction.models.options import BuiltStep, StepOptions
from oomkit.prediction.models.presets import _check_lengths, _runner, shaped_preset
from oomkit.prediction.models.selective_ac import apply_checkpointing
from oomkit.prediction.models.steps import _describe, build_step, model_dtype

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from oomkit.prediction.models.presets import ModelPreset

__all__ = [
    "FSDP_FAMILIES",
    "build_fsdp_preset_step",
    "fsdp_words",
    "refuse_unsharded_modes",
    "shard_blocks_and_root",
]

# The preset families whose blocks are known: the ModuleList attribute holding them.
FSDP_FAMILIES: dict[str, str] = {"GPT2": "h", "Llama": "layers"}


def fsdp_words(mesh: DeviceMesh) -> str:
    """What ``fully_shard`` on ``mesh`` does, in words: ``"FSDP2 over 8 ranks"``, or for a 2-D
    mesh ``"HSDP: FSDP2 over 8 ranks x 4 replicas"`` (torch/distributed/fsdp/_fully_shard/
    _fully_shard.py ``fully_shard``: a 2-D mesh replicates over dim 0 and shards over dim 1)."""
    if mesh.ndim == 2:
        return f"HSDP: FSDP2 over {mesh.size(1)} ranks x {mesh.size(0)} replicas"
    return f"FSDP2 over {mesh.size()} ranks"


def shard_blocks_and_root(
    model: torch.nn.Module, blocks: torch.nn.ModuleList, mesh: DeviceMesh, precision: str
) -> int:
    """``fully_shard`` each block, then the root; returns the number of FSDP units.

    Args:
        model: the root module.
        blocks: its transformer blocks.
        mesh: the 1-D mesh to shard over, or a 2-D (replicas, shards) mesh for HSDP.
        precision: a ``StepOptions.precision``; ``bf16-mixed`` gets a MixedPrecisionPolicy.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if precision == "bf16-mixed":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return len(blocks) + 1


def _cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for fake tensors: floating parameters and buffers, tied ones once.

    ``Module._apply`` swaps a FakeTensor parameter in place (torch/nn/modules/module.py
    ``_apply``: ``isinstance(param, FakeTensor)`` -> ``swap_tensors``), which refuses a
    parameter that two modules hold (GPT-2's tied ``wte`` / ``lm_head``); so each distinct
    parameter is cast once and set on every module that holds it.
    """
    cast_params: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_floating_point():
                continue
            new = cast_params.get(id(param))
            if new is None:
                new = torch.nn.Parameter(param.detach().to(dtype), param.requires_grad)
                cast_params[id(param)] = new
            module._parameters[name] = new
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)


def refuse_unsharded_modes(options: StepOptions, flag: str) -> None:
    """What no sharded layout models yet: fp16-mixed (it needs torch's ``ShardedGradScaler``)
    and generation.

    Raises:
        ConfigError: naming ``flag`` (``--fsdp``, ``--tp``) and what to use instead.
    """
    if options.precision == "fp16-mixed":
        raise ConfigError(
            f"{flag} with fp16-mixed needs ShardedGradScaler, which oomkit does not model; use "
            "--precision bf16-mixed (FSDP2's MixedPrecisionPolicy), bf16 or fp32"
        )
    if options.mode == "generate":
        raise ConfigError(f"{flag} predicts train and inference steps; use --mode train|inference")


def build_fsdp_preset_step(
    name: str, options: StepOptions, mesh: DeviceMesh, float8: Float8Options | None = None
) -> BuiltStep:
    """Build preset ``name`` sharded over ``mesh`` and return rank 0's step for ``options``.

    Args:
        name: a GPT-2 or Llama preset.
        options: the per-rank (local) batch, lengths, precision, optimizer, checkpointing, mode.
        mesh: the mesh FSDP2 shards over (``fake_process_group``'s); a 2-D ``("dp", "fsdp")``
            mesh is HSDP: FSDP2 over ``fsdp`` ranks, replicated ``dp`` times.
        float8: train the linear layers in float8 (torchao, ``models/float8.py``).

    Returns:
        The step, with the sharded model, optimizer and inputs to track.

    Raises:
        UnknownPresetError: ``name`` is not a preset.
        ConfigError: a preset FSDP2 is not modelled for, ``fp16-mixed`` or ``generate``.
    """
    if "tp" in (mesh.mesh_dim_names or ()):  # TP first, then FSDP on mesh["fsdp"] (torchtitan)
        from oomkit.prediction.models.tensor_parallel import build_tp_preset_step

        return build_tp_preset_step(name, options, mesh, float8)
    preset = shaped_preset(name, options)
    family = type(preset.shape).__name__.removesuffix("Shape")
    attribute = FSDP_FAMILIES.get(family)
    if attribute is None:
        raise ConfigError(
            f"--fsdp is modelled for the GPT-2 and Llama presets; {name} is {preset.title}. "
            "Example: oomkit predict llama-8b --fsdp 8"
        )
    if options.max_grad_norm is not None or options.checkpoint_reentrant:
        # FSDP2 clips DTensors (torch.nn.utils.clip_grad_norm_ over sharded gradients): not
        # modelled yet. Gradient accumulation is: build_step runs grad_accum forward+backward
        # passes and FSDP2 reduce-scatters in each backward, as torchtitan's train_step does
        # (it never calls set_requires_gradient_sync(False) between micro-batches); from the
        # second on, foreach_reduce adds the new shard into sharded_param.grad
        # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce).
        raise ConfigError(
            "--fsdp does not model gradient clipping or reentrant checkpointing yet; drop "
            "max_grad_norm (set it to 0) and use_reentrant"
        )
    refuse_unsharded_modes(options, "--fsdp")
    seq_len = options.seq_len or preset.default_seq_len or 0
    _check_lengths(preset, options, seq_len)
    device = mesh.device_type
    with torch.device(device):
        model = preset.build()
    if options.precision == "bf16":
        _cast_floating(model, model_dtype(options.precision))
    where = ""
    if float8 is not None:  # torchtitan converts the model before parallelize
        where = f"{float8_words(float8, len(convert_to_float8(model, float8)))}, "
    # Before FSDP2, as torchtitan applies AC before fully_shard.
    apply_checkpointing(
        model, options.checkpointing, train=options.mode == "train", as_torchtitan=True
    )
    if options.compile:  # after AC, before FSDP (torchtitan parallelize_llama's order)
        compile_model_blocks(model, "--fsdp")
        where += f"{BLOCKS_COMPILED}, "
    # None: the preset's own precision, fp32 (StepOptions.precision).
    precision = options.precision or "fp32"
    units = shard_blocks_and_root(model, getattr(model, attribute), mesh, precision)
    where += f"{fsdp_words(mesh)} ({units} units: per block + root), rank 0"
    return _sharded_step(preset, model, options, seq_len, device, fsdp_casts=True, where=where)


def _sharded_step(
    preset: ModelPreset,
    model: torch.nn.Module,
    options: StepOptions,
    seq_len: int,
    device: str,
    *,
    fsdp_casts: bool,
    where: str,
    compile_loss: bool = True,
) -> BuiltStep:
    """The preset's usual step around its sharded ``model`` (FSDP2, TP or both), described as
    the preset at ``options``, then ``where`` (the layout and the rank).

    Args:
        fsdp_casts: FSDP2 shards the model: with ``bf16-mixed`` its ``MixedPrecisionPolicy``
            casts, so the step runs without autocast (torchtitan's ``maybe_enable_amp``).
        compile_loss: with ``--compile``, compile the loss too (``compiled_loss``).
    """
    step_options = eager_outside_blocks(options)  # its blocks compiled, if any
    if fsdp_casts and options.precision == "bf16-mixed":
        step_options = dataclasses.replace(step_options, precision="fp32")
    built = build_step(
        _runner(preset, model),
        step_options,
        title=preset.title,
        seq_len=seq_len,
        image_size=224,
        device=device,
        loss_fn=compiled_loss(options) if compile_loss else None,
    )
    description = f"{_describe(preset.title, options, preset.task, seq_len, 224)}, {where}"
    if options.compile:  # the dynamo settings of torchtitan's apply_compile, for this step
        built = dataclasses.replace(built, step_fn=with_torchtitan_dynamo_config(built.step_fn))
    return dataclasses.replace(built, description=description)
