"""One rank of a torchrun job, as its code sees CUDA and ``torch.distributed``, on a fake group.

A ``file.py:function`` written for FSDP2 or DDP as people write it assumes ``torchrun`` and CUDA::

    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    with torch.device("cuda"):
        model = Transformer(...)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    batch = torch.randint(0, vocab, (8, 1024), device="cuda")

``distributed.trace_distributed_step`` records rank 0 on a fake process group, under
``FakeTensorMode``, on a ``cpu`` mesh (torch/testing/_internal/distributed/fake_pg.py: the
``"fake"`` backend). While :func:`as_cuda_rank` is open, that code runs there unchanged:

- CUDA is one emulated GPU (``cuda_device.as_one_cuda_gpu(lands_on="cpu")``):
  ``torch.cuda.is_available()``, ``get_device_properties``, ``current_device``, ``set_device``
  answer as on the target GPU, and tensors made or moved to ``cuda`` (``device="cuda"``,
  ``.to("cuda", non_blocking=True)``, ``.cuda()``, ``Module.to``, ``torch.device("cuda")`` as a
  context) land on the fake device, where the recorder counts them as device memory.
- The environment is torchrun's for rank 0 (torch/distributed/run.py sets ``RANK``,
  ``LOCAL_RANK`` and ``WORLD_SIZE`` for each worker).
- ``torch.distributed.init_process_group(...)`` joins the fake group already made: whatever the
  backend asked (``"nccl"``), the group stays the fake backend, which stands for it (its
  collectives allocate their outputs as NCCL's do, and return at once). A ``world_size`` or
  ``rank`` given that is not the recorded one is refused. ``destroy_process_group()`` leaves it
  to the recording, which destroys it when done.
- ``init_device_mesh("cuda", shape)`` makes the mesh on the fake device (``cpu``), outside
  ``FakeTensorMode`` as a mesh must be (``distributed._meshes_on_the_host``). Each mesh made is
  noted (``meshes``): a script's layout is its mesh's (``script_layout``), a process group
  per dimension and so an NCCL communicator each.
- ``DistributedDataParallel(model, device_ids=[local_rank], output_device=local_rank)``: the
  device ids are dropped; on one device DDP needs none (torch/nn/parallel/distributed.py
  ``__init__``: "For single-device modules, ``device_ids`` can contain exactly one device id
  ... or ``None``"), and a module on the fake device must have none.
- ``torch.cuda.device_count()`` is the node's GPUs, as each torchrun worker sees them (the
  ranks up to ``DEFAULT_GPUS_PER_NODE``): Lightning's ``Trainer(devices=4)`` checks it.
- ``model.to(local_rank)``: a bare index is CUDA's (``module_moves.module_to_index_is_cuda``).
- ``torch.distributed.is_nccl_available()`` is True, as on a CUDA build
  (``collectives.nccl_said_available``): a script's ``"nccl" if dist.is_nccl_available() else
  "gloo"`` asks for NCCL.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from oomkit.core.gpus import GpuSpec
from oomkit.core.gpus.nccl import DEFAULT_GPUS_PER_NODE
from oomkit.core.target import ParallelLayout
from oomkit.errors import ConfigError
from oomkit.prediction.tracing.collectives import (
    async_collectives_complete_with_outputs,
    nccl_said_available,
)
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu

__all__ = ["MeshShape", "as_cuda_rank", "script_layout"]

# A device mesh made by the code: its sizes, outermost first, and its dimension names (or None).
MeshShape = tuple[tuple[int, ...], tuple[str, ...] | None]

# A mesh dimension's role, by the words its name holds, tried in order ("dp_replicate" is DDP's
# replicas and "dp_shard" FSDP2's: torchtitan/distributed/parallel_dims.py build_mesh).
_ROLE_WORDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tp", ("tp", "tensor")),
    ("pp", ("pp", "pipe")),
    ("cp", ("cp", "context")),
    ("dp", ("replicate", "ddp")),
    ("fsdp", ("shard", "fsdp", "dp", "data")),
)

# The names under which torch exports init_device_mesh and init_process_group: user code and
# FSDP2 (_fsdp_init.py) call whichever they imported.
_MESH_MODULES = (
    "torch.distributed.device_mesh",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp._fully_shard._fsdp_init",
)
_GROUP_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")


@contextlib.contextmanager
def as_cuda_rank(
    world_size: int,
    *,
    rank: int = 0,
    gpu: GpuSpec | None = None,
    meshes: list[MeshShape] | None = None,
) -> Iterator[None]:
    """While open, code written for torchrun on CUDA runs as ``rank`` of the fake group.

    Open it inside ``distributed.fake_process_group`` and ``FakeTensorMode`` (module docstring).

    Args:
        world_size: the ranks of the fake group.
        rank: the rank recorded.
        gpu: the GPU ``torch.cuda`` reports; ``None``: an enclosing block's, else an H100.
        meshes: where to note each ``init_device_mesh`` the code makes; ``None``: not noted.
    """
    with contextlib.ExitStack() as stack:
        # A torchrun worker sees its node's GPUs (Lightning's Trainer(devices=4) checks them).
        devices = min(world_size, DEFAULT_GPUS_PER_NODE)
        stack.enter_context(as_one_cuda_gpu(gpu, lands_on="cpu", devices=devices))
        stack.enter_context(_torchrun_environment(world_size, rank))
        stack.enter_context(_the_fake_group_joined(world_size, rank))
        stack.enter_context(_cuda_meshes_on_the_fake_device(meshes))
        stack.enter_context(_ddp_device_ids_dropped())
        stack.enter_context(async_collectives_complete_with_outputs())
        stack.enter_context(nccl_said_available())
        yield


@contextlib.contextmanager
def _torchrun_environment(world_size: int, rank: int) -> Iterator[None]:
    """``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` as torchrun sets them
    (a node holds up to ``DEFAULT_GPUS_PER_NODE`` ranks, numbered node by node: rank 9 of 16 is
    local rank 1 of the second node, torch/distributed/elastic/agent/server/api.py
    ``_assign_worker_ranks``)."""
    per_node = min(world_size, DEFAULT_GPUS_PER_NODE)
    values = {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % per_node),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(per_node),
    }
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, before in saved.items():
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before


def _patched_everywhere(modules: tuple[str, ...], name: str, value: Any) -> contextlib.ExitStack:
    """``name`` is ``value`` in each of ``modules`` that defines it, until the stack closes."""
    stack = contextlib.ExitStack()
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is None or not hasattr(module, name):
            continue
        original = getattr(module, name)
        setattr(module, name, value)
        stack.callback(setattr, module, name, original)
    return stack


@contextlib.contextmanager
def _the_fake_group_joined(world_size: int, rank: int) -> Iterator[None]:
    """``init_process_group`` joins the fake group; ``destroy_process_group`` leaves it be."""
    import torch.distributed as dist

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        for name, recorded in (("world_size", world_size), ("rank", rank)):
            asked = kwargs.get(name, -1)
            if asked not in (-1, recorded):
                raise ConfigError(
                    f"init_process_group({name}={asked}) in the code, but oomkit records "
                    f"{name} {recorded} of this layout; give the same number of ranks to "
                    "--fsdp/--dp/--tp, or read them from the environment (WORLD_SIZE, RANK) "
                    "as torchrun sets them"
                )
        if not dist.is_initialized():  # pragma: no cover - opened outside fake_process_group
            raise ConfigError("as_cuda_rank is opened inside distributed.fake_process_group")

    def destroy_process_group(group: Any = None) -> None:
        return None

    import torch.distributed.distributed_c10d  # noqa: F401 - the module patched below

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched_everywhere(_GROUP_MODULES, "init_process_group", init_process_group))
        stack.enter_context(
            _patched_everywhere(_GROUP_MODULES, "destroy_process_group", destroy_process_group)
        )
        yield


@contextlib.contextmanager
def _cuda_meshes_on_the_fake_device(meshes: list[MeshShape] | None) -> Iterator[None]:
    """``init_device_mesh("cuda", ...)`` is a ``cpu`` mesh, made with the fake mode paused
    (and noted in ``meshes``)."""
    # Imported first, so the names they bound from device_mesh are there to patch.
    import torch.distributed.fsdp._fully_shard._fsdp_init
    import torch.distributed.tensor  # noqa: F401
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed import device_mesh

    original: Callable[..., Any] = device_mesh.init_device_mesh

    def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
        if device_type.split(":")[0] == "cuda":
            device_type = "cpu"
        with unset_fake_temporarily():
            mesh = original(device_type, *args, **kwargs)
            if meshes is not None:  # its rank tensor is a host tensor, read outside the fake mode
                meshes.append((tuple(mesh.mesh.shape), mesh.mesh_dim_names))
        return mesh

    with _patched_everywhere(_MESH_MODULES, "init_device_mesh", init_device_mesh):
        yield


@contextlib.contextmanager
def _ddp_device_ids_dropped() -> Iterator[None]:
    """``DistributedDataParallel(..., device_ids=[i], output_device=i)`` runs without them."""
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__

    def init(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        # (module, device_ids=None, output_device=None, dim=0, ...): the first two after module.
        args = tuple(None if i < 2 else a for i, a in enumerate(args))
        kwargs.pop("device_ids", None)
        kwargs.pop("output_device", None)
        original(ddp, module, *args, **kwargs)

    DistributedDataParallel.__init__ = init  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        DistributedDataParallel.__init__ = original  # type: ignore[method-assign]


def script_layout(
    world_size: int, ddp_wrapped: bool, meshes: list[MeshShape]
) -> tuple[ParallelLayout, str | None]:
    """A torchrun script's layout for NCCL's communicators, and a note where it is a guess.

    The script's device mesh of the most dimensions over all ``world_size`` ranks (the last
    such) gives one communicator per dimension of more than one rank, as torch makes a process
    group per dimension (torch/distributed/device_mesh.py ``_init_process_groups``); its
    dimension names give their roles (``_ROLE_WORDS``). Without a mesh of more than one
    dimension: ``dp`` when the script wrapped DDP, else ``fsdp`` (one communicator over all).
    """
    whole = [m for m in meshes if math.prod(m[0]) == world_size]
    shape, names = max(reversed(whole), key=lambda m: len(m[0]), default=((world_size,), None))
    if len(shape) == 1 and (names is None or _role(names[0]) is None):
        one = ParallelLayout(dp=world_size) if ddp_wrapped else ParallelLayout(fsdp=world_size)
        return one, None
    roles: list[str | None] = (
        [None] * len(shape) if names is None else [_role(name) for name in names]
    )
    if None in roles or len(set(roles)) < len(roles):
        # No names, or two dimensions of one role: replicas outermost, then shards, then TP.
        guess = ("dp", "fsdp", "tp", "cp", "pp")[: len(shape)]
        if len(shape) > len(guess):
            return ParallelLayout(fsdp=world_size), None
        said = ", ".join(f"{n} {s}" for n, s in zip(guess, shape, strict=True))
        note = (
            f"the script's device mesh {tuple(shape)} (names {names}) does not name each "
            f"dimension's role: NCCL's communicators are counted as {said}"
        )
        roles = list(guess)
    else:
        note = None
    degrees = {role: size for role, size in zip(roles, shape, strict=True) if role is not None}
    return ParallelLayout(**degrees), note


def _role(name: str) -> str | None:
    lowered = name.lower()
    return next((role for role, words in _ROLE_WORDS if any(w in lowered for w in words)), None)
