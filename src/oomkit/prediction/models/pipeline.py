"""Pipeline parallel for the Llama presets, as torchtitan splits and schedules it.

``build_pipeline_preset_step(name, options, mesh, pipeline)`` runs inside the fake process group
and ``FakeTensorMode`` (``trace_distributed_step``) with a mesh whose outermost dimension is
``"pp"``. It splits the blocks into stages as torchtitan's ``pipeline_llm`` does
(torchtitan/distributed/pipeline_parallel.py ``_generate_llm_fqn_per_model_part``: the embedding
and the norm + LM head each weigh one block, stages get equal weights, earlier stages one more
where they do not divide), keeps this rank's stages (``stage_ids_this_rank``: ``"loop"`` style,
stage ``pp_rank + k * pp``), applies TP, activation checkpointing and FSDP2 to each as
torchtitan's ``parallelize_llama`` does (FSDP2 with ``reshard_after_forward=False``:
torchtitan/distributed/fsdp.py ``get_fsdp_reshard_after_forward_policy``, "For PP, by default do
not reshard after forward"), and runs torch.distributed.pipelining's own schedule
(``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleGPipe``) on ``PipelineStage`` objects:
which micro-batches' activations a stage keeps in flight is the real schedule's.

On the fake backend every send and receive completes at once (its receive buffers keep their
size). Two things are replaced by what they decide: the stages are given their input and output
shapes (``input_args`` / ``output_args``: torchtitan lets the stages infer them by sending
metadata objects, which the fake backend cannot carry), and the schedule's warm-up vote, whose
answer is read from a tensor (torch/distributed/pipelining/schedules.py ``_warmup_p2p``:
``result.item()``), is answered by each stage's own vote (``InferenceMode.needs_dynamic``): every
rank builds its stages alike, so the product of the votes is this rank's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from oomkit.errors import ConfigError
from oomkit.prediction.models.llama import Llama, LlamaShape
from oomkit.prediction.models.options import BuiltStep, StepOptions
from oomkit.prediction.models.parallel import _cast_floating, fsdp_words, refuse_unsharded_modes
from oomkit.prediction.models.presets import _check_lengths, shaped_preset
from oomkit.prediction.models.selective_ac import apply_checkpointing
from oomkit.prediction.models.steps import _describe, _optimizer, model_dtype

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "PIPELINE_SCHEDULES",
    "PipelineOptions",
    "build_pipeline_preset_step",
    "forget_earlier_meshes",
    "stage_ids_of_rank",
    "stage_layers",
]

PipelineSchedule = Literal["1f1b", "interleaved-1f1b", "gpipe"]

# torch/distributed/pipelining/schedules.py: the schedule classes by oomkit's names;
# interleaved-1f1b is a PipelineScheduleMulti (several stages per rank), the others single.
PIPELINE_SCHEDULES: dict[str, str] = {
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "gpipe": "ScheduleGPipe",
}


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline: degree, schedule, micro-batches and stages per rank.

    Attributes:
        degree: pipeline ranks (the ``"pp"`` mesh dimension).
        schedule: ``1f1b``, ``interleaved-1f1b`` or ``gpipe``.
        microbatches: micro-batches per step; ``None``: the local batch (torchtitan's
            ``pipeline_parallel_microbatch_size = 1``).
        stages_per_rank: stages each rank runs; ``None``: 1, or 2 for interleaved
            (torchtitan ``_get_pipeline_metadata``'s default).
    """

    degree: int
    schedule: PipelineSchedule = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None

    @property
    def looped(self) -> bool:
        """Whether the schedule runs several stages per rank (``PipelineScheduleMulti``)."""
        return self.schedule == "interleaved-1f1b"

    @property
    def virtual_stages(self) -> int:
        """Stages per rank as run: given, else torchtitan's default for the schedule."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.looped else 1

    def check(self) -> None:
        """Refuse what torchtitan refuses (``_get_pipeline_metadata``).

        Raises:
            ConfigError: a single-stage schedule with several stages per rank, or a looped one
                with fewer than two.
        """
        stages = self.virtual_stages
        if stages < 1:
            raise ConfigError(f"parallel.stages_per_rank must be at least 1; got {stages}")
        if not self.looped and stages != 1:
            raise ConfigError(
                f"--pp-schedule {self.schedule} runs one stage per rank; got "
                f"parallel.stages_per_rank={stages}. Use --pp-schedule interleaved-1f1b for several"
            )
        if self.looped and stages < 2:
            raise ConfigError(
                "--pp-schedule interleaved-1f1b needs at least 2 stages per rank (torchtitan "
                f"_get_pipeline_metadata); got parallel.stages_per_rank={stages}"
            )


def stage_layers(
    num_stages: int, num_layers: int, input_weight: int = 1, output_weight: int = 1
) -> tuple[tuple[int, ...], ...]:
    """The blocks of each stage, as torchtitan's ``_generate_llm_fqn_per_model_part`` splits
    them: the embedding (stage 0) weighs ``input_weight`` blocks and the norm + LM head (the
    last stage) ``output_weight``; each stage gets ``(layers + weights) // stages`` weight, the
    first ``(layers + weights) % stages`` one more.

    Raises:
        ConfigError: more stages than weighted blocks, an empty stage, or an end weight above
            a stage's share (torchtitan raises ValueError for each).
    """
    if num_stages < 1:
        raise ConfigError(f"a pipeline needs at least 1 stage; got {num_stages}")
    if num_stages == 1:
        return (tuple(range(num_layers)),)
    effective = num_layers + input_weight + output_weight
    per_stage, extra = divmod(effective, num_stages)
    if num_stages > effective or per_stage == 0:
        raise ConfigError(
            f"{num_stages} pipeline stages cannot split {num_layers} blocks (plus the embedding "
            "and the LM head, a block's weight each, as torchtitan counts them): use at most "
            f"{effective} stages in all (--pp times parallel.stages_per_rank)"
        )
    if input_weight > per_stage or output_weight > per_stage:
        raise ConfigError(
            f"{num_stages} pipeline stages of {num_layers} blocks leave {per_stage} block(s) a "
            "stage, fewer than the embedding's or LM head's weight (torchtitan "
            "_generate_llm_fqn_per_model_part); use fewer stages"
        )
    stages: list[tuple[int, ...]] = []
    layer = 0
    for index in range(num_stages):
        weight = per_stage + (1 if index < extra else 0)
        if index == 0:
            weight -= input_weight
        elif index == num_stages - 1:
            weight -= output_weight
        count = max(0, min(weight, num_layers - layer))
        stages.append(tuple(range(layer, layer + count)))
        layer += count
    return tuple(stages)


def stage_ids_of_rank(pp_rank: int, pp: int, num_stages: int) -> tuple[int, ...]:
    """The stages ``pp_rank`` runs: ``pp_rank``, ``pp_rank + pp``, ... (torch/distributed/
    pipelining/schedules.py and torchtitan ``stage_ids_this_rank``, ``"loop"`` style)."""
    return tuple(range(pp_rank, num_stages, pp))


class LlamaStage(nn.Module):
    """One pipeline stage of a Llama: the embedding (first stage), its blocks, the norm and
    LM head (last stage); it keeps the model's ``inv_freq`` for the rotary embedding, as each of
    torchtitan's stage copies keeps ``freqs_cis``."""

    inv_freq: torch.Tensor

    def __init__(self, model: Llama, layers: tuple[int, ...], first: bool, last: bool,
                 seq_len: int) -> None:
        super().__init__()
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.checkpointing = model.checkpointing
        self.seq_len = seq_len
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or hidden states in; hidden states or logits out."""
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        positions = torch.arange(self.seq_len, device=x.device)
        cos, sin = Llama._rope(cast(Llama, self), positions, x.dtype)
        for block in self.layers:
            if self.checkpointing and self.training:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        if self.norm is not None and self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def _mesh_parts(mesh: DeviceMesh) -> tuple[Any, Any, Any]:
    """(pp, FSDP, TP) meshes of ``mesh`` (``None`` for an absent dimension); FSDP's is 2-D
    (replicas, shards) with a ``"dp"`` dimension (HSDP), as torchtitan's ``apply_fsdp`` gets."""
    names = tuple(mesh.mesh_dim_names or ())
    pp = mesh["pp"]
    fsdp = None
    if "fsdp" in names:
        fsdp = mesh["dp", "fsdp"] if "dp" in names else mesh["fsdp"]
    elif "dp" in names:
        raise ConfigError(
            "--pp with --dp alone (DDP replicas) is not modelled (torchtitan's parallelize_llama "
            "refuses DDP on a mesh of more than one dimension); use --fsdp with --pp"
        )
    tp = mesh["tp"] if "tp" in names else None
    return pp, fsdp, tp


