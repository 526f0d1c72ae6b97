"""The target machine the flags name: one ``Target`` made from ``--gpu`` and its companions."""

from __future__ import annotations

import argparse
import re

from oomkit.core.target import Target

__all__ = ["installed_torch_version", "target_from_args"]


def installed_torch_version() -> str | None:
    """``major.minor`` of the installed torch (``"2.13"``), read from its package metadata
    without importing it; ``None`` where torch is not installed.

    ``predict`` and ``fit`` record the step with this torch, so without ``--torch-version``
    they model its allocator too (the newest release oomkit knows may be another one).
    """
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return None if match is None else f"{match[1]}.{match[2]}"


def target_from_args(
    args: argparse.Namespace, *, default_torch_version: str | None = None
) -> Target:
    """The ``Target`` of ``--gpu``, ``--alloc-conf``, ``--context-overhead``,
    ``--torch-version`` and ``--cudnn-version``; a command without one of them gets its default.

    Args:
        args: the parsed flags.
        default_torch_version: the PyTorch release to model without ``--torch-version``
            (``predict``/``fit``: the installed torch's); ``None``: the newest release modelled.

    Raises:
        UnknownGpuError: ``--gpu`` is neither a catalog GPU nor a size with a unit.
        GpuSpecError: ``--context-overhead`` is not below the GPU's total memory.
        ConfigError: ``--alloc-conf`` is a setting PyTorch would reject.
    """
    return Target.resolve(
        getattr(args, "gpu", None) or "h100",
        alloc_conf=getattr(args, "alloc_conf", None),
        context_overhead_bytes=getattr(args, "context_overhead", None),
        torch_version=getattr(args, "torch_version", None) or default_torch_version,
        cudnn_version=getattr(args, "cudnn_version", None),
    )
