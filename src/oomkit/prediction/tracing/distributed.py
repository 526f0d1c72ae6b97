"""Record rank 0 of a torch.distributed step GPU-free: a fake process group, fake tensors, streams.

``torch.distributed`` runs its real code path with no GPU and no peers on the ``"fake"`` backend
(torch/testing/_internal/distributed/fake_pg.py: every collective returns at once, leaving its
output as allocated), with the model under ``FakeTensorMode`` (FSDP2 refuses meta parameters).
The recorder accounts fake tensors by their meta storages (``fake_storages.py``), so FSDP2's own
sharding, all-gather and reduce-scatter buffers, prefetching and resharding are recorded as they
happen, by lifetime.

Streams. On CUDA an allocation belongs to the stream current when it is made, and its block
goes back to that stream's pool (CUDACachingAllocator.cpp ``malloc``: blocks are looked up by
``(size, stream)``). FSDP2 picks its streams itself through ``device_handle.stream(s)``
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: ``foreach_all_gather`` allocates the
copy-in buffer and the all-gather output under ``all_gather_copy_in_stream``; ``foreach_reduce``
allocates the reduce-scatter output under ``reduce_scatter_stream``); with a ``cpu`` mesh the
device handle is ``torch.cpu`` (torch/distributed/device_mesh.py ``_get_device_handle``), whose
stream contexts do nothing. :class:`EmulatedStreams` follows those contexts and numbers the
streams (0: the default stream; 1, 2, ...: FSDP2's, in order of first use). FSDP2 calls no
``record_stream`` (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, "[Note:
Overlapping all-gather copy-in and all-gather]": it keeps references and waits on events
instead), so every free is an ordinary free into the block's own stream pool.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace.step_count import check_step_count
from oomkit.errors import ConfigError, UnsupportedOpError
from oomkit.prediction.tracing.async_tp import AsyncTpEmulations
from oomkit.prediction.tracing.collectives import (
    COLLECTIVE_EMULATIONS,
    sharding_propagation_untraced,
)
from oomkit.prediction.tracing.cuda_ranks import MeshShape, as_cuda_rank
from oomkit.prediction.tracing.emulation import DEFAULT_EMULATIONS, EmulationContext, OpEmulation
from oomkit.prediction.tracing.fake_ddp import DDP_NOTE, FakeDdp
from oomkit.prediction.tracing.fake_storages import mark_host
from oomkit.prediction.tracing.optimizers import cuda_optimizer_defaults
from oomkit.prediction.tracing.recorder import Tracer
from oomkit.prediction.tracing.recording import TraceRecording
from oomkit.prediction.tracing.stream_timeline import CollectiveUses, with_timeline

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "EmulatedStreams",
    "FakeWorld",
    "FsdpBufferRoles",
    "HOST_TENSOR_EMULATIONS",
    "fake_process_group",
    "trace_distributed_step",
]

# What the fake run leaves out, said with every distributed recording. (The GPU's timing of
# collectives: stream_timeline.py, the recording's timing_note; NCCL's own buffers: the
# prediction's lines outside the allocator, core/gpus/nccl.py.)
_NOT_MODELLED = (
    "distributed: rank 0 of a fake process group; NCCL's buffers are outside PyTorch's "
    "caching allocator (the prediction counts them apart where the target names the layout)"
)


def _python_data_on_host(ctx: EmulationContext) -> Any:
    """``aten.lift_fresh``: ``torch.tensor(data)`` made on the host; its storage is not device."""
    out = ctx.run()
    if isinstance(out, torch.Tensor):
        mark_host(out)
    return out


# torch/csrc/utils/tensor_new.cpp internal_new_from_data: torch.tensor(data) builds the tensor
# on the CPU, then lifts it (aten.lift_fresh) into the active mode.
HOST_TENSOR_EMULATIONS: dict[str, OpEmulation] = {
    "aten.lift_fresh.default": _python_data_on_host,
    "aten.lift_fresh_copy.default": _python_data_on_host,
}


@contextlib.contextmanager
def fake_process_group(
    world_size: int,
    *,
    rank: int = 0,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] | None = None,
) -> Iterator[DeviceMesh]:
    """A fake process group of ``world_size`` ranks and a ``cpu`` mesh over it (1-D unless
    ``mesh_shape`` says otherwise).

    The group is destroyed on exit, so nothing leaks into code that runs afterwards; while it
    is open, the meshes FSDP2 makes for itself are built on the host (``_meshes_on_the_host``).

    Args:
        world_size: ranks in the group (at least 1).
        rank: the rank this process plays.
        mesh_shape: the mesh's sizes, outermost first (their product is ``world_size``);
            ``None``: ``(world_size,)``.
        mesh_dim_names: a name per mesh dimension (``("fsdp", "tp")``), or ``None``.

    Yields:
        The device mesh, created outside any fake mode (as ``fully_shard`` needs it).

    Raises:
        ConfigError: a bad size, or a process group is already initialised.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(
            f"world size must be at least 1 and rank in [0, world size); got world size "
            f"{world_size}, rank {rank}. Example: --fsdp 8"
        )
    shape = (world_size,) if mesh_shape is None else tuple(mesh_shape)
    if math.prod(shape) != world_size:
        raise ConfigError(f"a mesh of shape {shape} does not have {world_size} ranks")
    if dist.is_initialized():
        raise ConfigError(
            "a torch.distributed process group is already initialised in this process; oomkit "
            "records a rank on its own fake group: call dist.destroy_process_group() first"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with _meshes_on_the_host():
            yield init_device_mesh("cpu", shape, mesh_dim_names=mesh_dim_names)
    finally:
        dist.destroy_process_group()
        _forget_sharding_results()


def _forget_sharding_results() -> None:
    """Empty DTensor's sharding-propagation caches when the group they were filled on is gone.

    They are keyed by the op's schema, whose specs compare meshes by value (device_mesh.py
    ``DeviceMesh.__eq__``: rank map, layout, names), so the next recording's equal mesh would get
    output specs holding this recording's mesh (torch/distributed/tensor/_sharding_prop.py
    ``ShardingPropagator.propagate_op_sharding``, an ``lru_cache``, and the C++ fast path's
    cache in front of it). Eager code resolves that
    mesh's groups by name, which finds the live ones; compiled code takes them from the mesh
    object (``_get_pg_from_name`` while compiling: ``mesh._pg_registry``), the destroyed group
    of the last recording ("Group ... is not registered"). A GPU process has one group for its
    life; each recording here gets a fresh cache, as each process would.
    """
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    # Both caches: the Python lru_cache and the C++ dispatch fast path's
    # (torch/distributed/tensor/debug/__init__.py _clear_sharding_prop_cache).
    _clear_sharding_prop_cache()


class EmulatedStreams:
    """Follows ``torch.cpu.stream(s)`` contexts as CUDA's current stream; see the module doc."""

    def __init__(self) -> None:
        self._ids: dict[int, int] = {}
        self._streams: list[Any] = []  # keeps ids stable: a stream's id() is not reused
        self._stack: list[int] = [0]
        self._objects: list[Any] = [None]  # the stream objects of ``_stack``; None: default

    def current(self) -> int:
        """The id of the stream allocations are made on now (0: the default stream)."""
        return self._stack[-1]

    @property
    def streams_used(self) -> int:
        """Non-default streams seen so far."""
        return len(self._streams)

    def _id_of(self, stream: Any, default: Any) -> int:
        if stream is None or stream is default or stream == default:
            return 0
        found = self._ids.get(id(stream))
        if found is None:
            self._streams.append(stream)
            found = self._ids[id(stream)] = len(self._streams)
        return found

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While open, ``torch.cpu.stream(s)`` makes ``s`` current in its block, as on CUDA.

        ``torch.cpu.current_stream()`` answers the stream made current (c10/cuda/CUDAStream.h
        ``getCurrentCUDAStream``; torch.cuda.StreamContext sets it for its block).
        """
        original_stream, original_current = torch.cpu.stream, torch.cpu.current_stream
        default = original_current()
        streams = self

        @contextlib.contextmanager
        def stream(stream: Any) -> Iterator[None]:
            streams._stack.append(streams._id_of(stream, default))
            streams._objects.append(stream)
            try:
                with original_stream(stream):
                    yield
            finally:
                streams._stack.pop()
                streams._objects.pop()

        def current_stream(device: Any = None) -> Any:
            found = streams._objects[-1]
            return default if found is None else found

        torch.cpu.stream = stream
        torch.cpu.current_stream = current_stream
        try:
            yield
        finally:
            torch.cpu.stream = original_stream
            torch.cpu.current_stream = original_current


class FsdpBufferRoles:
    """Tags FSDP2's communication buffers with roles, by wrapping its collective functions.

    ``_fsdp_param_group.py`` calls ``foreach_all_gather``, ``foreach_all_gather_copy_out`` and
    ``foreach_reduce`` (``_fsdp_collectives.py``) through its own module namespace; the wrappers
    tag what each returns or fills: the all-gather output and the unsharded parameters
    (``allgather_buffer``), the reduce-scatter input (``reduce_scatter_buffer``). The
    reduce-scatter output becomes the sharded gradient when the reduce dtype is the parameter's
    (``foreach_reduce`` views it as ``sharded_param.grad``), so that role wins there.
    """

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self.wrapped = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """While open, FSDP2's collectives tag their buffers (nothing if FSDP2 is absent)."""
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module
        except ImportError:  # pragma: no cover - torch without FSDP2
            yield
            return
        names = ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")
        originals = {name: getattr(group_module, name, None) for name in names}
        if any(original is None for original in originals.values()):
            yield  # pragma: no cover - another FSDP2 layout: buffers stay untagged
            return
        tag = self._tracer.add_role
        gather, copy_out, reduce = (originals[name] for name in names)
        assert gather is not None and copy_out is not None and reduce is not None

        def all_gather(*args: Any, **kwargs: Any) -> Any:
            result = gather(*args, **kwargs)
            if result is not None:
                tag(result.all_gather_output, "allgather_buffer")
            return result

        def all_gather_copy_out(result: Any, fsdp_params: Any, *args: Any, **kwargs: Any) -> Any:
            out = copy_out(result, fsdp_params, *args, **kwargs)
            for fsdp_param in fsdp_params:
                for tensor in fsdp_param.all_gather_outputs:
                    tag(tensor, "allgather_buffer")
            return out

        def reduce_scatter(*args: Any, **kwargs: Any) -> Any:
            out = reduce(*args, **kwargs)
            tag(out[0], "reduce_scatter_buffer")  # the reduce-scatter input, held by FSDP2
            return out

        wrappers = dict(zip(names, (all_gather, all_gather_copy_out, reduce_scatter), strict=True))
        for name, wrapper in wrappers.items():
            setattr(group_module, name, wrapper)
        self.wrapped = True
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(group_module, name, original)


def trace_distributed_step(
    build: Callable[[DeviceMesh], tuple[Any, ...]],
    *,
    world_size: int,
    mesh_shape: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
    steps: int = 1,
    gpu: GpuSpec | None = None,
    target: Target | None = None,
    emulations: Mapping[str, OpEmulation] | None = None,
    compile: bool = False,
    rank: int = 0,
) -> TraceRecording:
    """Record rank 0 of a distributed step: ``build(mesh)`` under fake tensors, then its step.

    ``build`` runs inside the fake process group and ``FakeTensorMode``; it builds the model
    (calling ``fully_shard(..., mesh=mesh)``), the optimizer and the inputs, and returns
    ``(step_fn, track)`` or ``(step_fn, track, setup)``. Modules, optimizers and tensors in
    ``track`` are recorded as allocated before step 0; ``setup()`` then runs under the recorder
    before step 0 (wrapping in ``DistributedDataParallel``, whose constructor allocates the
    gradient buckets: ``fake_ddp.py``); ``step_fn()`` runs ``steps`` times. A
    ``DistributedDataParallel`` that ``build`` itself makes is constructed there too: its
    constructor is deferred to that point (:func:`_ddp_constructed_under_the_recorder`).

    Args:
        build: makes the step for the given mesh.
        world_size: ranks in the fake group.
        mesh_shape: the mesh's sizes and dimension names (``ParallelLayout.mesh_shape``);
            ``None``: a 1-D mesh over ``world_size`` ranks.
        steps: how many times to run the step.
        gpu: target: emulations: as in ``trace_step``.
        compile: record ``torch.compile``d code (a block compiled inside FSDP2 / TP / DDP) as
            compiled, as ``trace_step(compile=True)`` does (``compiled.py``).
        rank: the rank recorded (pipeline stages differ; ``fake_process_group``'s ``rank``).

    Returns:
        Rank 0's recording; allocations carry the CUDA stream FSDP2 would use.

    Raises:
        ConfigError: a bad world size or an initialised process group.
        UnsupportedOpError: an op has no fake/meta implementation.
    """
    check_step_count(steps, "trace_distributed_step(fn, world_size=8, steps=3)")
    world = FakeWorld(
        world_size,
        mesh_shape=mesh_shape,
        gpu=gpu,
        target=target,
        emulations=emulations,
        compile=compile,
        rank=rank,
    )
    with world.opened() as mesh:
        with _ddp_constructed_under_the_recorder() as deferred, world.as_rank():
            step_fn, track, *setup = build(mesh)
        setup = [*deferred, *setup]
        uneven_bytes = _uneven_shard_bytes(track)
        with world.failures_named(), world.recording() as tracer:
            tracer.track(track)
            for run_setup in setup:
                run_setup()  # before step 0: DDP's constructor (fake_ddp.py)
            for _ in range(steps):
                tracer.mark_step()
                step_fn()
        del step_fn, track, setup
    return world.recorded(uneven_bytes)


class FakeWorld:
    """One rank of a fake process group, recorded: what ``trace_distributed_step`` opens around
    a builder's step, and a whole torchrun script's run (``script_run.record_script``).

    ``opened()`` starts the fake group and ``FakeTensorMode`` (and DDP's fills:
    ``fake_ddp.py``; with ``host_inputs``, real host tensors may meet fake ones, a script's:
    ``host_compute.py``); inside it, ``as_rank()`` runs torchrun-style code as the recorded rank
    (``cuda_ranks.py``) and ``recording()`` records with ``tracer``; ``recorded()`` is the
    recording with what it leaves out among its warnings.
    """

    def __init__(
        self,
        world_size: int,
        *,
        mesh_shape: tuple[tuple[int, ...], tuple[str, ...]] | None = None,
        gpu: GpuSpec | None = None,
        target: Target | None = None,
        emulations: Mapping[str, OpEmulation] | None = None,
        compile: bool = False,
        rank: int = 0,
        values: Mapping[str, Any] | None = None,
        host_inputs: bool = False,
    ) -> None:
        if target is not None:
            gpu = target.gpu
            if emulations is None:
                from oomkit.prediction.tracing.emulations import emulations_for

                emulations = emulations_for(target.cudnn_version, target.torch_version)
        base = DEFAULT_EMULATIONS if emulations is None else emulations
        self.async_tp = AsyncTpEmulations()  # the fused ops of Inductor's async-TP pass
        base = {**base, **HOST_TENSOR_EMULATIONS, **COLLECTIVE_EMULATIONS,
                **self.async_tp.emulations}
        self.uses = CollectiveUses()  # the GPU's timeline of collectives (stream_timeline.py)
        self.ddp = FakeDdp()
        # The device meshes the code made (init_device_mesh), for a script's layout.
        self.meshes: list[MeshShape] = []
        # The reducer's host read of its used map (find_unused_parameters: fake_ddp.py).
        base["aten._local_scalar_dense.default"] = self.ddp.used_map_read
        self.tracer = Tracer(emulations={**base, **self.uses.emulations(base)}, gpu=gpu,
                             compile=compile, target=target, values=values)
        self.ddp.tag = self.tracer.add_role
        self.uses.attach(self.tracer)
        self.streams = EmulatedStreams()
        self.tracer.current_stream = self.streams.current
        self.world_size, self.rank, self.target = world_size, rank, target
        shape, names = mesh_shape if mesh_shape is not None else (None, None)
        self.group = fake_process_group(
            world_size, rank=rank, mesh_shape=shape, mesh_dim_names=names
        )
        from torch._subclasses.fake_tensor import FakeTensorMode

        # With host_inputs, real host tensors may meet fake ones (a script's: host_compute.py).
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=host_inputs)

    @contextlib.contextmanager
    def opened(self) -> Iterator[DeviceMesh]:
        """The fake group (its mesh yielded), ``FakeTensorMode`` and DDP's fills, while open."""
        with self.group as mesh, self.fake_mode, self.ddp.installed():
            yield mesh

    def as_rank(self) -> contextlib.AbstractContextManager[None]:
        """Code written for torchrun on CUDA runs as the recorded rank (cuda_ranks.py)."""
        return as_cuda_rank(self.world_size, rank=self.rank, gpu=self.tracer.gpu,
                            meshes=self.meshes)

    @contextlib.contextmanager
    def recording(self) -> Iterator[Tracer]:
        """Record with ``tracer`` (inside ``opened()``), as the recorded rank."""
        roles, noted = FsdpBufferRoles(self.tracer).installed(), self.uses.installed()
        with self.tracer, self.streams.installed(), roles, sharding_propagation_untraced(), \
                noted, self.async_tp.installed():
            # The fake device is "cpu": let torch.optim pick its CUDA defaults for it.
            with cuda_optimizer_defaults("cpu"), self.as_rank():
                yield self.tracer

    @contextlib.contextmanager
    def failures_named(self) -> Iterator[None]:
        """An op that failed under ``FakeTensorMode`` raises ``UnsupportedOpError``, naming it."""
        try:
            yield
        except Exception as exc:
            failed = self.tracer.failed_op
            if failed is not None and failed[1] is exc:
                raise UnsupportedOpError(
                    f"{failed[0]} failed under FakeTensorMode ({exc}); oomkit can only trace "
                    "ops that do not read tensor values"
                ) from exc
            raise

    def recorded(self, uneven_bytes: tuple[int, int, int] | None = None) -> TraceRecording:
        """The recording, with what it leaves out (and ranks' uneven shards) as warnings."""
        recording = self.tracer.recording
        layout = f"; world size {self.world_size}, {self.streams.streams_used} side stream(s)"
        notes: tuple[str, ...] = (
            _NOT_MODELLED.replace("rank 0", f"rank {self.rank}", 1) + layout,
        )
        if self.ddp.wrapped:
            notes += (DDP_NOTE,)
        if uneven_bytes:
            notes += (
                f"ranks differ: {uneven_bytes[0]} sharded parameter(s) have rows that "
                f"{uneven_bytes[2]} ranks do not divide; FSDP2 pads every rank's flat shard "
                f"alike, but the last rank(s) hold up to {uneven_bytes[1]} bytes less of each "
                "parameter-sized optimizer state (AdamW has two); rank 0, always a full shard, "
                "is the largest",
            )
        recording = with_timeline(recording, self.uses, self.target)
        return dataclasses.replace(
            recording,
            warnings=recording.warnings + notes + self.async_tp.notes(),
            outside_allocator=recording.outside_allocator + self.async_tp.outside_lines(),
        )


