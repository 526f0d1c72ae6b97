"""DDP's own code path on a fake process group: what lets ``DistributedDataParallel`` run there.

``torch.nn.parallel.DistributedDataParallel`` runs unchanged under ``FakeTensorMode`` on the
``"fake"`` backend (``distributed.fake_process_group``) except at the places below, each a value
read, an answer the fake group does not give, or a second comm hook. :class:`FakeDdp` fills
exactly those, and makes the device allocations they make on CUDA:

1. The constructor's shape check (torch/nn/parallel/distributed.py ``__init__`` ->
   ``_verify_param_shape_across_processes`` -> C++ ``verify_params_across_processes``,
   torch/csrc/distributed/c10d/reducer.cpp) reads the all-gathered parameter count and the
   broadcast shapes back on the host. One rank agrees with itself, so only its device tensors
   are made (:func:`_verify_params_allocations`): the count (one int64), ``world_size`` gather
   outputs like it, and the shapes and strides copied to the device (``metadata.clone().to``),
   all freed when the check returns. The broadcast of the parameters that follows
   (``_sync_module_states``: flattened buckets of up to 250 MiB, ``_broadcast_coalesced``) runs
   as it is and is recorded.
2. The reducer's allreduce (reducer.cpp ``all_reduce_bucket`` -> ``run_comm_hook``) must
   complete with the bucket tensor (comm.cpp ``parseCppCommHookResult``), as NCCL's in-place
   allreduce does; the fake group's work completes with ``None``
   (torch/csrc/distributed/c10d/FakeProcessGroup.hpp ``FakeWork::getFuture``). Every DDP made
   while :class:`FakeDdp` is installed gets :func:`in_place_allreduce_hook`, which divides the
   bucket in place (the reducer skips its own division when a hook is registered, "Note [DDP
   Communication Hook]"), calls the fake allreduce and completes with the bucket itself: no
   allocation, as ``mul_out`` into the bucket view and NCCL's in-place allreduce make none.
3. The bucket rebuild after the first backward (reducer.cpp ``rebuild_buckets`` ->
   ``sync_bucket_indices``) fills host int32 tensors through accessors. :class:`_HostIndices`
   makes those host tensors real (a few bytes of CPU memory) while the rest stays fake; the two
   device copies it broadcasts are made as fake tensors of the same size and freed before the
   new buckets are allocated (``initialize_buckets``), as they go out of scope on CUDA.

4. With ``find_unused_parameters=True`` (the HF Trainer's default for a model without
   gradient checkpointing), the reducer reads each parameter's entry of its all-reduced "used"
   map back on the host as it finalizes a bucket (reducer.cpp ``finalize_bucket_dense``:
   ``local_used_map_[variable_index].item<int>()``), a value the fake group does not give.
   :meth:`FakeDdp.used_map_read` answers 1, used: a parameter unused on every rank keeps no
   gradient on a GPU, so counting its gradient is an upper bound.

5. A comm hook the code registers (``register_comm_hook``, ``_register_builtin_comm_hook``)
   would be the reducer's second (reducer.cpp refuses it: "can only be called once"): it is
   kept on the hook's state instead, and :func:`in_place_allreduce_hook` runs it in its place.
   Its async allreduce completes with ``[tensor]``, as NCCL's work does
   (``collectives.async_collectives_complete_with_outputs``; the fake group's completes with
   ``None``, which default_hooks.py's ``fut.value()[0]`` cannot read), so a compress hook's
   copy and decompression are recorded; DDP's check that bf16_compress_hook has NCCL sees
   NCCL, for which the fake group stands.

The gradient buckets themselves are C++ ``at::empty`` calls (reducer.cpp ``initialize_buckets``:
one flat tensor per bucket, of the bucket's dtype and total numel), made through the dispatcher,
so the tracer records them as it records any fake tensor; the hook tags them ``ddp_bucket``.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects
# (torch/nn/parallel/distributed.py ``_check_comm_hook``).
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from oomkit.prediction.tracing.collectives import (
    async_collectives_complete_with_outputs,
    nccl_said_available,
)

__all__ = ["DDP_NOTE", "FakeDdp", "in_place_allreduce_hook"]

# Said with every recording in which a DDP module was made.
DDP_NOTE = (
    "DDP: every replica holds the same parameters, gradients, buckets and optimizer state, so "
    "the rank recorded stands for all ranks where they run the same code; the reducer's "
    "allreduce runs as an in-place comm hook (no allocation, as NCCL's) or as the code's own "
    "comm hook; a rebuilt bucket's old buffer is freed at once, where NCCL's record_stream may "
    "keep it until its last allreduce has finished"
)


class _HookState:
    """What :func:`in_place_allreduce_hook` needs: the group, the tracer's role tagger, and the
    code's own hook with its state, once registered (fill 5 of the module doc)."""

    def __init__(self, group: Any, tag: Callable[[Any, Any], None] | None) -> None:
        self.group = group
        self.tag = tag
        self.code_hook: tuple[Any, Callable[..., Any]] | None = None

    def take(self, state: Any, hook: Callable[..., Any], refusal: str) -> None:
        """Keep the code's hook; a second one is refused with reducer.cpp's ``refusal``."""
        if self.code_hook is not None:
            raise RuntimeError(refusal)
        self.code_hook = (state, hook)


