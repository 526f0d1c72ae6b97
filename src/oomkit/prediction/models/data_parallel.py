"""Presets replicated with DDP: ``DistributedDataParallel`` around the whole model, rank 0's step.

``build_ddp_preset_step(name, options, mesh)`` runs inside a (fake) process group and
``FakeTensorMode`` (``oomkit.prediction.tracing.distributed.trace_distributed_step``): it builds
the preset as a single GPU does (every rank holds the whole model, its gradients and optimizer
state), and returns, besides the step, a ``setup`` that wraps the model in
``torch.nn.parallel.DistributedDataParallel`` under the recorder. DDP's constructor allocates
the gradient buckets (torch/csrc/distributed/c10d/reducer.cpp ``initialize_buckets``) and
broadcasts the parameters in flat buckets (torch/distributed/utils.py ``_sync_module_states``),
so both are part of the recording; the first backward fills buckets sized by parameter order
(DDP puts every parameter in one bucket at first, torch/nn/parallel/distributed.py
``_BucketCapacityConfig.compute_bucket_size_limits``), and the next forward rebuilds them in
gradient order, the first at most ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), the others
``bucket_cap_mb`` (25 MiB by default) (reducer.cpp ``rebuild_buckets``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from oomkit.errors import ConfigError
from oomkit.prediction.models.compiled_blocks import (
    BLOCKS_COMPILED,
    compile_model_blocks,
    compiled_loss,
    eager_outside_blocks,
    with_torchtitan_dynamo_config,
)
from oomkit.prediction.models.options import BuiltStep, StepOptions
from oomkit.prediction.models.parallel import _cast_floating
from oomkit.prediction.models.presets import _check_lengths, _runner, shaped_preset
from oomkit.prediction.models.selective_ac import apply_checkpointing
from oomkit.prediction.models.steps import ModelRunner, build_step, model_dtype

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DdpOptions", "DdpStep", "build_ddp_preset_step"]


@dataclasses.dataclass(frozen=True)
class DdpOptions:
    """The ``DistributedDataParallel`` arguments that change memory.

    Attributes:
        bucket_cap_mb: bucket size limit in MiB; ``None``: DDP's default, 25 MiB with a first
            bucket of ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB); given: every bucket, the
            first included, is capped at it (distributed.py ``_BucketCapacityConfig.create``).
        gradient_as_bucket_view: gradients are views into the buckets (no separate copy).
    """

    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = False

    def __post_init__(self) -> None:
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not cap > 0):
            raise ConfigError(f"the DDP bucket cap must be above 0 MiB; got {cap!r}")


@dataclasses.dataclass(frozen=True)
class DdpStep:
    """Rank 0's step and the DDP construction to run under the recorder before it.

    Attributes:
        built: the step (its ``track``: model, optimizer, inputs, as on one GPU).
        setup: wraps the model in ``DistributedDataParallel``; call it once before the step.
    """

    built: BuiltStep
    setup: Callable[[], None]


def build_ddp_preset_step(
    name: str, options: StepOptions, mesh: DeviceMesh, ddp: DdpOptions | None = None
) -> DdpStep:
    """Build preset ``name`` replicated over ``mesh`` with DDP; rank 0's training step.

    Args:
        name: a preset name (any family).
        options: the per-rank (local) batch, lengths, precision, optimizer, checkpointing.
        mesh: the 1-D mesh of the DDP replicas (``fake_process_group``'s).
        ddp: bucket size and ``gradient_as_bucket_view``; ``None``: DDP's defaults.

    Returns:
        The step and the DDP construction (see :class:`DdpStep`).

    Raises:
        UnknownPresetError: ``name`` is not a preset.
        ConfigError: a mode other than ``train``, or LoRA / quantized weights.
    """
    ddp = ddp or DdpOptions()
    if options.compile and ddp.bucket_cap_mb is not None:
        _check_ddp_optimizer_accepts(ddp.bucket_cap_mb)
    if options.mode != "train":
        raise ConfigError("--dp predicts training steps (DDP reduces gradients); use --mode train")
    if options.lora is not None or options.quantize is not None:
        raise ConfigError("--dp with LoRA or quantized weights is not modelled yet")
    if options.precision is None:  # a preset's own precision is fp32
        options = dataclasses.replace(options, precision="fp32")
    preset = shaped_preset(name, options)
    seq_len = options.seq_len or preset.default_seq_len or 0
    image_size = options.image_size or 224
    _check_lengths(preset, options, seq_len)
    device = mesh.device_type
    with torch.device(device):
        model = preset.build()
    dtype = model_dtype(options.precision)
    if dtype != torch.float32:
        _cast_floating(model, dtype)
    apply_checkpointing(
        model, options.checkpointing, train=options.mode == "train", as_torchtitan=True
    )
    if options.compile:  # after AC, before DDP (torchtitan parallelize_llama's order)
        compile_model_blocks(model, "--dp")
    wrapped: list[torch.nn.Module] = []

    def setup() -> None:
        from torch.nn.parallel import DistributedDataParallel

        wrapped.append(
            DistributedDataParallel(
                model,
                process_group=mesh.get_group(),
                bucket_cap_mb=ddp.bucket_cap_mb,
                gradient_as_bucket_view=ddp.gradient_as_bucket_view,
            )
        )

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not wrapped:
            raise RuntimeError("DdpStep.setup() must run before the step")
        return wrapped[0](*args, **kwargs)

    plain = _runner(preset, model)
    runner = ModelRunner(model, plain.task, plain.classes, forward=forward)
    built = build_step(
        runner,
        eager_outside_blocks(options),  # its blocks compiled, if any
        title=preset.title,
        seq_len=seq_len,
        image_size=image_size,
        device=device,
        loss_fn=compiled_loss(options),
    )
    if options.compile:  # the dynamo settings of torchtitan's apply_compile, for this step
        built = dataclasses.replace(built, step_fn=with_torchtitan_dynamo_config(built.step_fn))
    view = ", gradient_as_bucket_view" if ddp.gradient_as_bucket_view else ""
    cap = "25 MiB (first 1 MiB)" if ddp.bucket_cap_mb is None else f"{ddp.bucket_cap_mb:g} MiB"
    replicas = f"{mesh.size()} replica" + ("s" if mesh.size() != 1 else "")
    compiled = f", {BLOCKS_COMPILED}" if options.compile else ""
    description = f"{built.description}{compiled}, DDP over {replicas} (buckets {cap}{view}), rank 0"
    return DdpStep(dataclasses.replace(built, description=description), setup)


def _check_ddp_optimizer_accepts(bucket_cap_mb: float) -> None:
    """Refuse a bucket cap that the installed torch's DDPOptimizer refuses, as a GPU run would.

    A frame compiled inside DDP's forward goes through the DDPOptimizer (torch/_dynamo/
    convert_frame.py ``CatchErrorsWrapper.__call__``, ``optimize_ddp`` "ddp_optimizer", the
    default), made with DDP's ``bucket_bytes_cap`` and no first-bucket size, so its first bucket
    is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), and torch/_dynamo/backends/distributed.py
    ``DDPOptimizer.__init__`` asserts that it is at most the cap ("First bucket should be
    smaller/equal to other buckets"): the first compiled call fails with a cap under 1 MiB.
    The installed torch's own constructor is asked, with the cap DDP computes from
    ``bucket_cap_mb`` (torch/nn/parallel/distributed.py ``_BucketCapacityConfig.create``:
    ``int(bucket_cap_mb * _MB_TO_BYTES)``).

    Raises:
        ConfigError: the DDPOptimizer refuses the cap, naming the flag and the field.
    """
    from torch._dynamo.backends.distributed import DDPOptimizer

    cap_bytes = int(bucket_cap_mb * 1024 * 1024)
    try:
        DDPOptimizer(bucket_bytes_cap=cap_bytes, backend_compile_fn=lambda gm, inputs: gm)
    except AssertionError as exc:
        first_mb = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES / 2**20
        raise ConfigError(
            f"--bucket-cap-mb {bucket_cap_mb:g} (parallel.bucket_cap_mb) with --compile: "
            "torch's DDPOptimizer, which compiles each frame inside DDP's forward, keeps a "
            f"first bucket of {first_mb:g} MiB and refuses a smaller bucket cap (torch/_dynamo/"
            f"backends/distributed.py DDPOptimizer.__init__: {exc}), so this run fails on a "
            f"GPU too. Use --bucket-cap-mb {first_mb:g} or more, or drop --compile"
        ) from exc
