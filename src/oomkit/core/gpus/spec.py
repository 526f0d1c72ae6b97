"""``GpuSpec``: what oomkit needs to know about one CUDA device to predict an OOM.

The memory figure is what PyTorch sees, not what the box says: ``total_memory_bytes`` is
``torch.cuda.get_device_properties(i).total_memory`` (``cudaDeviceProp.totalGlobalMem``, the same
number ``cudaMemGetInfo`` returns as its total), which is the marketing capacity less what the
driver keeps for itself (ECC, page retirement, firmware). From that, the CUDA context and the
kernels it loads take another few hundred MiB outside PyTorch's caching allocator
(``context_overhead_bytes``); the rest is what the allocator can ever reserve.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from oomkit.errors import OomkitError
from oomkit.units import format_bytes

__all__ = [
    "DEFAULT_KERNEL_COMPUTE_CAPABILITY",
    "DEFAULT_KERNEL_MULTIPROCESSOR_COUNT",
    "Architecture",
    "GpuSpec",
    "GpuSpecError",
    "MemorySource",
]

Architecture = Literal["Pascal", "Volta", "Turing", "Ampere", "Ada Lovelace", "Hopper", "Blackwell"]

# How total_memory_bytes was obtained:
# - "cudaDeviceProp": a byte-exact totalGlobalMem, from CUDA's deviceQuery sample output
#   ("Total amount of global memory: N MBytes (B bytes)") or get_device_properties().total_memory;
# - "cudaMemGetInfo": the total half of torch.cuda.mem_get_info(), byte-exact;
# - "derived": only a MiB-rounded print was found (_CudaDeviceProperties(... total_memory=NMB)
#   prints total_memory // 2**20), so the figure is N * 2**20, at most 1 MiB below the truth; or,
#   where no CUDA output was found, a sibling device's figure (same nvidia-smi total), as the
#   entry's note says.
MemorySource = Literal["cudaDeviceProp", "cudaMemGetInfo", "derived"]


# A custom size (``--gpu 24GiB``) names no architecture, yet the SDPA backend, the cuBLAS
# workspace and the mem-efficient backward kernel depend on one: they are chosen as on an H100
# (compute capability 9.0, Hopper), the newest architecture most of the catalog's data-centre
# entries share. Predictions on a custom size say so in their warnings.
DEFAULT_KERNEL_COMPUTE_CAPABILITY = (9, 0)
# ... and with an H100 SXM's 132 SMs (NVIDIA H100 Tensor Core GPU Architecture whitepaper: 132
# SMs on the SXM5 board), for kernels that size their grids by the SM count.
DEFAULT_KERNEL_MULTIPROCESSOR_COUNT = 132

# cudaDeviceProp.maxThreadsPerMultiProcessor by compute capability: the CUDA C++ Programming
# Guide's "Technical Specifications per Compute Capability" table ("Maximum number of resident
# threads per SM"); a major version's other minors take its x.0 figure.
_MAX_THREADS_PER_MULTIPROCESSOR = {
    (6, 0): 2048, (6, 1): 2048, (7, 0): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536,
    (8, 7): 2048, (8, 9): 1536, (9, 0): 2048, (10, 0): 2048, (12, 0): 1536,
}


class GpuSpecError(OomkitError, ValueError):
    """A ``GpuSpec`` whose numbers cannot describe a real device (e.g. overhead >= total)."""


@dataclass(frozen=True)
class GpuSpec:
    """One CUDA device as PyTorch sees it.

    Attributes:
        name: canonical name, e.g. ``"H100 SXM 80GB"``.
        aliases: lowercase lookup keys, e.g. ``("h100", "h100-sxm")``; matched ignoring case,
            spaces, dashes and underscores.
        total_memory_bytes: ``torch.cuda.get_device_properties(0).total_memory``. It moves by a
            few hundred MiB between driver versions; see ``source_notes`` for which one.
        compute_capability: ``(major, minor)``; ``None`` for a custom size.
        architecture: NVIDIA architecture family; ``None`` for a custom size.
        context_overhead_bytes: device memory held outside PyTorch's allocator by the CUDA
            context and loaded kernels (an estimate per family; override it with a measurement
            of ``nvidia-smi`` used memory minus ``torch.cuda.memory_reserved()``).
        memory_bandwidth_gb_per_s: peak DRAM bandwidth from NVIDIA's datasheet, in GB/s
            (10**9 bytes per second); ``None`` where unknown.
        multiprocessor_count: ``cudaDeviceProp.multiProcessorCount`` (torch's
            ``multi_processor_count``): kernels that size their grids by it (multi-block
            reductions' staging memory) ask for more on more SMs; ``None`` for a custom size.
        total_memory_source: how ``total_memory_bytes`` was obtained (see ``MemorySource``).
        source_notes: where every figure above comes from.
    """

    name: str
    total_memory_bytes: int
    context_overhead_bytes: int
    aliases: tuple[str, ...] = ()
    compute_capability: tuple[int, int] | None = None
    architecture: Architecture | None = None
    memory_bandwidth_gb_per_s: float | None = None
    multiprocessor_count: int | None = None
    total_memory_source: MemorySource | None = None
    source_notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.total_memory_bytes <= 0:
            raise GpuSpecError(
                f"{self.name}: total_memory_bytes must be positive; got "
                f"{self.total_memory_bytes}. Pass the device's total memory, e.g. 24GiB."
            )
        if self.multiprocessor_count is not None and self.multiprocessor_count <= 0:
            raise GpuSpecError(
                f"{self.name}: multiprocessor_count must be positive; got "
                f"{self.multiprocessor_count}. Pass the device's SM count or None."
            )
        if not 0 <= self.context_overhead_bytes < self.total_memory_bytes:
            raise GpuSpecError(
                f"{self.name}: context_overhead_bytes must be >= 0 and below the total "
                f"({format_bytes(self.total_memory_bytes)}); got {self.context_overhead_bytes}. "
                "A CUDA context typically takes 300-600 MiB, e.g. context_overhead_bytes=400 * 2**20."
            )
        for alias in self.aliases:
            if alias != alias.lower():
                raise GpuSpecError(f"{self.name}: aliases must be lowercase; got {alias!r}.")

    @property
    def kernel_compute_capability(self) -> tuple[int, int]:
        """The compute capability CUDA kernels are chosen for: this GPU's, or, for a custom
        size (no architecture), ``DEFAULT_KERNEL_COMPUTE_CAPABILITY`` (an H100's)."""
        return self.compute_capability or DEFAULT_KERNEL_COMPUTE_CAPABILITY

    @property
    def kernel_multiprocessor_count(self) -> int:
        """The SM count kernels size their grids for: this GPU's, or, for a custom size,
        ``DEFAULT_KERNEL_MULTIPROCESSOR_COUNT`` (an H100 SXM's, as the compute capability)."""
        return self.multiprocessor_count or DEFAULT_KERNEL_MULTIPROCESSOR_COUNT

    @property
    def kernel_max_threads_per_multiprocessor(self) -> int:
        """``cudaDeviceProp.maxThreadsPerMultiProcessor`` for ``kernel_compute_capability``."""
        major, minor = self.kernel_compute_capability
        table = _MAX_THREADS_PER_MULTIPROCESSOR
        return table.get((major, minor)) or table.get((major, 0)) or 2048

    def usable_bytes(self, reserved_outside_bytes: int | None = None) -> int:
        """Bytes PyTorch's caching allocator can reserve at most on this device.

        Args:
            reserved_outside_bytes: memory held outside the allocator (CUDA context, other
                processes, NCCL buffers), in bytes; ``None`` uses ``context_overhead_bytes``.

        Returns:
            ``total_memory_bytes`` minus the memory held outside, never below 0.

        Raises:
            GpuSpecError: ``reserved_outside_bytes`` is negative.
        """
        outside = (
            self.context_overhead_bytes
            if reserved_outside_bytes is None
            else reserved_outside_bytes
        )
        if outside < 0:
            raise GpuSpecError(
                f"reserved_outside_bytes must not be negative; got {outside}. "
                "Pass None to use the spec's context_overhead_bytes."
            )
        return max(0, self.total_memory_bytes - outside)