@contextlib.contextmanager
def _meshes_on_the_host() -> Iterator[None]:
    """While open, the meshes FSDP2 makes for itself are built with the fake mode paused.

    A new ``DeviceMesh`` computes its rank tensor from the real rank map
    (torch/distributed/device_mesh.py ``DeviceMesh.__init__`` -> ``mesh``), which
    ``FakeTensorMode`` refuses as a real input. FSDP2 makes two: ``fully_shard`` on a TP DTensor
    parameter joins the FSDP and TP meshes (torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    ``_init_sharding_spec_tp`` -> ``DeviceMesh._concatenate``), and ``reshard_after_forward=N``
    views the mesh for its post-forward mesh (``_fsdp_init.py`` ``_get_post_forward_mesh_info``:
    ``mesh.view(-1, N)``). A mesh is host bookkeeping, not device memory; what FSDP2 allocates on
    it is recorded as usual.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fully_shard

    concatenate = DeviceMesh.__dict__["_concatenate"]
    post_forward_mesh_info = _fully_shard._get_post_forward_mesh_info

    def on_the_host(make: Callable[..., Any]) -> Callable[..., Any]:
        def made(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return make(*args, **kwargs)

        return made

    setattr(DeviceMesh, "_concatenate", staticmethod(on_the_host(concatenate.__func__)))  # noqa: B010
    _fully_shard._get_post_forward_mesh_info = on_the_host(post_forward_mesh_info)
    try:
        yield
    finally:
        setattr(DeviceMesh, "_concatenate", concatenate)  # noqa: B010
        _fully_shard._get_post_forward_mesh_info = post_forward_mesh_info


@contextlib.contextmanager
def _ddp_constructed_under_the_recorder() -> Iterator[list[Callable[[], None]]]:
    """While open, ``DistributedDataParallel(module, ...)`` makes the object at once but defers
    its constructor: the list yielded gets a call that runs it later, under the recorder.

    DDP's constructor allocates on the device (the parameters' broadcast, the first gradient
    buckets: torch/nn/parallel/distributed.py ``__init__`` -> ``_sync_module_states``,
    ``_ddp_init_helper`` -> reducer.cpp ``initialize_buckets``), so a step builder that wraps
    its model itself would make them before anything is recorded. Until then the object is a
    plain module holding ``module`` (so ``ddp.parameters()`` gives the optimizer the model's
    parameters, as DDP's do); the deferred call runs DDP's real ``__init__`` on that same
    object, which the step closes over.
    """
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__
    deferred: list[Callable[[], None]] = []

    def init(ddp: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        torch.nn.Module.__init__(ddp)
        ddp.module = module

        def construct() -> None:
            # DistributedDataParallel.__init__ as patched now (fake_ddp.py's, with its hook).
            DistributedDataParallel.__init__(ddp, module, *args, **kwargs)

        deferred.append(construct)

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign,assignment]
    try:
        yield deferred
    finally:
        DistributedDataParallel.__init__ = original  # type: ignore[method-assign]


def _uneven_shard_bytes(track: Any) -> tuple[int, int, int] | None:
    """(parameters, bytes, shard ranks) by which the smallest rank's unpadded shards fall short
    of rank 0's.

    torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``_init_sharded_param``: rank r's shard
    is ``torch.chunk(data, shard_world_size)[r]`` along the FSDP placement's dimension (chunks
    of ``ceil(rows / N)`` rows, the last ones shorter or absent), padded to chunk 0's size for
    the all-gather only. ``data`` is the parameter as FSDP2 finds it: a TP DTensor's local
    tensor (``_init_sharding_spec_tp``), so its rows are the TP-local rows; and ``N`` is the
    FSDP degree (``FSDPMeshInfo.shard_mesh_size``: the mesh's shard dimension; with HSDP, not
    the replicas), read from FSDP2's own ``FSDPParam`` records (``_orig_size``).
    """
    from torch.utils._pytree import tree_leaves

    count, short_bytes, ranks = 0, 0, 0
    seen: set[int] = set()
    for obj in tree_leaves(list(track)):
        if not isinstance(obj, torch.nn.Module):
            continue  # DDP replicas and unsharded modules hold whole parameters
        for fsdp_param in _fsdp_params(obj):
            if id(fsdp_param) in seen:
                continue
            seen.add(id(fsdp_param))
            size = tuple(fsdp_param._orig_size)
            dim = fsdp_param.fsdp_placement.dim
            shard_ranks = fsdp_param.mesh_info.shard_mesh_size
            if not size or size[dim] == 0:
                continue
            rows = size[dim]
            chunk = -(-rows // shard_ranks)
            last = max(0, rows - chunk * (shard_ranks - 1))
            if last != chunk:
                count += 1
                ranks = shard_ranks
                itemsize = fsdp_param._sharded_param_data.element_size()
                short_bytes += (chunk - last) * (math.prod(size) // rows) * itemsize
    return (count, short_bytes, ranks) if count else None


def _fsdp_params(root: torch.nn.Module) -> Iterator[Any]:
    """FSDP2's ``FSDPParam`` records under ``root`` (each FSDP unit's parameter groups)."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # pragma: no cover - torch before per-parameter meshes
            group = state._fsdp_param_group
            groups = [] if group is None else [group]
        for group in groups:
            yield from group.fsdp_params
