"""The machine a prediction is for: GPU, allocator setting and software versions, parsed once.

A ``Target`` is made once at the interface (``Target.resolve`` from the ``--gpu``,
``--alloc-conf``, ``--context-overhead``, ``--torch-version`` and ``--cudnn-version`` flags, or
the keyword arguments of ``oomkit.predict``) and passed down unchanged: the predictor replays on
its GPU with its allocator setting, the tracer picks kernels for its compute capability and
cuDNN version, and a saved prediction keeps it so that re-predictions (``oomkit explain``) model
the same machine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.gpus import GpuSpec, get_gpu
from oomkit.errors import ConfigError

__all__ = ["ParallelLayout", "Target", "resolve_target"]


@dataclass(frozen=True)
class ParallelLayout:
    """How the step is spread over GPUs; the prediction is for rank 0 of it.

    Attributes:
        fsdp: ranks FSDP2 (``fully_shard``) shards parameters, gradients and optimizer state
            over (1: no sharding).
    """

    fsdp: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.fsdp, bool) or not isinstance(self.fsdp, int) or self.fsdp < 1:
            raise ConfigError(
                f"the FSDP world size must be a whole number of at least 1; got {self.fsdp!r}. "
                "Example: --fsdp 8"
            )

    @property
    def world_size(self) -> int:
        """Ranks in all (the product of the parallel degrees)."""
        return self.fsdp


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
        cuda_version: the CUDA runtime of the target's torch (``"12.8"``); ``None``: not stated.
            Recorded for reports; no emulation reads it yet.
        parallel: how the step is spread over GPUs (``--fsdp N``), predicted for rank 0;
            ``None``: a single process on one GPU.
    """

    gpu: GpuSpec
    allocator_config: AllocatorConfig = field(default_factory=AllocatorConfig)
    torch_version: str | None = None
    cudnn_version: int | None = None
    cuda_version: str | None = None
    parallel: ParallelLayout | None = None

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
        """``capacity_bytes - context_overhead_bytes``: the most the allocator may reserve."""
        return self.gpu.usable_bytes()

    @property
    def alloc_conf(self) -> str:
        """The allocator setting as canonical ``PYTORCH_CUDA_ALLOC_CONF`` text (``""``: default)."""
        return str(self.allocator_config)

    def with_gpu(self, gpu: GpuSpec) -> Target:
        """The same machine with another device (a catalog candidate, or less usable memory)."""
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
            cuda_version: the target's CUDA runtime (``"12.8"``); ``None``: not stated.

        Returns:
            The target.

        Raises:
            UnknownGpuError: ``gpu`` is neither a catalog GPU nor a size with a unit.
            GpuSpecError: ``context_overhead_bytes`` is negative or not below the total memory.
            ConfigError: ``alloc_conf`` is a setting that PyTorch release would reject, or
                ``cudnn_version`` is not a positive whole number.
        """
        spec = get_gpu(gpu, context_overhead_bytes=context_overhead_bytes)
        config = AllocatorConfig.coerce(alloc_conf, torch_version)
        if cudnn_version is not None and (
            not isinstance(cudnn_version, int) or isinstance(cudnn_version, bool) or cudnn_version < 1
        ):
            raise ConfigError(
                f"cudnn_version must be a positive whole number as torch.backends.cudnn.version() "
                f"reports it; got {cudnn_version!r}. Example: cudnn_version=91002 for cuDNN 9.10.2"
            )
        return cls(spec, config, torch_version, cudnn_version, cuda_version)


def resolve_target(
    target: Target | None,
    *,
    gpu: str | GpuSpec | None = None,
    alloc_conf: str | AllocatorConfig | None = None,
    context_overhead_bytes: int | None = None,
    torch_version: str | None = None,
) -> Target:
    """What a function taking both ``target=`` and the separate keywords was given.

    Args:
        target: the whole target, or ``None`` to build one from the keywords.
        gpu: as ``Target.resolve``; ``None`` is ``"h100"``.
        alloc_conf: as ``Target.resolve``.
        context_overhead_bytes: as ``Target.resolve``.
        torch_version: as ``Target.resolve``.

    Returns:
        ``target`` as given, else ``Target.resolve`` of the keywords.

    Raises:
        ConfigError: ``target`` and one of the keywords are both given.
        UnknownGpuError, GpuSpecError, ConfigError: as ``Target.resolve``.
    """
    if target is None:
        return Target.resolve(
            "h100" if gpu is None else gpu, alloc_conf, context_overhead_bytes, torch_version
        )
    given = [
        name
        for name, value in (
            ("gpu", gpu),
            ("alloc_conf", alloc_conf),
            ("context_overhead_bytes", context_overhead_bytes),
            ("torch_version", torch_version),
        )
        if value is not None
    ]
    if given:
        raise ConfigError(
            f"give either target= or {', '.join(given)}, not both: the target already names the "
            "GPU, allocator setting and versions. Example: "
            "target=Target.resolve('h100', alloc_conf='expandable_segments:True')"
        )
    return target
