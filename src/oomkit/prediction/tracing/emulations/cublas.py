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
  default on open-source builds) cuBLASLt shares the cuBLAS workspace of the stream (allocating
  it if cuBLASLt comes first); otherwise it has its own map with ``CUBLASLT_WORKSPACE_SIZE``
  KiB (default 1024 KiB) per stream.

The map is thread-local and autograd runs CUDA backward on its own device thread, so forward
and backward each get a workspace. Which GEMMs go through cuBLASLt is approximated: ``addmm``
with a 1-D bias and ``_addmm_activation`` (Blas.cpp ``addmm_out_cuda_impl`` useLtInterface);
this only matters with the unified workspace turned off.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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


def cublaslt_unified(environ: Mapping[str, str] | None = None) -> bool:
    """``unified_cublas_and_lt_workspaces()``: unset or a true value means unified."""
    env = os.environ if environ is None else environ
    value = env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    # c10::utils::check_env: "1"/"ON"/"YES"/"TRUE"/"Y" true, "0"/"OFF"/... false.
    return value is None or value.strip().upper() not in {"0", "OFF", "NO", "FALSE", "N"}


def cublaslt_workspace_bytes(gpu: GpuSpec, environ: Mapping[str, str] | None = None) -> int:
    """``getCUDABlasLtWorkspaceSize()``: the cuBLASLt workspace when it is not unified.

    ``CUBLASLT_WORKSPACE_SIZE`` in KiB (default 1024, or the cuBLAS size in KiB when unified);
    when unified it is capped at the cuBLAS workspace size.
    """
    env = os.environ if environ is None else environ
    cublas = cublas_workspace_bytes(gpu, env)
    unified = cublaslt_unified(env)
    size_kib = cublas // 1024 if unified else _LT_DEFAULT_KIB
    raw = env.get("CUBLASLT_WORKSPACE_SIZE")
    if raw is not None:
        try:
            size_kib = int(raw)
        except ValueError:
            pass  # PyTorch warns "invalid CUBLASLT_WORKSPACE_SIZE" and keeps the default
    size = size_kib * 1024
    return min(size, cublas) if unified else size


def register_cublas(registry: EmulationRegistry, environ: Mapping[str, str] | None = None) -> None:
    """Add a workspace hook for every op in ``CUBLAS_OPS`` to ``registry``.

    Args:
        registry: where to register.
        environ: environment read when the first GEMM runs; default ``os.environ`` (read then).
    """

    def hook(ctx: EmulationContext) -> Any:
        _ensure_workspace(ctx, environ)
        return ctx.run()

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
    ctx: EmulationContext, environ: Mapping[str, str] | None, stream: int = 0
) -> None:
    leaves = [a for a in ctx.args if hasattr(a, "device")]
    if not leaves or any(not stands_for_cuda(a) for a in leaves):
        return
    assert ctx.gpu is not None
    env = os.environ if environ is None else environ
    # Autograd's device thread runs CUDA backward; everything else runs on the caller's thread.
    thread = "autograd" if ctx.phase == "backward" else "main"
    lt_separate = _uses_lt(ctx) and not cublaslt_unified(env)
    key = (thread, stream, "cublaslt" if lt_separate else "cublas")
    seen: set[tuple[str, int, str]] = ctx.state.setdefault(_STATE_KEY, set())
    if key in seen:
        return
    seen.add(key)
    if lt_separate:
        size, what = cublaslt_workspace_bytes(ctx.gpu, env), "cublaslt_workspace"
    else:
        size, what = cublas_workspace_bytes(ctx.gpu, env), "cublas_workspace"
    if size > 0:  # CUDACachingAllocator::allocate(0) returns an empty DataPtr
        ctx.allocate(size, "workspace", what)
