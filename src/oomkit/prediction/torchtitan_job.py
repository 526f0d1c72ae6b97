"""A torchtitan job, named as its launcher names it, built and recorded as its trainer runs it.

``torchtitan/train.py`` parses ``--module M --config C [--section.field value ...]`` with
``ConfigManager.parse_args`` (torchtitan/config/manager.py: the registry function ``C`` of
``torchtitan.models.M.config_registry`` gives a ``Trainer.Config``; tyro applies the overrides),
then ``Trainer(config)`` builds the run and ``train_step`` runs it. ``torchtitan.trainer``
cannot be constructed without a GPU, data and a tokenizer, so :func:`build_torchtitan_step`
follows ``Trainer.__init__`` and ``Trainer.train_step`` step by step (each step cites the
trainer.py lines of torchtitan 0.3.0 it mirrors) and calls torchtitan's own function at each
one: ``ParallelDims.from_config`` and ``build_mesh``, the model spec's config ``build`` on
``meta``, its ``parallelize_fn`` (TP, activation checkpointing, FSDP2 with its
``reshard_after_forward`` policy), ``to_empty`` + ``init_weights``, the loss
(``config.loss.build``, the chunked loss wired to the LM head), ``config.optimizer.build`` and
``clip_grad_norm_``. The step runs on oomkit's fake process group of the job's world size
(``prediction/tracing/distributed.py``), as rank 0 or the rank asked for.

What needs a GPU is emulated or stated: the meshes are built on the fake group's ``cpu`` device
(``_torchtitan_env.py``); weight initialisation draws without the rejection loop that reads a
value (``_torchtitan_init.py``); FlexAttention's Triton kernels are not emulated, so the attention
is torchtitan's ``ScaledDotProductAttention`` unless the job asks otherwise (``attention``);
CUDA graphs (torchtitan's default) are not captured: the step is recorded eagerly and says so.
torchtitan's quantization converters (Float8 linear training through torchao) ask the target
GPU's compute capability, not this host's. PP runs torchtitan's ``pipelining_fn`` and schedule
(``_torchtitan_pipeline.py``); CP its ``apply_cp_to_forward`` and input sharding
(``_torchtitan_cp.py``); ``compile.enable``, its ``apply_compile``, through the compiled
backend, with async TP (``compile.enable_async_tensor_parallel``) as Inductor runs it
(``prediction/tracing/async_tp.py``). Expert parallel is refused here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from oomkit.errors import ConfigError, OomkitError
from oomkit.prediction import _torchtitan_cp as context_parallel
from oomkit.prediction import _torchtitan_pipeline as pipelined
from oomkit.prediction._torchtitan_cp_compile import cpu_sdpa_as_cuda
from oomkit.prediction._torchtitan_env import (
    cuda_capability,
    import_torchtitan,
    meshes_on_the_host,
    quiet_torchtitan_logs,
    torchtitan_version,
)
from oomkit.prediction._torchtitan_init import values_free_init

if TYPE_CHECKING:
    from oomkit.core.target import Target
    from oomkit.prediction.tracing.recording import TraceRecording

__all__ = [
    "TorchtitanJob",
    "TorchtitanRun",
    "build_torchtitan_step",
    "load_job_config",
    "parse_job_name",
    "record_torchtitan_job",
]

Attention = Literal["sdpa", "configured"]
Loss = Literal["configured", "cross_entropy"]
PipelineOutputs = Literal["dropped", "merged"]


@dataclass(frozen=True)
class TorchtitanJob:
    """A torchtitan job as its launcher takes it, and the rank to record.

    Attributes:
        module: torchtitan's ``--module`` (``"llama3"``).
        config: its ``--config``, a function of the module's config registry
            (``"llama3_8b"``; ``"8b"`` also finds ``llama3_8b``).
        overrides: the launcher's command-line overrides, as typed
            (``("--parallelism.tensor_parallel_degree", "2")``).
        world_size: ranks in the job (torchrun's ``WORLD_SIZE``).
        rank: the rank to record.
        attention: ``"sdpa"`` records every attention layer with torchtitan's
            ``ScaledDotProductAttention`` (causal); ``"configured"`` keeps the config's, refused
            where it is FlexAttention or varlen (their kernels are not emulated).
        loss: ``"configured"`` keeps the config's loss (torchtitan 0.3.0's chunked loss for
            Llama); ``"cross_entropy"`` uses its plain ``CrossEntropyLoss`` over the full
            logits, as ``llama3_debugmodel_ce_loss`` does and torchtitan ran before 0.3.
        pipeline_outputs: ``"dropped"`` steps the pipeline schedule as torchtitan 0.3.0 does
            (``return_outputs=False``: no stage keeps its outputs); ``"merged"`` as torchtitan
            before 0.3 did (9dec370 train.py: ``pp_schedule.step(target=labels,
            losses=losses)``, whose torch always returned the last stage's outputs): the last
            stage keeps every micro-batch's output until the step ends, then merges them
            (torch's ``return_outputs=True``; the trainer drops the result). Pipeline jobs only.
    """

    module: str
    config: str
    overrides: tuple[str, ...] = ()
    world_size: int = 1
    rank: int = 0
    attention: Attention = "sdpa"
    loss: Loss = "configured"
    pipeline_outputs: PipelineOutputs = "dropped"

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ConfigError(
                f"a torchtitan job needs a world size of at least 1 and a rank in [0, world "
                f"size); got world size {self.world_size}, rank {self.rank}. Example: "
                "--world-size 8 --rank 0"
            )
        if self.pipeline_outputs not in ("dropped", "merged"):
            raise ConfigError(f"pipeline_outputs is 'dropped' or 'merged'; got {self.pipeline_outputs!r}")


@dataclass(frozen=True)
class TorchtitanRun:
    """What the built run is, for the prediction's description and checks.

    Attributes:
        description: the run in words.
        parameters: the model's parameter count (``get_nparams_and_flops``).
        local_batch_size: sequences per data-parallel rank per micro-step.
        seq_len: tokens per sequence.
        gradient_accumulation_steps: micro-steps per optimizer step.
        layout: the mesh degrees, ``{"dp_shard": 8, "tp": 1, ...}``.
        notes: what the recording leaves out or changed, for the warnings.
    """

    description: str
    parameters: int
    local_batch_size: int
    seq_len: int
    gradient_accumulation_steps: int
    layout: dict[str, int]
    notes: tuple[str, ...]


def parse_job_name(text: str) -> tuple[str, str]:
    """``"MODULE:CONFIG"`` -> ``(module, config)``.

    Raises:
        ConfigError: not two non-empty names around one colon.
    """
    module, sep, config = text.partition(":")
    if not sep or not module.strip() or not config.strip() or ":" in config:
        raise ConfigError(
            f"--torchtitan takes MODULE:CONFIG (torchtitan's --module and --config); got "
            f"{text!r}. Example: --torchtitan llama3:llama3_8b"
        )
    return module.strip(), config.strip()


def load_job_config(job: TorchtitanJob, *, capability: tuple[int, int] | None = None) -> Any:
    """The job's ``Trainer.Config``, parsed by torchtitan's own ``ConfigManager``.

    Args:
        job: the job.
        capability: the target GPU's compute capability, which torchtitan's quantization
            converters ask (``None``: torchtitan asks this host's CUDA, which a host without a
            GPU refuses for Float8).

    Raises:
        ConfigError: an unknown module or config, or an override torchtitan rejects (with
            torchtitan's own words).
    """
    config_module = import_torchtitan("torchtitan.config")
    registry = _config_registry(job.module)
    name = _config_function(registry, job)
    args = ["--module", job.module, "--config", name, *job.overrides]
    if any(arg in ("-h", "--help") for arg in job.overrides):
        raise ConfigError(
            "--help is not a torchtitan override here: run `python -m torchtitan.config.manager "
            f"--module {job.module} --config {name} --help` to list the fields"
        )
    err = io.StringIO()
    asked: contextlib.AbstractContextManager[Any] = (
        contextlib.nullcontext() if capability is None else cuda_capability(capability)
    )
    try:
        with (
            asked,
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
            quiet_torchtitan_logs(),
        ):
            return config_module.ConfigManager().parse_args(args)
    except SystemExit:  # tyro prints its error and exits
        raise ConfigError(
            f"torchtitan rejected the overrides {' '.join(job.overrides)!r}: "
            f"{_tyro_words(err.getvalue())} Overrides are `--section.field value`, e.g. "
            "--training.local_batch_size 2 --parallelism.tensor_parallel_degree 2"
        ) from None
    except (ValueError, TypeError, AssertionError) as exc:
        raise ConfigError(
            f"torchtitan refused the job {job.module}:{name} with these overrides: {exc}"
        ) from exc


def _config_registry(module: str) -> Any:
    """torchtitan's ``config_registry`` of ``module`` (as ConfigManager._load_config finds it:
    a model module's, or a fully qualified one's, ``module.config_registry`` else ``module``)."""
    models = import_torchtitan("torchtitan.models")
    supported = sorted(getattr(models, "_supported_models", ()))
    if module not in supported:  # a user's own registry (my_pkg.configs), as _load_config
        for candidate in (f"{module}.config_registry", module):
            with contextlib.suppress(ImportError):
                return import_torchtitan(candidate)
        raise ConfigError(
            f"torchtitan has no model module {module!r} (its modules: {', '.join(supported)}), "
            f"and neither {module} nor {module}.config_registry imports here (a module of your "
            "own must be on PYTHONPATH, as torchtitan's launcher imports it). Example: "
            "--torchtitan llama3:llama3_8b"
        )
    try:
        return import_torchtitan(f"torchtitan.models.{module}.config_registry")
    except ImportError as exc:
        raise ConfigError(
            f"torchtitan's {module} config registry does not import here ({exc}); install what "
            "it needs, or pick another module"
        ) from exc


def _config_function(registry: Any, job: TorchtitanJob) -> str:
    """The registry function the job names: ``config`` itself, else ``module_config``."""
    available = sorted(
        name for name, value in vars(registry).items()
        # a config is a function the registry defines (not a name it imports, like `cast`)
        if not name.startswith("_") and callable(value) and isinstance(value, types.FunctionType)
        and value.__module__ == registry.__name__
    )
    for name in (job.config, f"{job.module}_{job.config}", f"{job.module}_{job.config.lower()}"):
        if name in available:
            return name
    raise ConfigError(
        f"torchtitan's {job.module} config registry has no config {job.config!r}; its configs: "
        f"{', '.join(available)}. Example: --torchtitan {job.module}:{available[0] if available else 'NAME'}"
    )


def _tyro_words(text: str) -> str:
    """tyro's error box reduced to its lines of words."""
    keep = []
    for line in text.splitlines():
        words = line.strip().strip("│╭╰─┬┴╮╯- ").strip()
        if words and not words.startswith(("usage:", "For full helptext")):
            keep.append(words)
    return " ".join(keep[:6]) or "(tyro gave no reason)"


@dataclass
class _Built:
    """What ``build`` made, filled when it runs inside the fake process group."""

    run: TorchtitanRun | None = None


def build_torchtitan_step(
    job: TorchtitanJob, config: Any
) -> tuple[Callable[[Any], tuple[Any, ...]], _Built]:
    """``build(mesh)`` for ``trace_distributed_step``: the job's run as ``Trainer.__init__``
    builds it, and ``train_step`` as its step; the second value is filled with the run's record
    when ``build`` has run.

    Raises:
        ConfigError: a part of the job that is not modelled (expert parallel, CPU offload,
            FlexAttention kept), or one torchtitan refuses.
    """
    import torch

    _refuse_unmodelled(config)
    notes = list(_attention(job, config))
    if job.loss == "cross_entropy":
        # config_registry.py llama3_debugmodel_ce_loss: the plain loss over the full logits
        loss_module = import_torchtitan("torchtitan.components.loss")
        utils = import_torchtitan("torchtitan.models.common.config_utils")
        config.loss = loss_module.CrossEntropyLoss.Config(
            global_vocab_size=utils.decoder_vocab_size(config.model_spec)
        )
    built = _Built()
    config_module = import_torchtitan("torchtitan.config")
    parallel_dims_module = import_torchtitan("torchtitan.distributed.parallel_dims")
    dist_utils = import_torchtitan("torchtitan.distributed.utils")
    loss_module = import_torchtitan("torchtitan.components.loss")
    tools = import_torchtitan("torchtitan.tools.utils")

    def build(_oomkit_mesh: Any) -> tuple[Any, ...]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        training, parallelism = config.training, config.parallelism
        # trainer.py:304 init_distributed -> :663 ParallelDims.from_config(parallelism, world)
        try:
            parallel_dims = parallel_dims_module.ParallelDims.from_config(
                parallelism, job.world_size
            )
            with unset_fake_temporarily():  # a mesh is host bookkeeping (init_device_mesh)
                parallel_dims.build_mesh()
        except (ValueError, AssertionError, RuntimeError) as exc:
            raise ConfigError(
                f"torchtitan refused the parallel layout on {job.world_size} ranks: {exc}. The "
                "product of the parallelism degrees must equal the world size (--world-size)"
            ) from exc
        # trainer.py:307-317: the sequence length divides by TP (sequence parallel) and 2 x CP
        context_parallel.check_seq_len(
            parallel_dims, training.seq_len, parallelism.enable_sequence_parallel
        )
        dist_utils.set_spmd_backend(parallelism.spmd_backend)  # trainer.py:319
        if parallel_dims.dp_enabled:  # trainer.py:324-328
            batch_degree = parallel_dims.get_mesh("batch").size()
        else:
            batch_degree = 1
        model_spec = config.model_spec
        model_config = model_spec.model
        model_config.update_from_config(config=config)  # trainer.py:347
        if config.override.imports:  # trainer.py:357-358
            import_torchtitan("torchtitan.config.override").apply_overrides(config.override, config)
        # trainer.py:364-367: the model on meta, in training.dtype
        with torch.device("meta"), tools.set_default_dtype(
            config_module.TORCH_DTYPE_MAP[training.dtype]
        ):
            model = model_config.build()
        model.verify_module_protocol()  # trainer.py:375
        parameters, _ = model_config.get_nparams_and_flops(model, training.seq_len)
        loss_fn = config.loss.build(compile_config=config.compile)  # trainer.py:410
        # trainer.py:415-436: global batch and gradient accumulation
        global_batch = training.global_batch_size
        if global_batch < 0:
            global_batch = training.local_batch_size * batch_degree
        if global_batch % (training.local_batch_size * batch_degree):
            raise ConfigError(
                f"torchtitan refuses training.global_batch_size {global_batch}: it must be a "
                f"multiple of local_batch_size x data-parallel degree "
                f"({training.local_batch_size} x {batch_degree})"
            )
        accumulation = global_batch // (training.local_batch_size * batch_degree)
        chunked = isinstance(loss_fn, loss_module.ChunkedLossWrapper)
        pipeline: tuple[Any, bool, bool] | None = None
        stages_words = ""
        if parallel_dims.pp_enabled:  # trainer.py:443-477: pipelining_fn, then each part
            schedule, parts, has_first, has_last = pipelined.build_pipeline(
                model, config, parallel_dims, loss_fn, chunked_loss=chunked
            )
            pipeline = (schedule, has_first, has_last)
            stages_words = f"; {pipelined.pipeline_words(config, schedule, parts)}"
            notes.append(pipelined.PIPELINE_NOTE)
            del model
        else:  # trainer.py:491-508: parallelize_fn (TP, AC, compile, FSDP2)
            parts = [_parallelize(model_spec, model, parallel_dims, config)]
            has_last = True
        for part in parts:  # to_empty + init_weights + train()
            part.to_empty(device=torch.device("cpu"))
            with values_free_init(), torch.no_grad():
                part.init_weights(buffer_device=None)
            part.train()
        # trainer.py:516-536: the chunked loss computes the LM head itself (the last stage's)
        if chunked and has_last:
            loss_fn.set_lm_head(parts[-1].lm_head)
            parts[-1]._skip_lm_head = True
        optimizers = config.optimizer.build(model_parts=parts)  # trainer.py:549
        if model_spec.post_optimizer_build_fn is not None:  # trainer.py:550-553
            model_spec.post_optimizer_build_fn(optimizers, parts, parallel_dims)
        train_context = dist_utils.get_spmd_context(  # trainer.py:605-611
            parallel_dims=parallel_dims, spmd_typechecking=False
        )
        if pipeline is None and job.pipeline_outputs != "dropped":
            raise ConfigError(
                f"pipeline_outputs={job.pipeline_outputs!r} is how a pipeline schedule steps; "
                "this job has no pipeline: add --parallelism.pipeline_parallel_degree N or drop it"
            )
        if pipeline is None:
            step = _train_step(
                config, parts[0], loss_fn, optimizers, train_context, parallel_dims, accumulation
            )
        else:
            step = pipelined.pipeline_step(
                config, parts, *pipeline, optimizers, train_context, parallel_dims, accumulation,
                merge_outputs=job.pipeline_outputs == "merged",
            )
        layout = {
            "dp_replicate": parallel_dims.dp_replicate,
            "dp_shard": parallel_dims.dp_shard,
            "tp": parallel_dims.tp,
        }
        if parallel_dims.pp_enabled:
            layout["pp"] = parallel_dims.pp
        if parallel_dims.cp_enabled:
            layout["cp"] = parallel_dims.cp
            notes.append(context_parallel.CP_NOTE)
        if not training.disable_cuda_graphs:
            notes.append(
                "CUDA graphs: torchtitan captures forward+backward in a CUDA graph by default "
                "(training.disable_cuda_graphs=False); the step is recorded eagerly, without "
                "the graph's private memory pool"
            )
        words = " x ".join(f"{k} {v}" for k, v in layout.items() if v > 1) or "1 rank"
        built.run = TorchtitanRun(
            description=(
                f"torchtitan {torchtitan_version()} {job.module}:{model_spec.flavor} "
                f"({parameters:,} parameters), {words}, rank {job.rank} of {job.world_size}, "
                f"local batch {training.local_batch_size} x seq {training.seq_len}"
                + (f", {accumulation} micro-steps" if accumulation > 1 else "")
                + stages_words
            ),
            parameters=parameters,
            local_batch_size=training.local_batch_size,
            seq_len=training.seq_len,
            gradient_accumulation_steps=accumulation,
            layout=layout,
            notes=tuple(notes),
        )
        return step, (*parts, optimizers)

    return build, built


def _train_step(
    config: Any,
    model: Any,
    loss_fn: Any,
    optimizers: Any,
    train_context: Any,
    parallel_dims: Any,
    accumulation: int,
) -> Callable[[], None]:
    """``Trainer.train_step`` (trainer.py:871-949) for one model part, synthetic tokens."""
    import torch

    dist_utils = import_torchtitan("torchtitan.distributed.utils")
    training = config.training
    batch, seq = training.local_batch_size, training.seq_len

    def step() -> None:
        # trainer.py:874: gradients are kept (zeroed, not freed) while CUDA graphs are on
        optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)
        # trainer.py:893-903: the global token count, summed over the batch mesh on device
        local_tokens = torch.tensor(batch * seq * accumulation, dtype=torch.int64)
        if parallel_dims.dp_enabled:
            global_tokens = dist_utils.dist_sum_tensor(
                local_tokens, parallel_dims.get_mesh("batch")
            )
        else:
            global_tokens = local_tokens
        for _ in range(accumulation):
            # trainer.py:915-921: each micro-batch's tokens moved to the device
            inputs = torch.zeros(batch, seq, dtype=torch.int64)
            labels = torch.zeros(batch, seq, dtype=torch.int64)
            extra: dict[str, Any] = {}
            if parallel_dims.cp_enabled:  # trainer.py:750-758: this rank's tokens, positions
                inputs, labels, extra = context_parallel.shard_batch(config, parallel_dims, inputs, labels)
            with train_context():  # trainer.py:812-828 _forward_backward_body
                pred = model(inputs, **extra)
                loss, _ = loss_fn(pred, labels, global_tokens, **extra)
                del pred
                loss.backward()
            del inputs, labels, loss
        # trainer.py:939-948: clip (foreach) and the optimizer step
        dist_utils.clip_grad_norm_(
            list(model.parameters()),
            training.max_norm,
            foreach=True,
            pp_mesh=None,
            ep_enabled=parallel_dims.ep_enabled,
        )
        optimizers.step()

    return step


def _parallelize(model_spec: Any, model: Any, parallel_dims: Any, config: Any) -> Any:
    """``model_spec.parallelize_fn`` as trainer.py:491-499 calls it."""
    try:
        return model_spec.parallelize_fn(
            model,
            parallel_dims=parallel_dims,
            training=config.training,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=config.activation_checkpoint,
            dump_folder=config.dump_folder,
        )
    except ValueError as exc:
        if "dp_mesh_dims" in str(exc) and config.parallelism.spmd_backend == "spmd_types":
            import torch

            raise ConfigError(
                f"torchtitan's parallelism.spmd_backend 'spmd_types' (its default) hands "
                f"fully_shard parameters annotated with spmd_types, which torch "
                f"{torch.__version__}'s FSDP2 does not take ({exc}); the same job fails on a "
                "GPU with this torch. Pass --parallelism.spmd_backend partial_dtensor (DTensor "
                "for TP, FSDP2 over plain parameters, as torchtitan ran before spmd_types)"
            ) from exc
        raise


def _refuse_unmodelled(config: Any) -> None:
    """Refuse what this path does not record yet, naming the override that turns it on."""
    parallelism = config.parallelism
    refused = [
        (parallelism.expert_parallel_degree > 1, "--parallelism.expert_parallel_degree",
         "expert parallel is not recorded on the fake group yet"),
        (config.training.enable_cpu_offload, "--training.enable_cpu_offload",
         "FSDP2's CPU offload is not recorded on the fake group yet"),
    ]
    for given, override, why in refused:
        if given:
            raise ConfigError(
                f"{override}: {why}; drop it to predict the rest of the job "
                "(issue 38 tracks it)"
            )


def _attention(job: TorchtitanJob, config: Any) -> Iterator[str]:
    """Swap FlexAttention / varlen for torchtitan's SDPA (``attention="sdpa"``), or refuse."""
    attention = import_torchtitan("torchtitan.models.common.attention")
    kinds = (attention.FlexAttention.Config, attention.VarlenAttention.Config)
    found = [
        (parent, attr, type(cfg).__qualname__)
        for kind in kinds
        for _, cfg, parent, attr in list(config.model_spec.traverse(kind))
    ]
    if not found:
        return
    names = sorted({name.split(".")[0] for _, _, name in found})
    if job.attention == "configured":
        raise ConfigError(
            f"the job's attention is {' and '.join(names)}, whose Triton/CUDA kernels oomkit "
            "does not emulate; record it with torchtitan's ScaledDotProductAttention "
            "(attention \"sdpa\", the default) instead"
        )
    for parent, attr, _ in found:
        setattr(parent, attr, attention.ScaledDotProductAttention.Config())
    yield (
        f"attention: the job's {' and '.join(names)} ({len(found)} layers) is recorded as "
        "torchtitan's ScaledDotProductAttention (causal, one document per sequence; SDPA's "
        "CUDA kernels are emulated), as torchtitan ran before FlexAttention became its default"
    )


def record_torchtitan_job(
    job: TorchtitanJob, *, target: Target, steps: int = 2
) -> tuple[TraceRecording, TorchtitanRun]:
    """Record the job's rank ``job.rank`` for ``steps`` train steps on a fake process group.

    Args:
        job: the job.
        target: the GPU and software versions the CUDA emulations follow.
        steps: train steps to record (the second shows the optimizer state in place).

    Returns:
        The recording (its warnings say what is not modelled) and the run's record.

    Raises:
        ConfigError: a bad job (see ``load_job_config`` and ``build_torchtitan_step``).
        OomkitError: torchtitan's own code failed on the fake process group (the job named).
    """
    from oomkit.prediction.tracing.async_tp import async_tp_state_kept
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    capability = target.gpu.kernel_compute_capability  # a custom size: the kernels assumed
    config = load_job_config(job, capability=capability)
    build, built = build_torchtitan_step(job, config)
    import torch._dynamo

    # torchtitan's apply_compile sets capture_scalar_outputs and
    # skip_fwd_side_effects_in_bwd_under_checkpoint process-wide: restored after the job.
    dynamo = torch._dynamo.config
    dynamo_restored = dynamo.patch(
        capture_scalar_outputs=dynamo.capture_scalar_outputs,
        skip_fwd_side_effects_in_bwd_under_checkpoint=(
            dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint
        ),
    )
    with meshes_on_the_host(), cuda_capability(capability), dynamo_restored, \
            context_parallel.torch_cp_state_kept(), cpu_sdpa_as_cuda(target), \
            async_tp_state_kept():
        try:
            recording = trace_distributed_step(
                build, world_size=job.world_size, rank=job.rank, steps=steps, target=target,
                compile=config.compile.enable,
            )
        except OomkitError:
            raise
        except ValueError as exc:  # torchtitan's own checks of the job (as on a GPU)
            raise ConfigError(
                f"torchtitan refused the job {job.module}:{job.config}: {exc}"
            ) from exc
        except Exception as exc:
            # torchtitan's own code failed on the fake group: say where, not a traceback
            raise OomkitError(
                f"torchtitan's {job.module}:{job.config} failed on oomkit's fake process group "
                f"({type(exc).__name__}: {exc}); the torchtitan route is tested on llama3 "
                f"(FSDP2, TP, CP, PP, AC, Float8) with torchtitan {torchtitan_version()}: report it with "
                "the command line (issue 38)"
            ) from exc
    run = built.run
    assert run is not None, "build ran inside trace_distributed_step"
    return dataclasses.replace(recording, warnings=recording.warnings + run.notes), run
