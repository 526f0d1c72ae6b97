"""The machine a prediction is for: GPU, allocator setting and software versions, parsed once.

A ``Target`` is made once at the interface (``Target.resolve`` from the ``--gpu``,
``--alloc-conf``, ``--context-overhead``, ``--torch-version``, ``--cudnn-version`` and
``--cuda-version`` flags, or the keyword arguments of ``oomkit.predict``) and passed down
unchanged: the predictor replays on
its GPU with its allocator setting, the tracer picks kernels for its compute capability and
cuDNN version, and a saved prediction keeps it so that re-predictions (``oomkit explain``) model
the same machine.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from oomkit.core.allocator import AllocatorConfig, CachingAllocator
from oomkit.core.allocator.versions import require_modelled
from oomkit.core.gpus import GpuSpec, get_gpu
from oomkit.core.gpus.cuda_versions import (
    CudaBuild,
    cuda_build_for,
    installed_cuda_build,
    installed_torch_version,
)
from oomkit.core.gpus.nccl import NcclSettings
from oomkit.core.gpus.overhead import CudaContext, ModuleLoading, cuda_context, module_loading_for
from oomkit.errors import ConfigError
from oomkit.units import format_bytes

__all__ = ["ParallelLayout", "Target"]


@dataclass(frozen=True)
class ParallelLayout:
    """How the step is spread over GPUs; the prediction is for rank 0 of it.

    Attributes:
        fsdp: ranks FSDP2 (``fully_shard``) shards parameters, gradients and optimizer state
            over (1: no sharding).
        tp: ranks tensor parallelism (DTensor ``parallelize_module``) splits each layer over
            (1: none).
        dp: DDP replicas (``DistributedDataParallel``), each holding the whole model (1: none).
        pp: pipeline stages' ranks (torch.distributed.pipelining; 1: none).
        cp: ranks the sequence is split over (context parallel, ring attention; 1: none).
    """

    fsdp: int = 1
    tp: int = 1
    dp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("fsdp", "tp", "dp", "pp", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"the {name.upper()} degree must be a whole number of at least 1; got "
                    f"{value!r}. Example: --{name} 8"
                )

    @property
    def world_size(self) -> int:
        """Ranks in all (the product of the parallel degrees)."""
        return self.fsdp * self.tp * self.dp * self.pp * self.cp

    @property
    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The device mesh's sizes and dimension names, outermost first, as torchtitan orders
        them (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``; torchtitan/distributed/
        parallel_dims.py ``build_mesh``): only the degrees above 1, and ``(("fsdp",) 1)`` for a
        single rank."""
        degrees = (
            (self.pp, "pp"), (self.dp, "dp"), (self.fsdp, "fsdp"), (self.cp, "cp"), (self.tp, "tp")
        )
        dims = [(size, name) for size, name in degrees if size > 1]
        if not dims:
            dims = [(1, "fsdp")]
        return tuple(size for size, _ in dims), tuple(name for _, name in dims)


