"""How much device memory the CUDA context takes outside PyTorch's caching allocator.

The context is a function of three things (issue 14 item 3):

- the GPU architecture, read from the compute capability (kernel images grow with the SM count
  and the ISA), so every catalog entry -- and any added later -- is covered by its capability;
- the CUDA version: lazy module loading exists from CUDA 11.7 (NVIDIA, CUDA C++ Programming
  Guide, "Lazy Loading": introduced in 11.7, the driver default from 12.2), and PyTorch sets
  ``CUDA_MODULE_LOADING=LAZY`` when the user has not set it from 1.13 on (pytorch/pytorch
  PR #86509, ``torch/cuda/__init__.py`` ``_lazy_init``);
- the module-loading mode: ``eager`` with CUDA < 11.7 or ``CUDA_MODULE_LOADING=EAGER`` loads
  every kernel of every library at context creation, about 1 GiB more.

Every figure is an ESTIMATE with its source beside it; the real number also grows with the
kernels a workload touches (cuDNN, cuBLAS, NCCL, Triton) and with the driver. ``CudaContext``
carries a range (``low_bytes``..``high_bytes``) for that uncertainty; ``oomkit explain`` uses the
range, predictions the point figure. Measure it as ``nvidia-smi`` used memory minus
``torch.cuda.memory_reserved()`` and pass ``context_overhead_bytes=`` to override.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from oomkit.core.gpus.spec import Architecture
from oomkit.units import GiB, MiB, format_bytes

__all__ = [
    "CONTEXT_OVERHEAD_BYTES",
    "DEFAULT_CONTEXT_OVERHEAD_BYTES",
    "LAZY_LOADING_MIN_CUDA",
    "CudaContext",
    "ModuleLoading",
    "context_overhead_bytes",
    "context_overhead_note",
    "cuda_context",
    "module_loading_for",
]

ModuleLoading = Literal["lazy", "eager"]

# NVIDIA CUDA C++ Programming Guide, "Lazy Loading": available from CUDA 11.7; PyTorch 1.13+
# enables it (PR #86509). Older CUDA loads every module eagerly.
LAZY_LOADING_MIN_CUDA = (11, 7)


@dataclass(frozen=True)
class _Family:
    """The lazy-loading context of one architecture family, with its source."""

    name: str
    lazy_bytes: int
    source: str


# --- lazy loading (CUDA >= 11.7), per family, by compute capability ---------------------------
# Up to Turing (sm_5x-sm_75): ~300 MiB. pytorch/pytorch#107667 (ptrblck, 2023-08): "the currently
# used ~300MB" for the CUDA context with lazy loading; PR #86509 measured total - free =
# 287,047,680 bytes after one 6.4 MB tensor with LAZY.
_PRE_AMPERE = _Family("Volta/Turing and older", 300 * MiB, "pytorch/pytorch#107667, PR #86509")
# Ampere (sm_80-sm_87): ~400 MiB. pytorch/pytorch#109888 (ptrblck, 2023-09): "The first CUDA
# operation will create the CUDA context which uses around 400MB if CUDA >= 11.7 is used and lazy
# module loading enabled (default in PyTorch)".
_AMPERE = _Family("Ampere", 400 * MiB, "pytorch/pytorch#109888")
# Ada Lovelace (sm_89): ~430 MiB. unslothai/unsloth-zoo PR #1053 (2026-08) measured 426 MiB in
# nvidia-smi after torch.cuda.mem_get_info(0) created the context on an RTX 6000 Ada, PyTorch
# 2.10.0+cu130.
_ADA = _Family("Ada Lovelace", 430 * MiB, "426 MiB measured, unsloth-zoo PR #1053")
# Hopper (sm_90): 718,077,952 bytes (685 MiB), measured on an H200 for this project
# (2026-11-29, driver 580, CUDA 13.0, torch 2.11.0+cu130, lazy loading): total - free - reserved
# after the first op and a cuBLAS matmul (scripts/validate_fidelity_on_gpu.py,
# validation/fidelity-nvidia-h200-torch2.11.0.json; eager loading measured 1,823,277,056). The
# H100 is the same sm_90; other drivers and CUDA versions may differ by tens of MiB.
_HOPPER = _Family("Hopper", 718_077_952, "685 MiB measured on an H200, CUDA 13.0 (validation/)")
# Blackwell (sm_100, sm_120): ~550 MiB. Estimate extrapolated from Hopper's earlier 500 MiB
# estimate (sm_100 images are larger again), set before Hopper was measured at 685 MiB: likely
# low. No published measurement found.
_BLACKWELL = _Family("Blackwell", 550 * MiB, "extrapolated estimate; no published figure")

# The smallest bare lazy context measured: 256 MiB (invoke-ai/InvokeAI#9413, RTX 3090, torch
# 2.7.1+cu128, "a flat 256 MiB" held by a process that had only created its context). The low end
# of every range.
_LAZY_LOW_BYTES = 256 * MiB
# What libraries add on first use outside the caching allocator: cuBLAS and cuDNN kernels loaded
# lazily into the context, their handles, NCCL communicator buffers. Up to ~800 MiB more: the
# memory outside the allocator in real OOM messages of a single process reaches 0.3-1.3 GiB
# (issue 14 item 5's survey; tests/diagnose/cases/real_messages.py), the top of which is the
# ~500 MiB context plus this. The high end of every range.
_LIBRARIES_HIGH_BYTES = 800 * MiB
# Eager loading: every kernel of every loaded library at context creation. About 1 GiB more
# (pytorch/pytorch#107667, ptrblck: "Before CUDA 11.7, *all* kernels were loaded into the context
# once the library was loaded, which took >1000MB"). Range: PR #86509 measured 379,584,512 bytes
# more with eager (666,632,192 - 287,047,680; torch 1.13 + CUDA 11.7) and pytorch/pytorch#55277
# 1687 MB on an RTX 3090 with torch 1.8.2+cu111 (eager), ~1.3 GiB above the Ampere lazy figure.
_EAGER_EXTRA_BYTES = 1 * GiB
_EAGER_EXTRA_LOW_BYTES = 379_584_512
_EAGER_EXTRA_HIGH_BYTES = 1300 * MiB
_EAGER_SOURCE = "eager loading adds ~1 GiB: pytorch/pytorch#107667, PR #86509, #55277"


def _family(compute_capability: tuple[int, int] | None) -> _Family | None:
    if compute_capability is None:
        return None
    major, minor = compute_capability
    if major >= 10:
        return _BLACKWELL
    if major == 9:
        return _HOPPER
    if (major, minor) >= (8, 9):
        return _ADA
    if major == 8:
        return _AMPERE
    return _PRE_AMPERE


@dataclass(frozen=True)
class CudaContext:
    """The CUDA context assumed for one GPU, CUDA version and loading mode.

    Attributes:
        expected_bytes: the point estimate (what a prediction reserves outside the allocator).
        low_bytes: the least it is likely to be (a bare context).
        high_bytes: the most it is likely to be with cuBLAS, cuDNN and NCCL loaded; memory
            outside the allocator above this is something else (other processes).
        cuda_version: the CUDA version assumed (``"13.0"``); ``None``: not known.
        module_loading: ``"lazy"`` or ``"eager"``.
        loading_reason: why that mode (``"CUDA 13.0 >= 11.7"``, ``"CUDA_MODULE_LOADING=EAGER"``).
        family: the architecture family the figure is for (``"Hopper"``, ``"a typical GPU"``).
        source: where the figure comes from.
    """

    expected_bytes: int
    low_bytes: int
    high_bytes: int
    cuda_version: str | None
    module_loading: ModuleLoading
    loading_reason: str
    family: str
    source: str

    def describe(self) -> str:
        """One line for reports: ``~685 MiB (Hopper, CUDA 13.0, lazy module loading; ...)``."""
        cuda = f"CUDA {self.cuda_version}" if self.cuda_version else "CUDA version not known"
        return (
            f"~{format_bytes(self.expected_bytes)} ({format_bytes(self.low_bytes)}-"
            f"{format_bytes(self.high_bytes)}) for {self.family}, {cuda}, {self.module_loading} "
            f"module loading ({self.loading_reason}); {self.source}"
        )


def _cuda_tuple(cuda_version: str) -> tuple[int, int] | None:
    parts = cuda_version.strip().split(".")
    if len(parts) < 2 or not all(part.isdigit() for part in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])


def module_loading_for(
    cuda_version: str | None, environ: Mapping[str, str] | None = None
) -> tuple[ModuleLoading, str]:
    """The module-loading mode a process with this CUDA runs, and why.

    Args:
        cuda_version: the CUDA runtime of the torch build (``"12.8"``); ``None``: unknown (lazy,
            as every torch release since 1.13 with its default wheel).
        environ: the environment of the job; its ``CUDA_MODULE_LOADING`` wins (``EAGER``; PyTorch
            sets ``LAZY`` only when the variable is unset).

    Returns:
        ``("lazy" | "eager", reason)``.
    """
    setting = (environ or {}).get("CUDA_MODULE_LOADING", "").strip().upper()
    version = _cuda_tuple(cuda_version) if cuda_version else None
    if version is not None and version < LAZY_LOADING_MIN_CUDA:
        return "eager", f"CUDA {cuda_version} < 11.7 has no lazy loading"
    if setting == "EAGER":
        return "eager", "CUDA_MODULE_LOADING=EAGER"
    if setting == "LAZY":
        return "lazy", "CUDA_MODULE_LOADING=LAZY"
    if version is None:
        return "lazy", "PyTorch's default since 1.13"
    return "lazy", f"CUDA {cuda_version} >= 11.7, PyTorch's default"


def cuda_context(
    compute_capability: tuple[int, int] | None,
    cuda_version: str | None = None,
    module_loading: ModuleLoading | None = None,
) -> CudaContext:
    """The CUDA context of a GPU with this compute capability under this CUDA and loading mode.

    Args:
        compute_capability: ``(major, minor)``; ``None`` for a device given only by its size
            (the Ampere figure, the middle of the range).
        cuda_version: the torch build's CUDA (``"12.8"``); ``None``: unknown.
        module_loading: ``"lazy"`` or ``"eager"``; ``None``: from ``cuda_version``
            (``module_loading_for``).

    Returns:
        The context, with its range and sources.
    """
    if module_loading is None:
        module_loading, reason = module_loading_for(cuda_version)
    else:
        reason = "as given"
    family = _family(compute_capability)
    base = family or _Family("a typical GPU", DEFAULT_CONTEXT_OVERHEAD_BYTES, _AMPERE.source)
    low, expected = min(_LAZY_LOW_BYTES, base.lazy_bytes), base.lazy_bytes
    high = expected + _LIBRARIES_HIGH_BYTES
    source = f"lazy figure: {base.source}"
    if module_loading == "eager":
        low += _EAGER_EXTRA_LOW_BYTES
        expected += _EAGER_EXTRA_BYTES
        high += _EAGER_EXTRA_HIGH_BYTES
        source += f"; {_EAGER_SOURCE}"
    return CudaContext(
        expected_bytes=expected,
        low_bytes=low,
        high_bytes=high,
        cuda_version=cuda_version,
        module_loading=module_loading,
        loading_reason=reason,
        family=base.name,
        source=source,
    )


# The catalog's per-architecture figure (lazy loading): one capability per family.
_ARCHITECTURE_CAPABILITY: dict[str, tuple[int, int]] = {
    "Maxwell": (5, 0),
    "Pascal": (6, 0),
    "Volta": (7, 0),
    "Turing": (7, 5),
    "Ampere": (8, 0),
    "Ada Lovelace": (8, 9),
    "Hopper": (9, 0),
    "Blackwell": (10, 0),
}

CONTEXT_OVERHEAD_BYTES: dict[Architecture, int] = {
    "Pascal": _PRE_AMPERE.lazy_bytes,
    "Volta": _PRE_AMPERE.lazy_bytes,
    "Turing": _PRE_AMPERE.lazy_bytes,
    "Ampere": _AMPERE.lazy_bytes,
    "Ada Lovelace": _ADA.lazy_bytes,
    "Hopper": _HOPPER.lazy_bytes,
    "Blackwell": _BLACKWELL.lazy_bytes,
}

# A device given only by its size (``--gpu 24GiB``): ptrblck's "around 400MB" for CUDA >= 11.7
# with lazy loading (pytorch/pytorch#109888), the middle of the per-family range above.
DEFAULT_CONTEXT_OVERHEAD_BYTES = 400 * MiB


def context_overhead_bytes(
    architecture: str | None, compute_capability: tuple[int, int] | None = None
) -> int:
    """The estimated lazy-loading CUDA context for an architecture (or compute capability), in
    bytes; the default for a device given only by its size or an architecture not known here."""
    capability = compute_capability or _ARCHITECTURE_CAPABILITY.get(architecture or "")
    return cuda_context(capability, module_loading="lazy").expected_bytes


def context_overhead_note(
    architecture: str | None, compute_capability: tuple[int, int] | None = None
) -> str:
    """The source note that goes with ``context_overhead_bytes(architecture)``."""
    capability = compute_capability or _ARCHITECTURE_CAPABILITY.get(architecture or "")
    context = cuda_context(capability, module_loading="lazy")
    return (
        f"context overhead: estimate ~{format_bytes(context.expected_bytes)} with lazy module "
        f"loading (CUDA >= 11.7) for {context.family} ({context.source.removeprefix('lazy figure: ')}"
        "); eager loading adds ~1 GiB"
    )
