"""torchtitan's own context parallel (``--parallelism.context_parallel_degree N``) on the fake group.

What torchtitan 0.3.0 runs for CP with SDPA and the ``partial_dtensor`` backend, all of it
run as it is here:

* ``ParallelDims.build_mesh``: a ``cp`` mesh, and FSDP2 over ``dp_shard x cp`` (its ``fsdp``
  mesh), so CP alone still shards the parameters ``cp`` ways;
* ``parallelize_llama`` -> ``apply_cp_to_forward`` (torchtitan/distributed/context_parallel/
  api.py): each block's inner attention takes its local q, k, v as ``Shard(1)`` DTensors on the
  CP mesh, and torch's CP dispatcher is enabled (``_enable_context_parallel_dispatcher``), so
  DTensor runs SDPA's fused ops as torch's ring attention (torch/distributed/tensor/
  experimental/_context_parallel/_attention.py ``_sdpa_handler``: K and V all-gathered by the
  default ``_AllGatherRotater``, each step's output merged in fp32 by ``_SDPAMerger``; the
  backward rotates dK/dV the same way), the code oomkit's preset route calls directly
  (``models/context_parallel.py`` ``RingAttention``);
* ``post_dataloading_process`` -> ``prepare_context_parallel_input`` (trainer.py:750-758): the
  micro-batch's token ids, labels and positions cut to this rank's ``seq / cp`` tokens by
  torch's ``_HeadTailLoadBalancer``, done by :func:`shard_batch`.

What needs a GPU is which fused kernel SDPA runs: the tracer's SDPA emulation picks the one the
target GPU would (flash, memory-efficient or cuDNN) from the local shards, and DTensor hands
that op to the matching ring function (``tracing/emulations/sdpa.py``). torch's CP keeps its
settings in module globals (the dispatcher's op handlers, ``_cp_options``, the dispatch mode),
which torchtitan sets and never resets: :func:`torch_cp_state_kept` puts them back after a job.

Compiled blocks (``--compile.enable``) record with CP: dynamo's capture of SDPA on the CP
DTensors takes the fused kernel the target GPU picks, as on a GPU (``_torchtitan_cp_compile.py``),
and AOTAutograd traces torch's ring into the compiled forward and backward graphs. With pipeline
parallel, ``_torchtitan_pipeline.py`` cuts each micro-batch the same way and hands the cut
micro-batches to the schedule.

Not recorded: FlexAttention's CP (its Triton kernels are not emulated; the route records SDPA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from oomkit.errors import ConfigError
from oomkit.prediction._torchtitan_env import import_torchtitan

__all__ = [
    "CP_NOTE",
    "check_seq_len",
    "shard_batch",
    "torch_cp_state_kept",
]

CP_NOTE = (
    "context parallel: torchtitan's apply_cp_to_forward and prepare_context_parallel_input, "
    "torch's ring attention (K/V all-gathered, outputs merged in fp32) with the fused SDPA "
    "kernel the target GPU picks; the whole micro-batch's token ids, labels and positions are "
    "on the device before they are sharded, as in torchtitan's trainer"
)


def shard_batch(
    config: Any, parallel_dims: Any, inputs: Any, labels: Any
) -> tuple[Any, Any, dict[str, Any]]:
    """``post_dataloading_process`` under CP: this rank's ``(inputs, labels, extra_kwargs)``.

    The data loader yields each sequence's positions with its tokens
    (torchtitan/hf_datasets/text_datasets.py: ``{"input": ..., "positions": ...}``), moved to
    the device with them (trainer.py:911-914); ``prepare_context_parallel_input`` shards all
    three on the sequence dimension. The positions are one document per sequence (0 to
    ``seq_len - 1``), as SDPA's causal mask assumes.
    """
    import torch

    cp_module = import_torchtitan("torchtitan.distributed.context_parallel")
    batch, seq = labels.shape
    positions = torch.arange(seq, dtype=torch.int64).repeat(batch, 1)
    parallelism = config.parallelism
    return cp_module.prepare_context_parallel_input(
        inputs,
        labels,
        {"positions": positions},
        parallel_dims.get_mesh("cp"),
        torch.device("cpu"),  # the fake group's device
        parallelism.context_parallel_load_balancer,
        parallelism.context_parallel_ptrr_mask_key,
    )


@contextlib.contextmanager
def torch_cp_state_kept() -> Iterator[None]:
    """While open, torch's CP globals may change; they are put back when it closes.

    torchtitan's ``apply_cp_to_forward`` enables the CP dispatcher (DTensor's
    ``_op_dispatcher._custom_op_handlers`` and CP's sharding rules) and
    ``_context_parallel_shard`` sets ``_dispatch_mode`` and ``_cp_options.enable_load_balance``
    (torch/distributed/tensor/experimental/_context_parallel/_attention.py); a later job in the
    same process would otherwise find them set.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention

    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers
    mode = _attention._dispatch_mode
    load_balance = _attention._cp_options.enable_load_balance
    try:
        yield
    finally:
        if dispatcher._custom_op_handlers is not handlers:
            _attention._disable_cp_dtensor_dispatcher()
            dispatcher._custom_op_handlers = handlers
        _attention._dispatch_mode = mode
        _attention._cp_options.enable_load_balance = load_balance


def check_seq_len(parallel_dims: Any, seq_len: int, sequence_parallel: bool) -> None:
    """Refuse a sequence length torchtitan's trainer refuses (trainer.py:306-314): it must
    divide by TP under sequence parallel, times ``2 x cp`` under CP (the head-tail balancer's
    two chunks a rank).

    Raises:
        ConfigError: ``seq_len`` does not divide so.
    """
    divisor = parallel_dims.tp if sequence_parallel else 1
    divisor *= 2 * parallel_dims.cp if parallel_dims.cp > 1 else 1
    if seq_len % divisor:
        raise ConfigError(
            f"torchtitan refuses training.seq_len {seq_len}: it must divide by {divisor} for "
            "the configured sequence / context parallelism (TP under sequence parallel, "
            f"times 2 x CP); use --training.seq_len {max(divisor, seq_len // divisor * divisor)}"
        )