@dataclass(frozen=True)
class Target:
    """One target machine, validated.

    Attributes:
        gpu: the device (its ``context_overhead_bytes`` is the CUDA context used).
        allocator_config: the ``PYTORCH_CUDA_ALLOC_CONF`` simulated (default: PyTorch's).
        torch_version: the PyTorch release whose allocator (and parser) is modelled; ``None``:
            not stated, the newest released.
        cudnn_version: ``torch.backends.cudnn.version()`` on the target (``92000`` for 9.20.0),
            which steers the SDPA backend on sm90/sm100; ``None``: not stated (the tracer then
            uses the SDPA settings in effect: ``use_sdpa_settings``, else this torch install's).
        cuda_version: the CUDA runtime of the target's torch (``"12.8"``): as given, else the
            installed torch build's, else its release's default PyPI wheel's; ``None`` only
            where none is known (a ROCm build). It sets the CUDA context's loading mode.
        parallel: how the step is spread over GPUs (``--fsdp N``), predicted for rank 0;
            ``None``: a single process on one GPU.
        cuda_context: the CUDA context assumed (figure, range, CUDA version, loading mode);
            ``None`` where the caller gave ``context_overhead_bytes`` instead.
        cuda_version_source: where ``cuda_version`` comes from, for reports.
        warnings: what may differ from the real machine (a torch version other than the
            installed one).
        nccl: the NCCL environment of a multi-GPU job (``NCCL_BUFFSIZE``,
            ``NCCL_NVLS_ENABLE``, ...); ``None``: NCCL's defaults.
    """

    gpu: GpuSpec
    allocator_config: AllocatorConfig = field(default_factory=AllocatorConfig)
    torch_version: str | None = None
    cudnn_version: int | None = None
    cuda_version: str | None = None
    parallel: ParallelLayout | None = None
    cuda_context: CudaContext | None = None
    cuda_version_source: str = "not stated"
    warnings: tuple[str, ...] = ()
    nccl: NcclSettings | None = None

    def __post_init__(self) -> None:
        # Target(...) takes parsed parts; a name or a setting string is Target.resolve's to parse
        # (a str gpu had failed deep in the recording with "'str' object has no attribute").
        if not isinstance(self.gpu, GpuSpec):
            raise ConfigError(
                f"Target(gpu=...) takes a GpuSpec; got {self.gpu!r}. To name a GPU or a size, "
                f"use Target.resolve({self.gpu!r}), or pass gpu= to oomkit.predict / oomkit.fit"
            )
        if not isinstance(self.allocator_config, AllocatorConfig):
            raise ConfigError(
                f"Target(allocator_config=...) takes an AllocatorConfig; got "
                f"{self.allocator_config!r}. To give a PYTORCH_CUDA_ALLOC_CONF string, use "
                f"Target.resolve(gpu, alloc_conf={self.allocator_config!r})"
            )

    @property
    def context_overhead_bytes(self) -> int:
        """Device memory held outside the allocator (CUDA context, kernels), in bytes."""
        return self.gpu.context_overhead_bytes

    @property
    def capacity_bytes(self) -> int:
        """The device's total memory (``cudaMemGetInfo`` total), in bytes."""
        return self.gpu.total_memory_bytes

    @property
    def usable_bytes(self) -> int:
        """The most the allocator may reserve: ``capacity_bytes - context_overhead_bytes``, or
        less where the setting's ``per_process_memory_fraction`` limits it (applied when the
        device allocator is created, c10/cuda/CUDACachingAllocator.cpp: its
        ``allowed_memory_maximum``)."""
        limit = self.fraction_limit_bytes
        usable = self.gpu.usable_bytes()
        return usable if limit is None else min(usable, limit)

    @property
    def fraction_limit_bytes(self) -> int | None:
        """The allocator's limit under the setting's ``per_process_memory_fraction``, as the
        target's PyTorch computes it from the total memory (``None``: no such setting)."""
        if self.allocator_config.per_process_memory_fraction is None:
            return None
        allocator = CachingAllocator(
            self.allocator_config,
            capacity_bytes=self.capacity_bytes,
            reserved_outside_bytes=self.context_overhead_bytes,
            torch_version=self.torch_version,
        )
        return allocator.allowed_memory_maximum

    @property
    def alloc_conf(self) -> str:
        """The allocator setting as canonical ``PYTORCH_CUDA_ALLOC_CONF`` text (``""``: default)."""
        return str(self.allocator_config)

    @property
    def context_description(self) -> str:
        """Which CUDA context was assumed, in words (CUDA version, loading mode, figure)."""
        if self.cuda_context is None:
            return (
                f"{format_bytes(self.context_overhead_bytes)} outside PyTorch, given by the caller"
            )
        return self.cuda_context.describe()

    def with_gpu(self, gpu: GpuSpec) -> Target:
        """The same machine with another device (a catalog candidate, or less usable memory).

        A catalog candidate that carries its architecture's default (lazy-loading) context gets
        this target's context model instead (its CUDA version and loading mode); a spec whose
        context the caller changed (a margin, a measurement) is kept as given.
        """
        if self.cuda_context is not None and gpu.context_overhead_bytes == _catalog_context(gpu):
            context = dataclasses.replace(
                cuda_context(
                    gpu.compute_capability, self.cuda_version, self.cuda_context.module_loading
                ),
                loading_reason=self.cuda_context.loading_reason,
            )
            gpu = dataclasses.replace(gpu, context_overhead_bytes=context.expected_bytes)
            return dataclasses.replace(self, gpu=gpu, cuda_context=context)
        return dataclasses.replace(self, gpu=gpu)

    @classmethod
    def resolve(
        cls,
        gpu: str | GpuSpec = "h100",
        alloc_conf: str | AllocatorConfig | None = None,
        context_overhead_bytes: int | None = None,
        torch_version: str | None = None,
        cudnn_version: int | None = None,
        cuda_version: str | None = None,
        cuda_module_loading: ModuleLoading | None = None,
        installed_torch: Callable[[], str | None] = installed_torch_version,
    ) -> Target:
        """Parse and check every part of a target once.

        Args:
            gpu: a catalog name (``"h100"``), a size (``"24GiB"``) or a ``GpuSpec``.
            alloc_conf: a ``PYTORCH_CUDA_ALLOC_CONF`` value or ``AllocatorConfig``; ``None`` is
                PyTorch's default (the environment is not read).
            context_overhead_bytes: memory held outside the allocator, in bytes; ``None`` uses
                the GPU's documented estimate.
            torch_version: the PyTorch release to model (``"2.6"``); ``None`` is the newest.
            cudnn_version: the target's ``torch.backends.cudnn.version()``; ``None``: not stated.
            cuda_version: the target's CUDA runtime (``"12.8"``); ``None``: the installed torch
                build's (``torch.version.cuda``), or, for a CPU build, absent torch or a
                ``torch_version`` other than the installed one, that release's default PyPI
                wheel's.
            cuda_module_loading: ``"lazy"`` or ``"eager"`` (``CUDA_MODULE_LOADING``); ``None``:
                eager below CUDA 11.7, else lazy (PyTorch's default).
            installed_torch: returns the installed torch's version or ``None`` (a provider).

        Returns:
            The target.

        Raises:
            UnknownGpuError: ``gpu`` is neither a catalog GPU nor a size with a unit.
            GpuSpecError: ``context_overhead_bytes`` is negative or not below the total memory.
            ConfigError: ``alloc_conf`` is a setting that PyTorch release would reject,
                ``cudnn_version`` is not a positive whole number, or ``cuda_version`` is not
                ``MAJOR.MINOR`` or ``cuda_module_loading`` not lazy/eager.
        """
        spec = get_gpu(gpu, context_overhead_bytes=context_overhead_bytes)
        if torch_version is not None:
            require_modelled(torch_version)
        installed = installed_torch()
        build = _cuda_build(cuda_version, torch_version, installed)
        if cuda_module_loading not in (None, "lazy", "eager"):
            raise ConfigError(
                f"cuda_module_loading must be 'lazy' or 'eager' (CUDA_MODULE_LOADING); got "
                f"{cuda_module_loading!r}. Example: cuda_module_loading='eager'"
            )
        context = None
        # A spec that carries a context of its own (a GpuSpec built by the caller, a measurement)
        # keeps it; a catalog entry or a size gets the model's figure for this CUDA.
        if context_overhead_bytes is None and spec.context_overhead_bytes == _catalog_context(spec):
            loading, reason = (
                module_loading_for(build.cuda_version)
                if cuda_module_loading is None
                else module_loading_for(
                    build.cuda_version, {"CUDA_MODULE_LOADING": cuda_module_loading}
                )
            )
            context = dataclasses.replace(
                cuda_context(spec.compute_capability, build.cuda_version, loading),
                loading_reason=reason,
            )
            if context.expected_bytes != spec.context_overhead_bytes:
                spec = dataclasses.replace(spec, context_overhead_bytes=context.expected_bytes)
        config = AllocatorConfig.coerce(alloc_conf, torch_version)
        if cudnn_version is not None and (
            not isinstance(cudnn_version, int)
            or isinstance(cudnn_version, bool)
            or cudnn_version < 1
        ):
            raise ConfigError(
                f"cudnn_version must be a positive whole number as torch.backends.cudnn.version() "
                f"reports it; got {cudnn_version!r}. Example: cudnn_version=91002 for cuDNN 9.10.2"
            )
        return cls(
            spec,
            config,
            torch_version,
            cudnn_version,
            build.cuda_version,
            cuda_context=context,
            cuda_version_source=build.source,
            warnings=_version_warnings(torch_version, installed, build),
        )