# reducer.cpp register_comm_hook / register_builtin_comm_hook (TORCH_CHECK(comm_hook_ == nullptr)).
_ONCE = "register_comm_hook or register_builtin_comm_hook can only be called once."
_BUILTIN_ONCE = "register_builtin_comm_hook or register_comm_hook can only be called once."


def _builtin_hook(comm_hook_type: Any) -> Callable[..., Any]:
    """The Python hook of a built-in one: torch/csrc/distributed/c10d/default_comm_hooks.cpp
    ``AllReduceCommHook`` divides the bucket in place and allreduces it, as
    default_hooks.py ``allreduce_hook``; ``FP16CompressCommHook`` allreduces a half copy and
    copies it back, as ``fp16_compress_hook``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        return default_hooks.fp16_compress_hook
    return default_hooks.allreduce_hook


def in_place_allreduce_hook(
    state: _HookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's default reduction, in place: average the bucket, complete with the bucket itself.

    torch/csrc/distributed/c10d/reducer.cpp ``mark_variable_ready_dense``: with no hook the
    reducer divides by the world size while copying into the bucket; with a hook it copies and
    the hook divides (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py
    ``allreduce_hook``: ``tensor.div_``). Both are in place.
    """
    buffer = bucket.buffer()
    if state.tag is not None:
        state.tag(buffer, "ddp_bucket")
    if state.code_hook is not None:  # the code's own hook, in place of this one (module doc, 5)
        code_state, hook = state.code_hook
        with async_collectives_complete_with_outputs():
            return hook(code_state, bucket)
    buffer.div_(dist.get_world_size(state.group))
    dist.all_reduce(buffer, group=state.group)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def _verify_params_allocations(process_group: Any, params: list[Any], logger: Any = None) -> None:
    """The device tensors of reducer.cpp ``verify_params_across_processes``; see the module doc.

    The host tensors it also makes (``metadata``, its clone, ``control``) are not device memory.
    """
    if not params:
        return
    device = params[0].device
    count = torch.empty((1,), dtype=torch.int64, device=device)  # at::tensor({params.size()})
    gathered = [torch.empty_like(count) for _ in range(process_group.size())]
    entries = sum(2 * param.dim() for param in params)
    metadata_dev = torch.empty((entries,), dtype=torch.int64, device=device)
    # C++ destroys locals in reverse order of declaration when the function returns.
    del metadata_dev, gathered, count


class _HostIndices(TorchDispatchMode):
    """During ``Reducer._rebuild_buckets``: int32 host tensors real, their device copies fake.

    reducer.cpp ``sync_bucket_indices`` makes ``at::empty({n}, at::kInt)`` on the host (no
    device given) and ``at::empty({n}, options)`` on the parameters' device, twice (indices,
    bucket sizes). On the fake world's one device both say ``cpu``: a device given marks the
    device copy. Ops whose tensors are all real run without modes (copies, the broadcast).
    """

    def __init__(self) -> None:
        super().__init__()
        self.device_copies: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        if func is torch.ops.aten.empty.memory_format and kwargs.get("dtype") == torch.int32:
            if kwargs.get("device") is not None:
                self.device_copies.append(func(*args, **kwargs))  # fake: recorded
            with _disable_current_modes():
                return func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with _disable_current_modes():
                return func(*args, **kwargs)
        # Past sync_bucket_indices: its device copies went out of scope.
        self.device_copies.clear()
        return func(*args, **kwargs)