@contextlib.contextmanager
def _warmup_by_own_vote() -> Iterator[None]:
    """While open, the schedules' warm-up vote is each stage's own (see the module doc)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import InferenceMode

    original = schedules._PipelineSchedule._warmup_p2p

    def warmup(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        static = all(
            not InferenceMode.needs_dynamic(stage._user_meta, has_backward) for stage in stages
        )
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC if static else InferenceMode.DYNAMIC

    schedules._PipelineSchedule._warmup_p2p = warmup  # type: ignore[method-assign]
    try:
        yield
    finally:
        schedules._PipelineSchedule._warmup_p2p = original  # type: ignore[method-assign]


def build_pipeline_preset_step(
    name: str, options: StepOptions, mesh: DeviceMesh, pipeline: PipelineOptions
) -> BuiltStep:
    """Llama preset ``name`` pipelined over ``mesh["pp"]`` (with FSDP2 and TP on the mesh's
    other dimensions); this rank's stages run the real schedule.

    Args:
        name: a Llama preset with untied embeddings.
        options: the per-rank (local) batch, sequence, precision, optimizer, checkpointing.
        mesh: the fake group's mesh, ``"pp"`` outermost, maybe ``"dp"``, ``"fsdp"``, ``"tp"``.
        pipeline: degree, schedule, micro-batches, stages per rank.

    Returns:
        This rank's step: its stages, their optimizer, the batch.

    Raises:
        ConfigError: not a Llama preset, tied embeddings, a mode other than ``train``,
            a batch the micro-batches do not divide, or a split torchtitan refuses.
    """
    from torch.distributed.pipelining import schedules

    pipeline.check()
    forget_earlier_meshes()
    if options.mode != "train":
        raise ConfigError("--pp predicts training steps (the schedule runs backward); use --mode train")
    if options.grad_accum != 1 or options.max_grad_norm is not None:
        raise ConfigError(
            "--pp does not model gradient accumulation or clipping yet (torchtitan's micro-"
            "batches are the schedule's: use --microbatches); drop --grad-accum and max_grad_norm"
        )
    refuse_unsharded_modes(options, "--pp")
    if options.precision is None:  # a preset's own precision is fp32
        options = dataclasses.replace(options, precision="fp32")
    preset = shaped_preset(name, options)
    shape = preset.shape
    if not isinstance(shape, LlamaShape):
        raise ConfigError(
            f"--pp is modelled for the Llama presets (torchtitan's pipeline_llm); {name} is "
            f"{preset.title}. Example: oomkit predict llama3-8b --pp 2 --batch 8"
        )
    if shape.tied:
        raise ConfigError(
            f"{preset.title} ties its embedding and LM head, which sit on the first and last "
            "pipeline stages; tied weights under --pp are not modelled (use an untied preset)"
        )
    seq_len = options.seq_len or preset.default_seq_len or 0
    _check_lengths(preset, options, seq_len)
    pp_mesh, fsdp_mesh, tp_mesh = _mesh_parts(mesh)
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    microbatches = pipeline.microbatches or options.batch_size
    if microbatches < 1 or options.batch_size % microbatches:
        raise ConfigError(
            f"--microbatches {microbatches} must divide the local batch {options.batch_size} "
            "(torchtitan _build_pipeline_schedule: batch size divisible by the micro-batch size)"
        )
    num_stages = pp * pipeline.virtual_stages
    split = stage_layers(num_stages, shape.layers)
    stage_ids = stage_ids_of_rank(pp_rank, pp, num_stages)
    device = mesh.device_type
    with torch.device(device):
        model = cast(Llama, preset.build())
    if options.precision == "bf16":
        _cast_floating(model, model_dtype(options.precision))
    if tp_mesh is not None:
        from oomkit.prediction.models.tensor_parallel import (
            apply_llama_tensor_parallel,
            check_tp_divides,
        )

        check_tp_divides(shape, tp_mesh.size(), seq_len, preset.title)
        # Loss parallel as torchtitan: the last stage's logits stay vocabulary shards (a
        # DTensor the schedule's loss reads under loss_parallel()).
        apply_llama_tensor_parallel(model, tp_mesh, loss_parallel=True)
    apply_checkpointing(model, options.checkpointing, train=True, as_torchtitan=True)
    parts = [
        LlamaStage(model, split[s], s == 0, s == num_stages - 1, seq_len) for s in stage_ids
    ]
    if fsdp_mesh is not None:
        _shard_stages(parts, fsdp_mesh, options.precision or "fp32")
    micro_batch = options.batch_size // microbatches
    with warnings.catch_warnings():
        # stage.py validate_static_arg_grad_correspondence warns that the last stage's logits
        # get no output gradient: "legal at pipeline boundaries" (the loss starts backward).
        warnings.simplefilter("ignore", UserWarning)
        stages = _stages(parts, stage_ids, num_stages, micro_batch, seq_len, shape, options,
                         device, fsdp_mesh, tp_mesh, pp_mesh)
    loss_module = nn.CrossEntropyLoss()

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, loss_module(logits.reshape(-1, logits.shape[-1]),
                                              labels.reshape(-1)))

    schedule_class = getattr(schedules, PIPELINE_SCHEDULES[pipeline.schedule])
    try:
        schedule = (
            schedule_class(stages, n_microbatches=microbatches, loss_fn=loss_fn,
                           scale_grads=False)
            if pipeline.looped
            else schedule_class(stages[0], n_microbatches=microbatches, loss_fn=loss_fn,
                                scale_grads=False)
        )
    except ValueError as exc:  # the schedule's own checks (micro-batches per stage)
        raise ConfigError(f"--pp-schedule {pipeline.schedule}: {exc}") from exc
    # torchtitan train_step: every rank moves the batch to the device; the first stage gets
    # the ids, the last the labels.
    ids = torch.randint(shape.vocab, (options.batch_size, seq_len), device=device)
    labels = torch.randint(shape.vocab, (options.batch_size, seq_len), device=device)
    params = [p for part in parts for p in part.parameters()]
    holder = nn.ModuleList(parts)
    optimizer = _optimizer(options, holder)
    first = any(stage.is_first for stage in stages)
    last = any(stage.is_last for stage in stages)
    autocast = options.precision == "bf16-mixed" and fsdp_mesh is None

    def step() -> None:
        args = (ids,) if first else ()
        target = labels if last else None
        parallel_loss: Any = contextlib.nullcontext()
        if tp_mesh is not None:
            from torch.distributed.tensor.parallel import loss_parallel

            parallel_loss = loss_parallel()  # torchtitan's train_context
        with _warmup_by_own_vote(), parallel_loss, torch.autocast(
            device, torch.bfloat16, enabled=autocast
        ):
            schedule.step(*args, target=target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        forget_earlier_meshes()  # nothing of this group's meshes outlives it

    where = (
        f"pipeline parallel {pp} ({pipeline.schedule}, {microbatches} micro-batches, "
        f"{num_stages} stages: rank {pp_rank} runs stage(s) "
        f"{', '.join(str(s) for s in stage_ids)} with blocks "
        f"{'; '.join(_blocks_words(split[s]) for s in stage_ids)})"
    )
    if tp_mesh is not None:
        where += f", tensor parallel over {tp_mesh.size()} ranks (loss parallel)"
    if fsdp_mesh is not None:
        where += f", {fsdp_words(fsdp_mesh)} per stage (reshard_after_forward=False)"
    description = f"{_describe(preset.title, options, preset.task, seq_len, 224)}, {where}"
    return BuiltStep(
        step,
        (holder, optimizer, ids, labels),
        description,
        sum(p.numel() for p in params),
        options,
    )


def forget_earlier_meshes() -> None:
    """Clear DTensor's sharding-propagation caches (torch/distributed/tensor/debug/__init__.py
    ``_clear_sharding_prop_cache``: the C++ fast path's, then the Python ``lru_cache``), whose
    output specs hold the ``DeviceMesh`` of the call that filled them. Meshes compare by shape
    and dimension names, not by process group, so a later fake group in this process (another
    rank of the same layout) would be handed an earlier group's mesh, whose collectives name a
    group that no longer exists."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def _stages(parts: list[LlamaStage], stage_ids: tuple[int, ...], num_stages: int,
            micro_batch: int, seq_len: int, shape: LlamaShape, options: StepOptions,
            device: str, fsdp_mesh: Any, tp_mesh: Any, pp_mesh: Any) -> list[Any]:
    """This rank's ``PipelineStage`` objects, given their input and output shapes."""
    from torch.distributed.pipelining import PipelineStage

    return [
        PipelineStage(
            part,
            stage_id,
            num_stages,
            torch.device(device),
            input_args=_stage_input(stage_id, micro_batch, seq_len, shape, options, fsdp_mesh,
                                    tp_mesh),
            output_args=_stage_output(stage_id, num_stages, micro_batch, seq_len, shape, options,
                                      fsdp_mesh, tp_mesh),
            **_sharded_logits_grads(stage_id, num_stages, micro_batch, seq_len, shape, options,
                                    fsdp_mesh, tp_mesh),
            group=pp_mesh.get_group(),
        )
        for stage_id, part in zip(stage_ids, parts, strict=True)
    ]


