"""``torch.multiprocessing.spawn(train, args, nprocs)`` in a recorded script: its rank runs here.

Tutorials start their ranks without torchrun: ``mp.spawn(train, args=(world_size,),
nprocs=world_size)``, each rank a new process calling ``train(rank, *args)``
(torch/multiprocessing/spawn.py ``spawn`` -> ``start_processes``). A new process would run
without oomkit's emulated CUDA (the ``spawn`` start method starts a fresh interpreter, whose
``init_process_group("nccl")`` then fails on a machine without NCCL), so while a script is
recorded, ``spawn`` and ``start_processes`` call ``fn(rank, *args)`` in this process: the rank
recorded (0 unless ``--rank R``), as torchrun's is under ``--world-size``; the other ranks are
the fake process group's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["spawn_runs_rank"]

# Where torch exports them: the package and its spawn module (mp.spawn, spawn.spawn).
_MODULES = ("torch.multiprocessing", "torch.multiprocessing.spawn")


class _RanRank:
    """What ``spawn(..., join=False)`` returns: a context whose processes are done (the rank ran
    before it was returned; torch's ``ProcessContext.join`` returns True once all exited)."""

    processes: list[Any] = []

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        return True

    def pids(self) -> list[int]:
        return [os.getpid()]


@contextlib.contextmanager
def spawn_runs_rank(rank: int = 0) -> Iterator[None]:
    """While open, ``torch.multiprocessing.spawn`` / ``start_processes`` run ``rank`` of the
    ``nprocs`` here (module docstring; rank 0 where ``nprocs`` has no such rank) and start no
    process."""

    def start(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1,
              join: bool = True, *_: Any, **__: Any) -> Any:
        if nprocs >= 1:
            # torch/multiprocessing/spawn.py _wrap: fn(i, *args) in process i
            fn(rank if rank < nprocs else 0, *args)
        return None if join else _RanRank()

    modules = [importlib.import_module(name) for name in _MODULES]
    saved = [(m, name, getattr(m, name)) for m in modules for name in ("spawn", "start_processes")
             if callable(getattr(m, name, None))]
    for module, name, _ in saved:
        setattr(module, name, start)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
