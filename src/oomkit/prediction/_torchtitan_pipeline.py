"""torchtitan's own pipeline parallel (``pipeline_llm`` and its schedule) on the fake process group.

``torchtitan_job.py`` calls :func:`build_pipeline` where torchtitan's trainer calls
``model_spec.pipelining_fn`` (torchtitan/trainer.py:443-477) and :func:`pipeline_step` where
``train_step`` calls ``pp_forward_backward_step`` (trainer.py:833-868). torchtitan's functions
run as they are (torchtitan/distributed/pipeline_parallel.py ``pipeline_llm``: the stage split,
``parallelize_fn`` per part, ``_build_pipeline_schedule``); three things are arranged for a
GPU-free run:

* **Copies keep the fake mode.** ``_split_module`` deep-copies the whole model for each stage
  (``model = copy.deepcopy(whole_model)``). A ``FakeTensor`` keeps its ``fake_mode`` in its
  ``__dict__``, and torch/_tensor.py ``Tensor.__deepcopy__`` ends with ``new_tensor.__dict__ =
  deepcopy(self.__dict__, memo)``: every copied parameter got a deep copy of the mode, a second
  ``FakeTensorMode``, and FSDP2's ``fully_shard`` then failed with "Mixing fake modes NYI"
  (torch/_subclasses/fake_tensor.py ``validate_and_convert_non_fake_tensors``). While the split
  runs, a ``FakeTensorMode`` deep-copies to itself (a mode is process-wide state, not a value).
* **The neighbours' metadata.** torchtitan 0.3.0 builds each ``PipelineStage`` without example
  inputs or outputs (pipeline_parallel.py ``_pipeline_module_split``), so every stage votes
  DYNAMIC (torch/distributed/pipelining/_utils.py ``InferenceMode.needs_dynamic``) and the
  schedule's first ``step`` infers the shapes (schedules.py ``_initialize_pp_stages``), on the
  device: forward, stage by stage (stage.py ``_forward_metadata_inference``: the first stage
  takes micro-batch 0 itself, a detached alias; a later one allocates empty tensors of the
  received metadata, ``TensorMeta.to_tensor``; the stage's forward runs under
  ``torch.enable_grad()`` and its outputs are kept), then backward in reverse
  (``_backward_metadata_inference``: the last stage's loss of micro-batch 0, the others'
  ``torch.ones`` output gradients, ``torch.autograd.grad`` for the inputs that need one), then
  ``_post_metadata_inference_cleanup`` (FSDP2 reshards, parameter gradients to ``None``). That
  pass runs here as it is, but the metadata objects ranks exchange (distributed_c10d.py
  ``send_object_list`` / ``recv_object_list`` with ``device``: the pickled object and its
  size as device tensors), which the fake backend cannot carry: under
  :func:`metadata_exchange_emulated` a stage receives what its neighbour (another rank, built
  alike) would send, with the device tensors ``recv_object_list`` allocates for it: token ids
  into the first stage, the hidden states ``(micro-batch, seq / CP [/ TP under sequence
  parallel], dim)`` in FSDP2's compute dtype between stages, and out of the last (logits over
  the vocabulary, or the normed hidden states where the chunked loss computes the LM head).
  What a stage sends is checked against those shapes and allocated as ``send_object_list``
  does; in the steady state the stages check each tensor they pass (stage.py
  ``_validate_stage_tensors``).
* **The warm-up vote** reads its answer from a tensor (``result.item()``): it is answered by
  each stage's own vote, as oomkit's preset route does (``models/pipeline.py``).

Context parallel runs with it as torchtitan's trainer runs it: each micro-batch's token ids,
labels and positions are on the device, ``post_dataloading_process`` cuts each to this rank's
``seq / cp`` tokens (``prepare_context_parallel_input``), and the schedule takes the cut
micro-batches (``arg_mbs`` on the first stage, the positions as every stage's ``kwarg_mbs``,
``target_mbs`` on the last).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

from oomkit.errors import ConfigError
from oomkit.prediction._torchtitan_env import import_torchtitan

__all__ = [
    "PIPELINE_NOTE",
    "build_pipeline",
    "copies_keep_the_fake_mode",
    "metadata_exchange_emulated",
    "pickled_bytes",
    "pipeline_step",
    "pipeline_words",
]

PIPELINE_NOTE = (
    "pipeline parallel: the first step's metadata inference (torch/distributed/pipelining/"
    "stage.py _forward_metadata_inference and _backward_metadata_inference: one micro-batch "
    "forward and backward per stage, freed before the schedule runs) is recorded as on a GPU; "
    "the metadata each stage receives from its neighbours is derived from the job"
)


# The attribute a stage carries its pipeline's shapes under: ``shapes(stage_index, num_stages)``
# -> ``{"input_args": ..., "output_args": ..., ["input_grads": ..., "output_grads": ...]}``.
EXPECTED_SHAPES_ATTR = "_oomkit_expected_shapes"


def pickled_bytes(obj: Any) -> int:
    """Bytes of ``obj`` as ``send_object_list`` serialises it (distributed_c10d.py
    ``_object_to_tensor``: ``_pickler(f).dump(obj)``)."""
    from torch.distributed import distributed_c10d

    buffer = io.BytesIO()
    distributed_c10d._pickler(buffer).dump(obj)
    return len(buffer.getvalue())


def _expected(stage: Any, stage_index: int) -> dict[str, Any]:
    """The shapes of stage ``stage_index``, made outside the fake mode and unrecorded (meta
    tensors describing the neighbour's: nothing of them is device memory on a GPU)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from oomkit.prediction.tracing._modes import untraced

    shapes: Callable[[int, int], dict[str, Any]] = getattr(stage, EXPECTED_SHAPES_ATTR)
    with unset_fake_temporarily(), untraced():
        return shapes(stage_index, stage.num_stages)


def _forward_metas(stage: Any, stage_index: int, key: str) -> tuple[Any, ...]:
    """The metadata of stage ``stage_index``'s ``input_args`` or ``output_args``."""
    from torch.distributed.pipelining._utils import extract_tensor_metas

    tensors = _expected(stage, stage_index)[key]
    stage._mesh_cache.update_from_tensors(tensors)  # the DTensors' meshes, as get_mesh finds them
    metas = extract_tensor_metas(tensors)
    assert metas is not None, "a stage has inputs and outputs"
    return metas


def _input_grad_metas(stage: Any, stage_index: int) -> tuple[Any, ...]:
    """The metadata of stage ``stage_index``'s input gradients (what it sends backward):
    the gradients given with the shapes under TP, else each input's, ``requires_grad=False``
    (stage.py ``_backward_metadata_inference``: ``extract_tensor_meta(g)``, or
    ``_derive_grad_metas`` of an input without a gradient)."""
    from torch.distributed.pipelining._utils import _derive_grad_metas, extract_tensor_metas

    given = _expected(stage, stage_index).get("input_grads")
    if given is not None:
        stage._mesh_cache.update_from_tensors(given)
        metas = extract_tensor_metas(given, allow_none=True)
        assert metas is not None
        return metas
    return _derive_grad_metas(_forward_metas(stage, stage_index, "input_args"))


def _p2p(stage: Any, op: Any, tensor: Any, peer_stage: int) -> None:
    """One ``batch_isend_irecv`` of ``tensor`` with ``peer_stage``'s rank (``use_batch=True``)."""
    import torch.distributed as dist

    peer = stage.stage_index_to_group_rank[peer_stage]
    dist.batch_isend_irecv([dist.P2POp(op, tensor, group_peer=peer, group=stage.group)]).pop().wait()


def _receive(stage: Any, obj: Any, src_stage: int) -> Any:
    """``recv_object_list([None], use_batch=True, device=...)`` of ``obj``: its size (one int64)
    and its pickled bytes received into device tensors; the object returned."""
    import torch
    import torch.distributed as dist

    sizes = torch.empty(1, dtype=torch.long, device=stage.device)
    _p2p(stage, dist.irecv, sizes, src_stage)
    # recv_object_list: torch.empty(torch.sum(object_sizes_tensor).item(), dtype=torch.uint8)
    payload = torch.empty(pickled_bytes(obj), dtype=torch.uint8, device=stage.device)
    _p2p(stage, dist.irecv, payload, src_stage)
    del sizes, payload  # recv_object_list unpickles from a host copy and drops them
    return obj


def _send(stage: Any, obj: Any, dst_stage: int) -> None:
    """``send_object_list([obj], use_batch=True, device=...)``: ``_object_to_tensor`` moves the
    pickled bytes and their size to the device, ``torch.cat`` of the one size copies it."""
    import torch
    import torch.distributed as dist

    payload = torch.empty(pickled_bytes(obj), dtype=torch.uint8, device=stage.device)
    local_size = torch.empty(1, dtype=torch.long, device=stage.device)
    sizes = torch.cat([local_size])
    _p2p(stage, dist.isend, sizes, dst_stage)
    # send_object_list: one object's tensor is sent as it is (no cat)
    _p2p(stage, dist.isend, payload, dst_stage)


@contextlib.contextmanager
def metadata_exchange_emulated() -> Iterator[None]:
    """While open, a ``PipelineStage`` carrying the expected shapes exchanges its metadata
    objects with them (see the module doc: the neighbours' metadata).

    A stage's own inferred outputs (forward) and input gradients (backward) that differ from
    the shapes its neighbour is given raise torch's ``PipeliningMetadataError`` (``validate_
    tensors_metadata``: "Stage 0 forward outputs[0]: shape mismatch ...").
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import (
        _StageBackwardMeta,
        _StageForwardMeta,
        validate_tensors_metadata,
    )

    saved_recv, saved_send = PipelineStage._recv_meta, PipelineStage._send_meta

    def recv_meta(self: Any, src_stage: int) -> Any:
        if not hasattr(self, EXPECTED_SHAPES_ATTR):
            return saved_recv(self, src_stage)
        if src_stage == self.stage_index - 1:  # the previous stage's outputs
            meta: Any = _StageForwardMeta(forward_metas=_forward_metas(self, src_stage, "output_args"))
        else:  # the next stage's input gradients
            meta = _StageBackwardMeta(backward_metas=_input_grad_metas(self, src_stage))
        return _receive(self, meta, src_stage)

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        if not hasattr(self, EXPECTED_SHAPES_ATTR):
            saved_send(self, meta, dst_stage)
            return
        index = self.stage_index
        if isinstance(meta, _StageForwardMeta):
            expected = _forward_metas(self, index, "output_args")
            validate_tensors_metadata(f"Stage {index} forward outputs", expected, meta.forward_metas)
        else:
            expected = _input_grad_metas(self, index)
            validate_tensors_metadata(f"Stage {index} input grads", expected, meta.backward_metas)
        _send(self, meta, dst_stage)

    PipelineStage._recv_meta = recv_meta  # type: ignore[method-assign]
    PipelineStage._send_meta = send_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        PipelineStage._recv_meta = saved_recv  # type: ignore[method-assign]
        PipelineStage._send_meta = saved_send  # type: ignore[method-assign]


@contextlib.contextmanager
def copies_keep_the_fake_mode() -> Iterator[None]:
    """While open, ``copy.deepcopy`` of a ``FakeTensorMode`` returns the mode itself (see the
    module doc: torch/_tensor.py ``Tensor.__deepcopy__`` copies a FakeTensor's ``__dict__``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    had = "__deepcopy__" in vars(FakeTensorMode)
    saved = vars(FakeTensorMode).get("__deepcopy__")

    def keep(self: Any, memo: dict[int, Any]) -> Any:
        return self

    setattr(FakeTensorMode, "__deepcopy__", keep)  # noqa: B010
    try:
        yield
    finally:
        if had:
            setattr(FakeTensorMode, "__deepcopy__", saved)  # noqa: B010
        else:
            delattr(FakeTensorMode, "__deepcopy__")


def _stage_shapes(
    config: Any, parallel_dims: Any, skip_lm_head: bool
) -> Callable[[int, int], dict[str, Any]]:
    """``shapes(stage_index, num_stages)``: the ``input_args`` / ``output_args`` of a stage, as
    meta tensors (or DTensors of meta local tensors), to be called outside the fake mode."""
    import torch

    config_module = import_torchtitan("torchtitan.config")
    training, parallelism = config.training, config.parallelism
    model_config = config.model_spec.model
    micro = parallelism.pipeline_parallel_microbatch_size
    seq = training.seq_len
    # llama3/parallelize.py parallelize_llama: apply_fsdp_to_decoder runs always ("with
    # shard_degree=1 it is a no-op for the all-gather but still installs the
    # MixedPrecisionPolicy"), so the blocks compute in mixed_precision_param.
    dtype = config_module.TORCH_DTYPE_MAP[training.mixed_precision_param]
    tp_mesh = parallel_dims.get_mesh("tp") if parallel_dims.tp_enabled else None
    # Under TP with sequence parallel the embedding's output (and every block's) is the local
    # Shard(1) rows of the sequence, else replicated (torchtitan's decoder sharding plan).
    parallel_rows = tp_mesh is not None and parallelism.enable_sequence_parallel
    # Under CP each micro-batch holds this rank's seq / cp tokens (prepare_context_parallel_input)
    seq //= parallel_dims.cp
    rows = seq // parallel_dims.tp if parallel_rows else seq

    def tensor(shape: tuple[int, ...], placement: Any, grad: bool) -> Any:
        # on meta: the shapes describe what the neighbour sends; they allocate nothing
        local = torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)
        if tp_mesh is None:
            return local
        from torch.distributed.tensor import DTensor

        # Under TP the stages pass DTensors on the TP mesh (torchtitan's decoder sharding).
        return DTensor.from_local(local, tp_mesh, [placement], run_check=False)

    def shapes(stage_index: int, num_stages: int) -> dict[str, Any]:
        from torch.distributed.tensor import Replicate, Shard

        hidden = (micro, rows, model_config.dim)
        between = Shard(1) if parallel_rows else Replicate()
        first, last = stage_index == 0, stage_index == num_stages - 1
        inputs = (
            torch.empty(micro, seq, dtype=torch.int64, device="meta")
            if first
            else tensor(hidden, between, True)
        )
        if not last or skip_lm_head:
            outputs = tensor(hidden, between, True)
        else:  # loss parallel: the logits stay vocabulary shards
            vocab = model_config.vocab_size // (tp_mesh.size() if tp_mesh is not None else 1)
            outputs = tensor((micro, seq, vocab), Shard(2), True)
        found: dict[str, Any] = {"input_args": (inputs,), "output_args": (outputs,)}
        if tp_mesh is not None:
            # stage.py: a stage passing DTensors is static only with both gradients given
            # (_utils.py InferenceMode.needs_dynamic); the loss starts the last one's backward
            found["input_grads"] = (None if first else tensor(hidden, between, False),)
            found["output_grads"] = (None if last else tensor(hidden, between, False),)
        return found

    return shapes


@contextlib.contextmanager
def _stages_expecting(shapes: Callable[[int, int], dict[str, Any]]) -> Iterator[list[Any]]:
    """While open, torchtitan's ``_pipeline_module_split`` builds its ``PipelineStage`` objects
    as it does (``PipelineStage(model_chunk, stage_idx, num_stages, device, group=...,
    get_mesh=...)``, pipeline_parallel.py: no example inputs or outputs), each carrying the
    shapes its neighbours exchange (:func:`metadata_exchange_emulated`); the stages made are listed."""
    from torch.distributed.pipelining import PipelineStage

    module = import_torchtitan("torchtitan.distributed.pipeline_parallel")
    made: list[Any] = []

    def stage(submodule: Any, stage_index: int, num_stages: int, device: Any, **kwargs: Any) -> Any:
        built = PipelineStage(submodule, stage_index, num_stages, device, **kwargs)
        setattr(built, EXPECTED_SHAPES_ATTR, shapes)
        # stage.py _validate_stage_tensors: each tensor passed is checked against the shapes
        built._runtime_validate = True
        made.append(built)
        return built

    saved = getattr(module, "PipelineStage")  # noqa: B009
    setattr(module, "PipelineStage", stage)  # noqa: B010
    try:
        yield made
    finally:
        setattr(module, "PipelineStage", saved)  # noqa: B010


def build_pipeline(
    model: Any, config: Any, parallel_dims: Any, loss_fn: Any, *, chunked_loss: bool
) -> tuple[Any, list[Any], bool, bool]:
    """``model_spec.pipelining_fn`` as trainer.py:452-467 calls it (torchtitan's
    ``pipeline_llm`` for llama3), on the fake group: ``(schedule, model_parts, has_first_stage,
    has_last_stage)``.

    Raises:
        ConfigError: a model without a pipelining function, or a split or schedule torchtitan
            refuses (its words).
    """
    import torch

    model_spec = config.model_spec
    if not model_spec.pipelining_fn:  # trainer.py:444-448
        raise ConfigError(
            f"torchtitan's {model_spec.name} has no pipelining function: drop "
            "--parallelism.pipeline_parallel_degree"
        )
    shapes = _stage_shapes(config, parallel_dims, skip_lm_head=chunked_loss)
    try:
        with copies_keep_the_fake_mode(), _stages_expecting(shapes):
            return model_spec.pipelining_fn(
                model,
                parallel_dims=parallel_dims,
                training=config.training,
                parallelism=config.parallelism,
                compile_config=config.compile,
                ac_config=config.activation_checkpoint,
                dump_folder=config.dump_folder,
                device=torch.device("cpu"),  # the fake group's device
                model_config=model_spec.model,
                parallelize_fn=model_spec.parallelize_fn,
                loss_fn=loss_fn,
            )
    except (ValueError, AssertionError) as exc:
        raise ConfigError(f"torchtitan refused the pipeline split or schedule: {exc}") from exc


def _schedule_step(
    schedule: Any,
    arg_mbs: list[Any] | None,
    kwarg_mbs: list[dict[str, Any]],
    target_mbs: list[Any] | None,
    losses: list[Any] | None,
    loss_kwargs: dict[str, Any],
    merge_outputs: bool = False,
) -> None:
    """``pp_schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=...,
    loss_kwargs=..., return_outputs=False)`` as torchtitan 0.3.0 calls it (trainer.py:852-862);
    ``merge_outputs``: ``return_outputs=True``, the result dropped, as torchtitan before 0.3
    stepped it (9dec370 train.py: ``pp_schedule.step(target=labels, losses=losses)``; its
    torch's ``step`` always merged the last stage's ``output_chunks``).

    torch 2.13's ``step(*args, target=..., **kwargs)`` takes a whole batch and splits it
    (schedules.py ``_split_inputs``); the keywords would reach the model. There the step's own
    body runs on the micro-batches given: each stage's ``has_backward`` set and its runtime
    state cleared, then ``_step_microbatches``, then, where outputs are returned, the last
    stage's merged (schedules.py ``PipelineScheduleSingle.step`` / ``PipelineScheduleMulti.step``
    without the split: ``self._merge_outputs(stage.output_chunks)``).
    """
    import inspect

    if "arg_mbs" in inspect.signature(schedule.step).parameters:  # a torch that takes them
        schedule.step(
            arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, losses=losses,
            loss_kwargs=loss_kwargs, return_outputs=merge_outputs,
        )
        return
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    for stage in stages:
        stage.has_backward = schedule._has_backward
    for stage in stages:
        stage.clear_runtime_states()
    schedule._step_microbatches(
        arg_mbs, kwarg_mbs, target_mbs, losses, merge_outputs, loss_kwargs=loss_kwargs
    )
    for stage in stages if merge_outputs else ():
        if stage.is_last:  # the trainer drops what step returns
            schedule._merge_outputs(stage.output_chunks)


def pipeline_step(
    config: Any,
    model_parts: list[Any],
    schedule: Any,
    has_first: bool,
    has_last: bool,
    optimizers: Any,
    train_context: Any,
    parallel_dims: Any,
    accumulation: int,
    merge_outputs: bool = False,
) -> Callable[[], None]:
    """``Trainer.train_step`` (trainer.py:871-949) with ``pp_forward_backward_step``
    (trainer.py:833-868) for this rank's stages, synthetic tokens.

    Each micro-batch is the data loader's ``({"input": tokens, "positions": ...}, labels)``
    (torchtitan/hf_datasets/text_datasets.py), moved to the device (trainer.py:907-915: the
    token and position tensors are written back into the loader's dicts, which the step keeps
    to its end; the labels are the accumulation step's), then ``post_dataloading_process``
    (trainer.py:722-770: the positions become a keyword of every stage's forward; under CP the
    three are cut to this rank's ``seq / cp`` tokens), and the schedule runs the cut
    micro-batches (:func:`_schedule_step`; ``merge_outputs``: the last stage's outputs kept and
    merged, as torchtitan before 0.3 stepped it).
    """
    import torch

    from oomkit.prediction.models.pipeline import _warmup_by_own_vote, forget_earlier_meshes

    dist_utils = import_torchtitan("torchtitan.distributed.utils")
    cp_module = import_torchtitan("torchtitan.distributed.context_parallel")
    training, parallelism = config.training, config.parallelism
    seq, micro = training.seq_len, parallelism.pipeline_parallel_microbatch_size
    microbatches = training.local_batch_size // micro  # trainer.py:434-437
    params = [p for m in model_parts for p in m.parameters()]

    def post_dataloading(input_dict: dict[str, Any], labels: Any) -> tuple[Any, Any, dict[str, Any]]:
        # trainer.py:722-770 (SDPA: no attention masks; partial_dtensor: no input conversion)
        inputs = input_dict["input"]
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        if parallel_dims.cp_enabled:
            inputs, labels, extra = cp_module.prepare_context_parallel_input(
                inputs,
                labels,
                extra,
                parallel_dims.get_mesh("cp"),
                torch.device("cpu"),  # the fake group's device
                parallelism.context_parallel_load_balancer,
                parallelism.context_parallel_ptrr_mask_key,
            )
        return inputs, labels, extra

    def step() -> None:
        optimizers.zero_grad(set_to_none=training.disable_cuda_graphs)  # trainer.py:874
        local_tokens = torch.tensor(
            training.local_batch_size * seq * accumulation, dtype=torch.int64
        )
        if parallel_dims.dp_enabled:  # trainer.py:893-903
            global_tokens = dist_utils.dist_sum_tensor(local_tokens, parallel_dims.get_mesh("batch"))
        else:
            global_tokens = local_tokens
        kept: list[dict[str, Any]] = []  # the loader's dicts, holding their device tensors
        for _ in range(accumulation):
            input_dict_mbs: list[dict[str, Any]] = []
            label_mbs: list[Any] = []
            for _ in range(microbatches):  # trainer.py:907-915
                input_dict = {
                    "input": torch.zeros(micro, seq, dtype=torch.int64),
                    "positions": torch.zeros(micro, seq, dtype=torch.int64),
                }
                kept.append(input_dict)
                input_dict_mbs.append(input_dict)
                label_mbs.append(torch.zeros(micro, seq, dtype=torch.int64))
            # trainer.py:833-850 pp_forward_backward_step: each micro-batch post-processed
            arg_mbs: list[Any] = []
            kwarg_mbs: list[dict[str, Any]] = []
            target_mbs: list[Any] | None = [] if has_last else None
            for input_dict, labels in zip(input_dict_mbs, label_mbs, strict=True):
                inputs, labels, extra = post_dataloading(input_dict, labels)
                if has_first:
                    arg_mbs.append((inputs,))
                kwarg_mbs.append(extra)
                if target_mbs is not None:
                    target_mbs.append(labels)
            with train_context(), _warmup_by_own_vote(), metadata_exchange_emulated():
                losses: list[Any] | None = [] if has_last else None
                _schedule_step(
                    schedule,
                    arg_mbs if has_first else None,
                    kwarg_mbs,
                    target_mbs,
                    losses,
                    {"global_valid_tokens": global_tokens},
                    merge_outputs,
                )
            # trainer.py:865-868: the micro-step's loss, on the device (kept until the next)
            if has_last:
                assert losses is not None
                loss = torch.sum(torch.stack(losses))
            else:
                loss = torch.full((1,), -1.0)
            del arg_mbs, kwarg_mbs, target_mbs, losses, input_dict_mbs, label_mbs
            del inputs, labels, extra
        dist_utils.clip_grad_norm_(  # trainer.py:939-945
            params,
            training.max_norm,
            foreach=True,
            pp_mesh=parallel_dims.get_optional_mesh("pp"),
            ep_enabled=parallel_dims.ep_enabled,
        )
        optimizers.step()
        del kept, loss
        forget_earlier_meshes()  # nothing of this group's meshes outlives it

    return step


def pipeline_words(config: Any, schedule: Any, model_parts: list[Any]) -> str:
    """The pipeline as run on this rank, in words: schedule, micro-batches, its stages' modules."""
    parallelism = config.parallelism
    # schedules.py: a PipelineScheduleMulti keeps `_stages`, a PipelineScheduleSingle `_stage`
    run = getattr(schedule, "_stages", None) or [schedule._stage]
    stages = []
    for stage, part in zip(run, model_parts, strict=True):
        layers = list(part.layers.keys()) if part.layers is not None else []
        names = [name for name in ("tok_embeddings",) if getattr(part, name, None) is not None]
        if layers:
            names.append(f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}")
        names += [name for name in ("norm", "lm_head") if getattr(part, name, None) is not None]
        stages.append(f"stage {stage.stage_index} ({', '.join(names)})")
    return (
        f"pipeline {parallelism.pipeline_parallel_schedule} over {parallelism.pipeline_parallel_degree} "
        f"ranks, {schedule._n_microbatches} micro-batches of "
        f"{parallelism.pipeline_parallel_microbatch_size}: this rank runs {'; '.join(stages)}"
    )
