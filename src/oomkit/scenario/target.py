"""A scenario's ``target`` and ``parallel`` sections as one ``Target``: the one target path.

predict, fit, the Python facade and the MCP tools resolve ``--gpu`` here (``target_of``), so a
catalog GPU or a size gets the same context overhead wherever a step is predicted.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from oomkit.core.gpus.installed_torch import installed_torch_version as _full_torch_version
from oomkit.core.gpus.nccl import NcclSettings
from oomkit.core.target import ParallelLayout, Target
from oomkit.scenario.model import ParallelSection, TargetSection

__all__ = [
    "installed_torch_version",
    "layout_of",
    "module_loading_from",
    "nccl_settings_of",
    "target_of",
]


def installed_torch_version() -> str | None:
    """``major.minor`` of the installed torch (``"2.13"``), read from its ``torch/version.py``
    without importing it (``core.gpus.installed_torch``); ``None`` where torch is not installed.

    ``predict`` and ``fit`` record the step with this torch, so without ``target.torch_version``
    they model its allocator too (the newest release oomkit knows may be another one).
    """
    version = _full_torch_version()
    if version is None:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return None if match is None else f"{match[1]}.{match[2]}"


def module_loading_from(environ: Mapping[str, str]) -> str | None:
    """``CUDA_MODULE_LOADING`` of a job's environment, when it names a mode (``"lazy"`` or
    ``"eager"``); the CLI puts it in ``target.cuda_module_loading``."""
    setting = environ.get("CUDA_MODULE_LOADING", "").strip().upper()
    return {"EAGER": "eager", "LAZY": "lazy"}.get(setting)


def layout_of(parallel: ParallelSection | None) -> ParallelLayout | None:
    """The ``ParallelLayout`` of the ``parallel`` section; ``None`` when no degree is given."""
    if parallel is None or not parallel.given:
        return None
    degrees = {
        "fsdp": parallel.fsdp, "tp": parallel.tp, "dp": parallel.dp, "pp": parallel.pp,
        "cp": parallel.cp,
    }
    return ParallelLayout(**{name: value for name, value in degrees.items() if value is not None})


def target_of(
    section: TargetSection,
    parallel: ParallelSection | None = None,
    *,
    default_torch_version: str | None = None,
) -> Target:
    """The ``Target`` of a scenario's ``target`` (and ``parallel``) sections.

    Args:
        section: the GPU, allocator settings and versions.
        parallel: the layout (``Target.parallel``); ``None``: one GPU.
        default_torch_version: the PyTorch release to model when the section names none
            (``predict``/``fit``: the installed torch's, which records the step); ``None``:
            the newest release modelled.

    Raises:
        UnknownGpuError: ``gpu`` is neither a catalog GPU nor a size with a unit.
        GpuSpecError: ``context_overhead_bytes`` is not below the GPU's total memory.
        ConfigError: ``alloc_conf`` is a setting PyTorch would reject, or ``cuda_version`` is
            not X.Y.
    """
    target = Target.resolve(
        section.gpu,
        alloc_conf=section.alloc_conf,
        context_overhead_bytes=section.context_overhead_bytes,
        torch_version=section.torch_version or default_torch_version,
        cudnn_version=section.cudnn_version,
        cuda_version=section.cuda_version,
        cuda_module_loading=section.cuda_module_loading,
    )
    layout = layout_of(parallel)
    if layout is None:
        return target
    return dataclasses.replace(target, parallel=layout, nccl=nccl_settings_of(parallel))


def nccl_settings_of(parallel: ParallelSection | None) -> NcclSettings | None:
    """The NCCL environment the ``parallel`` section states; ``None`` when it states none."""
    if parallel is None:
        return None
    p = parallel
    stated = (p.nccl_buffsize, p.nccl_nvls_enable, p.nccl_ring_channels,
              p.torch_nccl_avoid_record_streams, p.gpus_per_node)
    if all(value is None for value in stated):
        return None
    return NcclSettings(
        buffsize_bytes=p.nccl_buffsize,
        nvls_enable=p.nccl_nvls_enable,
        ring_channels=p.nccl_ring_channels,
        avoid_record_streams=p.torch_nccl_avoid_record_streams,
        gpus_per_node=8 if p.gpus_per_node is None else p.gpus_per_node,
    )