def _blocks_words(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers else "none"


def _activation_dtype(options: StepOptions, fsdp_mesh: Any) -> torch.dtype:
    """The hidden states' dtype between stages: FSDP2's bf16 parameters (``bf16-mixed``) or
    the model's; under autocast (``bf16-mixed`` without FSDP) the residual stream stays fp32
    (an fp32 embedding plus bf16 block outputs promotes to fp32)."""
    if options.precision == "bf16" or (options.precision == "bf16-mixed" and fsdp_mesh):
        return torch.bfloat16
    return torch.float32


def _hidden(micro_batch: int, seq_len: int, shape: LlamaShape, options: StepOptions,
            fsdp_mesh: Any, tp_mesh: Any) -> torch.Tensor:
    # Under TP the embedding's output is sequence-sharded (tensor_parallel.py llama_root_plan:
    # Shard(1), local tensors), so stages pass seq / tp rows.
    rows = seq_len // (tp_mesh.size() if tp_mesh is not None else 1)
    dtype = _activation_dtype(options, fsdp_mesh)
    return torch.empty(micro_batch, rows, shape.hidden, dtype=dtype, requires_grad=True)


def _stage_input(stage_id: int, micro_batch: int, seq_len: int, shape: LlamaShape,
                 options: StepOptions, fsdp_mesh: Any, tp_mesh: Any) -> tuple[torch.Tensor]:
    if stage_id == 0:
        return (torch.empty(micro_batch, seq_len, dtype=torch.long),)
    return (_hidden(micro_batch, seq_len, shape, options, fsdp_mesh, tp_mesh),)


def _stage_output(stage_id: int, num_stages: int, micro_batch: int, seq_len: int,
                  shape: LlamaShape, options: StepOptions, fsdp_mesh: Any,
                  tp_mesh: Any) -> tuple[torch.Tensor]:
    if stage_id < num_stages - 1:
        return (_hidden(micro_batch, seq_len, shape, options, fsdp_mesh, tp_mesh),)
    dtype = torch.bfloat16 if options.precision in ("bf16", "bf16-mixed") else torch.float32
    if tp_mesh is None:
        return (torch.empty(micro_batch, seq_len, shape.vocab, dtype=dtype, requires_grad=True),)
    from torch.distributed.tensor import DTensor, Shard

    # tensor_parallel.py llama_root_plan(loss_parallel=True): the LM head's output stays
    # Shard(-1), a DTensor of vocab / tp columns a rank.
    local = torch.empty(micro_batch, seq_len, shape.vocab // tp_mesh.size(), dtype=dtype,
                        requires_grad=True)
    return (cast(torch.Tensor, DTensor.from_local(local, tp_mesh, [Shard(-1)])),)


def _sharded_logits_grads(stage_id: int, num_stages: int, micro_batch: int, seq_len: int,
                          shape: LlamaShape, options: StepOptions, fsdp_mesh: Any,
                          tp_mesh: Any) -> dict[str, Any]:
    """The last stage's gradient shapes where its logits are a DTensor (TP's loss parallel):
    torch/distributed/pipelining/_utils.py ``InferenceMode.needs_dynamic`` keeps a stage with
    DTensors static only when both are given (its input's gradient, and no output gradient:
    the loss starts its backward)."""
    if tp_mesh is None or stage_id != num_stages - 1:
        return {}
    (hidden,) = _stage_input(stage_id, micro_batch, seq_len, shape, options, fsdp_mesh, tp_mesh)
    grad = torch.empty(hidden.shape, dtype=hidden.dtype) if stage_id > 0 else None
    return {"input_grads": (grad,), "output_grads": (None,)}


def _shard_stages(parts: list[LlamaStage], mesh: Any, precision: str) -> None:
    """``fully_shard`` each block, then each stage, with ``reshard_after_forward=False``
    (torchtitan/distributed/fsdp.py: not under PP) and torchtitan's mixed precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if precision == "bf16-mixed":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for part in parts:
        for block in part.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        fully_shard(part, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
