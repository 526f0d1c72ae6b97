"""The first pipeline step's metadata inference, recorded on the fake group as a GPU runs it.

torchtitan 0.3.0 builds each ``PipelineStage`` without example inputs or outputs
(torchtitan/distributed/pipeline_parallel.py ``_pipeline_module_split``: ``PipelineStage(
model_chunk, stage_idx, num_stages, device, group=..., get_mesh=...)``), so every stage votes
DYNAMIC (torch/distributed/pipelining/_utils.py ``InferenceMode.needs_dynamic``: no user
metadata) and the schedule's first ``step`` infers the shapes
(torch/distributed/pipelining/schedules.py ``_initialize_pp_stages``):

* forward, stage by stage (stage.py ``_forward_metadata_inference``): the first stage takes the
  first micro-batch itself (``_to_tensor``: a detached alias, no new memory); a later stage
  receives the previous stage's output metadata (``_recv_meta``) and allocates empty tensors of
  those shapes on the device (``TensorMeta.to_tensor`` / ``to_dtensor``); the stage's forward
  then runs for real, under ``torch.enable_grad()`` when the schedule has a backward, so its
  activations are saved, and its outputs are kept for the backward pass;
* backward, in reverse (``_backward_metadata_inference``): the last stage computes the loss of
  micro-batch 0, the others build ``torch.ones`` gradients of the received output-gradient
  metadata (``_ones_from_metadata``), and ``torch.autograd.grad`` computes the inputs'
  gradients;
* cleanup (``_post_metadata_inference_cleanup``): the kept tensors are dropped, FSDP2 reshards
  (``module.reshard()``) and the parameters' gradients are set to ``None``.

So on a GPU this pass allocates CUDA memory: one micro-batch's forward and backward of each of
the rank's stages, the FSDP2 all-gathers they trigger, and the metadata objects' byte tensors
(distributed_c10d.py ``send_object_list`` / ``recv_object_list`` with ``device``: the pickled
object and its size, as device tensors). All of it runs here as it is, on fake tensors, but
the exchange of metadata objects between ranks: the fake backend carries no values. Under
:func:`metadata_exchange_emulated` a stage receives what the neighbouring stage (another rank,
built alike) would send, given by the shapes ``_torchtitan_pipeline.py`` derives from the job,
with the device tensors ``recv_object_list`` allocates for it; what a stage sends is checked
against those shapes (the neighbour would receive exactly that) and allocated as
``send_object_list`` does.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "EXPECTED_SHAPES_ATTR",
    "metadata_exchange_emulated",
    "pickled_bytes",
]

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
    """While open, a ``PipelineStage`` carrying :data:`EXPECTED_SHAPES_ATTR` exchanges its
    metadata objects with the expected shapes (see the module doc).

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
