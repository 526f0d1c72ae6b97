"""Async tensor parallel (torchtitan's ``enable_async_tensor_parallel``) on presets.

torchtitan turns it on with compile (torchtitan/distributed/compile.py ``_maybe_enable_async_tp``:
``enable_symm_mem_for_group(tp_group)`` and ``torch._inductor.config._micro_pipeline_tp =
True``). Inductor's post-grad pass (torch/_inductor/fx_passes/micro_pipeline_tp.py) then rewrites
each all-gather followed by a matmul into ``symm_mem.fused_all_gather_matmul`` and each matmul
followed by a reduce-scatter into ``symm_mem.fused_matmul_reduce_scatter``, which run chunk by
chunk on a backend stream through a symmetric-memory workspace of the TP group
(torch/distributed/_symmetric_memory/__init__.py ``get_symm_mem_workspace``: one
``_SymmetricMemory.empty_strided_p2p`` uint8 buffer per group, grown to the largest request and
kept; it is not allocated by the caching allocator, so it is not in ``memory_allocated``).

Both routes record it the same way (``prediction/tracing/async_tp.py``: the pass run on the
compiled graphs, the fused ops' CUDA allocations, the workspace as a line outside the
allocator): the torchtitan route through torchtitan's own ``_maybe_enable_async_tp``, a preset
under ``--tp N --compile --set parallel.async_tp=true`` through ``with_async_tp`` below.

The requests, for a Llama block under the sequence-parallel plan (``tensor_parallel.py``):

- all-gather then matmul (q/k/v and gate/up; in backward, o/down's input gradient): the local
  shard, ``batch x seq/tp x hidden`` elements (``_pipelined_all_gather_and_consume``:
  ``p2p_workspace_size_req`` sums the shards' bytes);
- matmul then reduce-scatter on the sequence dimension (o/down; in backward, the column-parallel
  layers' input gradient): two output chunks, ``2 x batch x seq/tp x hidden``
  (``_pipelined_produce_and_all2all``: ``out_chunks[0]`` bytes times 2).

So the workspace is ``2 x batch x seq/tp x hidden`` elements of the activations' dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["with_async_tp"]


def with_async_tp(step_fn: Callable[[], Any], mesh: Any) -> Callable[[], Any]:
    """``step_fn`` as torchtitan's ``_maybe_enable_async_tp`` leaves a compiled TP step.

    Symmetric memory is enabled for the TP group (``enable_symm_mem_for_group``, deprecated in
    torch 2.13 but what torchtitan 0.3.0 calls), and Inductor's ``_micro_pipeline_tp`` is on
    while the step runs (its blocks compile on the first call; the recording then runs the pass:
    ``prediction/tracing/async_tp.py``), as it was before once the step returns.

    Args:
        step_fn: the step of a preset compiled under TP.
        mesh: its mesh, with a ``"tp"`` dimension (or a 1-D TP mesh).
    """
    import warnings

    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    names = tuple(mesh.mesh_dim_names or ())
    tp_mesh = mesh["tp"] if "tp" in names and len(names) > 1 else mesh
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)

    def step() -> Any:
        flag = inductor_config._micro_pipeline_tp
        inductor_config._micro_pipeline_tp = True
        try:
            return step_fn()
        finally:
            inductor_config._micro_pipeline_tp = flag

    return step
