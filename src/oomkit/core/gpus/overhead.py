"""How much device memory the CUDA context takes outside PyTorch's caching allocator.

Every figure here is an ESTIMATE for PyTorch built with CUDA >= 11.7, where PyTorch sets
``CUDA_MODULE_LOADING=LAZY`` (pytorch/pytorch PR #86509) so kernels load on first use. The real
number grows with the kernels a workload touches (cuDNN, cuBLAS, NCCL, Triton) and with the
driver; measure it as ``nvidia-smi`` used memory minus ``torch.cuda.memory_reserved()`` and pass
``context_overhead_bytes=`` to ``get_gpu`` to override.
"""

from __future__ import annotations

from oomkit.core.gpus.spec import Architecture
from oomkit.units import MiB

__all__ = [
    "CONTEXT_OVERHEAD_BYTES",
    "DEFAULT_CONTEXT_OVERHEAD_BYTES",
    "context_overhead_bytes",
    "context_overhead_note",
]

# Volta and Turing: ~300 MiB. pytorch/pytorch#107667 (ptrblck, 2023-08): "the currently used
# ~300MB" for the CUDA context with lazy loading, ">1000MB" before CUDA 11.7; PR #86509 measured
# total - free = 287,047,680 bytes after one 6.4 MB tensor with LAZY (666,632,192 with DEFAULT).
_PRE_AMPERE_BYTES = 300 * MiB
# Ampere: ~400 MiB. pytorch/pytorch#109888 (ptrblck, 2023-09): "The first CUDA operation will
# create the CUDA context which uses around 400MB if CUDA >= 11.7 is used and lazy module loading
# enabled (default in PyTorch)".
_AMPERE_BYTES = 400 * MiB
# Ada Lovelace: ~430 MiB. unslothai/unsloth-zoo PR #1053 (2026-08) measured 426 MiB in nvidia-smi
# after torch.cuda.mem_get_info(0) created the context on an RTX 6000 Ada, PyTorch 2.10.0+cu130.
_ADA_BYTES = 430 * MiB
# Hopper: ~500 MiB. Estimate, not a published measurement: more SMs and larger sm_90 kernel images
# than Ada; ~500 MiB is the commonly quoted CUDA 12 figure.
_HOPPER_BYTES = 500 * MiB
# Blackwell: ~550 MiB. Estimate extrapolated from Hopper (sm_100 images are larger again); no
# published measurement found.
_BLACKWELL_BYTES = 550 * MiB

CONTEXT_OVERHEAD_BYTES: dict[Architecture, int] = {
    "Pascal": _PRE_AMPERE_BYTES,
    "Volta": _PRE_AMPERE_BYTES,
    "Turing": _PRE_AMPERE_BYTES,
    "Ampere": _AMPERE_BYTES,
    "Ada Lovelace": _ADA_BYTES,
    "Hopper": _HOPPER_BYTES,
    "Blackwell": _BLACKWELL_BYTES,
}

# A device given only by its size (``--gpu 24GiB``): ptrblck's "around 400MB" for CUDA >= 11.7
# with lazy loading (pytorch/pytorch#109888), the middle of the per-family range above.
DEFAULT_CONTEXT_OVERHEAD_BYTES = 400 * MiB

_NOTES: dict[Architecture, str] = {
    "Pascal": "context overhead: estimate ~300 MiB as for Volta (pytorch/pytorch#107667, PR #86509)",
    "Volta": "context overhead: estimate ~300 MiB (pytorch/pytorch#107667, PR #86509)",
    "Turing": "context overhead: estimate ~300 MiB (pytorch/pytorch#107667, PR #86509)",
    "Ampere": "context overhead: estimate ~400 MiB (pytorch/pytorch#109888)",
    "Ada Lovelace": "context overhead: estimate ~430 MiB (426 MiB measured, unsloth-zoo PR #1053)",
    "Hopper": "context overhead: estimate ~500 MiB (no published measurement; override it)",
    "Blackwell": "context overhead: estimate ~550 MiB (extrapolated from Hopper; override it)",
}


def context_overhead_bytes(architecture: Architecture | None) -> int:
    """The estimated CUDA context size for an architecture, in bytes (default when ``None``)."""
    if architecture is None:
        return DEFAULT_CONTEXT_OVERHEAD_BYTES
    return CONTEXT_OVERHEAD_BYTES[architecture]


def context_overhead_note(architecture: Architecture | None) -> str:
    """The source note that goes with ``context_overhead_bytes(architecture)``."""
    if architecture is None:
        return "context overhead: estimate ~400 MiB for CUDA >= 11.7 lazy loading (pytorch/pytorch#109888)"
    return _NOTES[architecture]