_CUDA_VERSION = re.compile(r"\d+\.\d+")


def _cuda_build(
    cuda_version: str | None, torch_version: str | None, installed: str | None
) -> CudaBuild:
    """The CUDA assumed: as given, else the torch predicted for's (installed or not)."""
    if cuda_version is not None:
        if not isinstance(cuda_version, str) or not _CUDA_VERSION.fullmatch(cuda_version.strip()):
            raise ConfigError(
                f"cuda_version must be MAJOR.MINOR as torch.version.cuda reports it; got "
                f"{cuda_version!r}. Example: --cuda-version 12.8"
            )
        return CudaBuild(cuda_version.strip(), "given")
    if torch_version is not None and not _same_minor(torch_version, installed):
        return cuda_build_for(torch_version)
    return installed_cuda_build(lambda: installed)


def _same_minor(a: str, b: str | None) -> bool:
    """Whether two torch versions are the same release (``"2.13"`` and ``"2.13.0+cpu"``)."""
    first = re.match(r"\d+\.\d+", a)
    second = re.match(r"\d+\.\d+", b or "")
    return first is not None and second is not None and first.group(0) == second.group(0)


def _version_warnings(
    torch_version: str | None, installed: str | None, build: CudaBuild
) -> tuple[str, ...]:
    """What may differ when predicting for a torch version other than the installed one."""
    if torch_version is None or installed is None or _same_minor(torch_version, installed):
        return ()
    return (
        f"predicting for torch {torch_version} with torch {installed} installed: the allocator's "
        f"rules, the cuBLAS workspaces and the CUDA context (CUDA "
        f"{build.cuda_version or 'unknown'}, {build.source}) are {torch_version}'s, but the step "
        "is recorded by the installed torch, so its "
        "operators, autograd formulas, autocast policy and attention-kernel choice are "
        f"{installed}'s and may differ; install torch {torch_version} to record with its own",
    )


def _catalog_context(gpu: GpuSpec) -> int:
    """The context the catalog gives a GPU of this capability (lazy loading)."""
    return cuda_context(gpu.compute_capability, module_loading="lazy").expected_bytes

