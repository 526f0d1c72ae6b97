"""How independent work runs: in this process, in forked processes, or on a Ray cluster.

``executor.py`` is the one interface (``Executor.map``) and its three kinds; ``forked.py`` is
the fork pool under the local kind, and the one call the caller goes on beside
(``ForkedCall``: a batch search traces ahead). Processes and signals live here, above core,
which stays pure.
"""

from __future__ import annotations

from oomkit.executors.executor import (
    Executor,
    ExecutorKind,
    InProcessExecutor,
    LocalPoolExecutor,
    RayExecutor,
    make_executor,
)
from oomkit.executors.forked import (
    ForkedCall,
    ForkedCallFailed,
    fork_available,
    memory_worker_cap,
    process_count,
    replay_settings,
    run_forked,
    run_forked_or_here,
    worker_count,
)

__all__ = [
    "Executor",
    "ExecutorKind",
    "ForkedCall",
    "ForkedCallFailed",
    "InProcessExecutor",
    "LocalPoolExecutor",
    "RayExecutor",
    "fork_available",
    "make_executor",
    "memory_worker_cap",
    "process_count",
    "replay_settings",
    "run_forked",
    "run_forked_or_here",
    "worker_count",
]
