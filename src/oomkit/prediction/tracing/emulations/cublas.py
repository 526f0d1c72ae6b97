"""cuBLAS / cuBLASLt workspaces: taken from the caching allocator on a stream's first GEMM.

Mirrors aten/src/ATen/cuda/CublasHandlePool.cpp of torch 2.13 (the version with
``setChosenWorkspaceSize`` and the unified Lt workspace):

- ``getCurrentCUDABlasHandle`` calls ``setCublasWorkspace``: the first cuBLAS call per
  (device, stream) in a thread allocates ``getChosenWorkspaceSize()`` bytes with
  ``CUDACachingAllocator::allocate`` and keeps them in a thread-local map until
  ``torch._C._cuda_clearCublasWorkspaces()``: never freed within a step.
- ``parseChosenWorkspaceSize``: ``CUBLAS_WORKSPACE_CONFIG`` is a list of ``:SIZE:COUNT`` pairs
  (SIZE in KiB), summed; unset or unparsable means the default, 32 MiB on compute capability
  9.x / 10.x / 12.x and ``:4096:2:16:8`` (8 MiB + 128 KiB) elsewhere.
- ``getCUDABlasLtWorkspace``: with ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset or true (the
  default on open-source builds from torch 2.12) cuBLASLt shares the cuBLAS workspace of the
  stream; otherwise it has its own map with ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024 KiB)
  per stream. Either way the Lt handle is the cuBLAS handle (``getCurrentCUDABlasLtHandle``
  casts ``getCurrentCUDABlasHandle()``, which sets the cuBLAS workspace), so a first Lt GEMM
  allocates the cuBLAS workspace, then a separate Lt one where there is one.
- Torch 2.9 to 2.11 (persistent Lt workspaces, pytorch#156495, until pytorch#175879 of
  2026-03-02 "Fix unified workspace env var handling"): the size parser took an unset variable
  as unified but ``getCUDABlasLtWorkspace`` required it set true, so by default the Lt workspace
  was separate, ``min(1024 KiB, cuBLAS size)``. Measured on an H200 under torch 2.11
  (validation/fidelity-nvidia-h200-torch2.11.0.json): the first bf16 ``addmm`` with a bias asked
  for its output, the 32 MiB cuBLAS workspace, then 1 MiB. Before 2.9 the Lt workspace was
  taken and returned per call; not modelled (those versions get 2.9's rule).

Every GEMM allocates its output (Blas.cpp ``addmm_out_cuda_impl``: ``resize_output`` first)
before it asks for the handle, so the workspace comes after the op's own allocations. The map
is thread-local and autograd runs CUDA backward on its own device thread, so forward and
backward each get a workspace. Which GEMMs go through cuBLASLt is approximated: ``addmm`` with
a 1-D bias and ``_addmm_activation`` (Blas.cpp ``addmm_out_cuda_impl`` useLtInterface); this
only matters where the Lt workspace is separate.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from oomkit.prediction.tracing._torch_version import torch_minor
from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.core.gpus import GpuSpec
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = [
    "CUBLAS_OPS",
    "cublas_workspace_bytes",
    "cublaslt_workspace_bytes",
    "cublaslt_unified",
    "ensure_cublas_workspace",
    "register_cublas",
]

# Aten ops whose CUDA kernels call cuBLAS (aten/src/ATen/native/cuda/Blas.cpp).
CUBLAS_OPS: tuple[str, ...] = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten.addbmm.default",
    "aten.mv.default",
    "aten.addmv.default",
    "aten.dot.default",
    "aten.vdot.default",
    "aten._addmm_activation.default",
    # aten/src/ATen/cuda/CUDABlas.cpp scaled_gemm (float8): cublasLtMatmul with the Lt workspace.
    "aten._scaled_mm.default",
)
_PAIR_RE = re.compile(r":([0-9]+):([0-9]+)")
# CublasHandlePool.cpp parseChosenWorkspaceSize: 4096 KiB x 8 on Hopper/Blackwell (major 9, 10,
# 12), else ":4096:2:16:8".
_LARGE_DEFAULT_BYTES = 4096 * 8 * 1024
_SMALL_DEFAULT_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
_LARGE_DEFAULT_MAJORS = frozenset({9, 10, 12})
# parseCUDABlasLtWorkspaceSize: 1024 KiB when not unified (#73328).
_LT_DEFAULT_KIB = 1024
# pytorch#175879 (merged 2026-03-02, first in torch 2.12): an unset TORCH_CUBLASLT_UNIFIED_WORKSPACE
# unifies the workspaces; before it, only a true value did.
_UNIFIED_BY_DEFAULT_FROM = (2, 12)
_STATE_KEY = "cublas_workspaces"


def cublas_workspace_bytes(gpu: GpuSpec, environ: Mapping[str, str] | None = None) -> int:
    """``getChosenWorkspaceSize()`` on ``gpu``: the cuBLAS workspace per (thread, stream).

    Args:
        gpu: the target device (its compute capability picks the default).
        environ: environment to read ``CUBLAS_WORKSPACE_CONFIG`` from; default ``os.environ``.

    Returns:
        Bytes; 0 when the config sums to 0 (no allocation happens).
    """
    env = os.environ if environ is None else environ
    major = gpu.kernel_compute_capability[0]
    default = _LARGE_DEFAULT_BYTES if major in _LARGE_DEFAULT_MAJORS else _SMALL_DEFAULT_BYTES
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    pairs = _PAIR_RE.findall(config)
    if not pairs:
        return default  # PyTorch warns "Could not parse CUBLAS_WORKSPACE_CONFIG" and uses it
    return sum(int(size_kib) * 1024 * int(count) for size_kib, count in pairs)


@functools.lru_cache(maxsize=8)  # asked per GEMM with a bias; a version string parses once
def _unified_by_default(torch_version: str | None) -> bool:
    version = torch_minor(torch_version) if torch_version is not None else None
    return version is None or version >= _UNIFIED_BY_DEFAULT_FROM


def _set_true(value: str) -> bool:
    # c10::utils::check_env: "1"/"ON"/"YES"/"TRUE"/"Y" true, "0"/"OFF"/... false.
    return value.strip().upper() not in {"0", "OFF", "NO", "FALSE", "N"}


def cublaslt_unified(
    environ: Mapping[str, str] | None = None, torch_version: str | None = None
) -> bool:
    """Whether cuBLASLt runs in the cuBLAS workspace (``getCUDABlasLtWorkspace``).

    Args:
        environ: where ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is read; default ``os.environ``.
        torch_version: the torch that runs (``None``: the newest rule). Unset means unified
            from torch 2.12, separate before.
    """
    env = os.environ if environ is None else environ
    value = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if value is None:
        return _unified_by_default(torch_version)
    return _set_true(value)


def cublaslt_workspace_bytes(
    gpu: GpuSpec, environ: Mapping[str, str] | None = None, torch_version: str | None = None
) -> int:
    """``getCUDABlasLtWorkspaceSize()``: the cuBLASLt workspace when it is not unified.

    ``CUBLASLT_WORKSPACE_SIZE`` in KiB (default 1024, or from torch 2.12 the cuBLAS size in KiB
    when unified); capped at the cuBLAS workspace size when the size parser takes the variable
    as unified (unset or true: every torch with persistent Lt workspaces, 2.9 on).
    """
    env = os.environ if environ is None else environ
    cublas = cublas_workspace_bytes(gpu, env)
    # The size parser reads an unset variable as unified in every version modelled.
    value = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    capped = value is None or _set_true(value)
    size_kib = cublas // 1024 if cublaslt_unified(env, torch_version) else _LT_DEFAULT_KIB
    raw = env.get("CUBLASLT_WORKSPACE_SIZE")
    if raw is not None:
        try:
            size_kib = int(raw)
        except ValueError:
            pass  # PyTorch warns "invalid CUBLASLT_WORKSPACE_SIZE" and keeps the default
    size = size_kib * 1024
    return min(size, cublas) if capped else size


def register_cublas(
    registry: EmulationRegistry,
    environ: Mapping[str, str] | None = None,
    *,
    torch_version: str | None = None,
) -> None:
    """Add a workspace hook for every op in ``CUBLAS_OPS`` to ``registry``.

    Args:
        registry: where to register.
        environ: environment read when the first GEMM runs; default ``os.environ`` (read then).
        torch_version: the torch whose rules apply (the target's); ``None``: this install's.
    """

    def hook(ctx: EmulationContext) -> Any:
        out = ctx.run()
        _ensure_workspace(ctx, environ, torch_version=torch_version, outputs=out)
        return out

    for op_name in CUBLAS_OPS:
        registry.register(op_name)(hook)


def _uses_lt(ctx: EmulationContext) -> bool:
    if ctx.op_name in ("aten._addmm_activation.default", "aten._scaled_mm.default"):
        return True
    bias = ctx.args[0] if ctx.args else None
    return ctx.op_name == "aten.addmm.default" and getattr(bias, "dim", lambda: 0)() == 1


def ensure_cublas_workspace(ctx: EmulationContext, stream: int = 0) -> None:
    """The cuBLAS workspace of ``ctx``'s thread and ``stream``, allocated if it is not yet.

    For a kernel that runs GEMMs itself (a fused op's ``mm.out`` calls, on its own stream too:
    prediction/tracing/async_tp.py); ``stream`` keys the workspace (0: the stream current when
    ``ctx``'s op runs), and the caller makes that stream current around the call.
    """
    _ensure_workspace(ctx, None, stream)


def _ensure_workspace(
    ctx: EmulationContext,
    environ: Mapping[str, str] | None,
    stream: int = 0,
    torch_version: str | None = None,
    outputs: Any = None,
) -> None:
    leaves = [a for a in ctx.args if hasattr(a, "device")]
    if not leaves or any(not stands_for_cuda(a) for a in leaves):
        return
    assert ctx.gpu is not None
    env = os.environ if environ is None else environ
    # Autograd's device thread runs CUDA backward; everything else runs on the caller's thread.
    thread = "autograd" if ctx.phase == "backward" else "main"
    # The Lt handle is the cuBLAS handle: its getter sets the cuBLAS workspace first.
    version = torch.__version__ if torch_version is None else torch_version
    kinds = ["cublas"]
    if _uses_lt(ctx) and not cublaslt_unified(env, version):
        kinds.append("cublaslt")
    seen: set[tuple[str, int, str]] = ctx.state.setdefault(_STATE_KEY, set())
    for kind in kinds:
        key = (thread, stream, kind)
        if key in seen:
            continue
        seen.add(key)
        if kind == "cublas":
            size = cublas_workspace_bytes(ctx.gpu, env)
        else:
            size = cublaslt_workspace_bytes(ctx.gpu, env, version)
        if size > 0:  # CUDACachingAllocator::allocate(0) returns an empty DataPtr
            if outputs is not None:
                # Blas.cpp: the output is allocated (resize_output) before the GEMM asks for a
                # handle; recorded now only where a workspace follows it.
                ctx.record_outputs(outputs)
                outputs = None
            ctx.allocate(size, "workspace", f"{kind}_workspace")