class FakeDdp:
    """While installed, DDP runs on the fake process group; see the module doc.

    Args:
        tag: ``Tracer.add_role`` (or ``None``): the hook tags each bucket ``ddp_bucket``.
    """

    def __init__(self, tag: Callable[[Any, Any], None] | None = None) -> None:
        self.tag = tag  # set before the first DDP is made
        self.wrapped: list[Any] = []  # the DDP modules made while installed

    def used_map_read(self, ctx: Any) -> Any:
        """``aten._local_scalar_dense`` emulation: the reducer's read of its used map (fill 4 of
        the module doc) answers 1; any other read runs as it is. A Python ``.item()`` never
        reaches it (``value_reads`` answers those first): this is C++ reading during backward."""
        from torch._subclasses.fake_tensor import FakeTensor

        tensor = ctx.args[0] if ctx.args else None
        if (
            isinstance(tensor, FakeTensor)
            and tensor.dtype == torch.int32
            and tensor.dim() == 0
            and any(getattr(ddp, "find_unused_parameters", False) for ddp in self.wrapped)
        ):
            return 1
        return ctx.run()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Patch the places of the module doc for the block's duration, and restore them after."""
        from torch.nn.parallel import DistributedDataParallel

        original_init = DistributedDataParallel.__init__
        original_verify = dist._verify_params_across_processes
        original_rebuild = dist.Reducer._rebuild_buckets
        original_register = dist._register_comm_hook
        original_builtin = dist._register_builtin_comm_hook
        original_check = DistributedDataParallel._check_comm_hook
        hook_states: dict[int, _HookState] = {}  # by id(reducer): each fake DDP's own hook
        fake = self

        def register(reducer: Any, state: Any, hook: Any) -> None:
            # A fake DDP's own hook comes first (init below), so a reducer at the id of one
            # collected before it gets its own entry rather than the old one's.
            if isinstance(state, _HookState):
                original_register(reducer, state, hook)
                hook_states[id(reducer)] = state
            elif id(reducer) in hook_states:
                hook_states[id(reducer)].take(state, hook, _ONCE)
            else:
                original_register(reducer, state, hook)

        def register_builtin(reducer: Any, comm_hook_type: Any) -> None:
            if id(reducer) not in hook_states:
                original_builtin(reducer, comm_hook_type)
                return
            hook_states[id(reducer)].take(None, _builtin_hook(comm_hook_type), _BUILTIN_ONCE)

        def check(module: Any, hook: Any) -> None:
            # bf16_compress_hook asks dist.is_nccl_available(): the fake group stands for NCCL.
            with nccl_said_available():
                original_check(module, hook)

        def init(module: Any, *args: Any, **kwargs: Any) -> None:
            original_init(module, *args, **kwargs)
            module.register_comm_hook(
                _HookState(module.process_group, fake.tag), in_place_allreduce_hook
            )
            fake.wrapped.append(module)

        def rebuild(reducer: Any) -> bool:
            mode = _HostIndices()
            with mode:
                rebuilt = original_rebuild(reducer)
            mode.device_copies.clear()
            return bool(rebuilt)

        DistributedDataParallel.__init__ = init  # type: ignore[method-assign,assignment]
        DistributedDataParallel._check_comm_hook = check  # type: ignore[method-assign]
        dist._verify_params_across_processes = _verify_params_allocations
        dist.Reducer._rebuild_buckets = rebuild  # type: ignore[method-assign,assignment]
        dist._register_comm_hook = register  # type: ignore[assignment]
        dist._register_builtin_comm_hook = register_builtin
        try:
            yield
        finally:
            DistributedDataParallel.__init__ = original_init  # type: ignore[method-assign]
            DistributedDataParallel._check_comm_hook = original_check  # type: ignore[method-assign]
            dist._verify_params_across_processes = original_verify
            dist.Reducer._rebuild_buckets = original_rebuild  # type: ignore[method-assign]
            dist._register_comm_hook = original_register
            dist._register_builtin_comm_hook = original_builtin
