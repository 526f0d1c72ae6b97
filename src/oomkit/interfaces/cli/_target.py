"""The target machine the flags name: one ``Target`` made from ``--gpu`` and its companions."""

from __future__ import annotations

import argparse

from oomkit.core.target import Target

__all__ = ["target_from_args"]


def target_from_args(args: argparse.Namespace) -> Target:
    """The ``Target`` of ``--gpu``, ``--alloc-conf``, ``--context-overhead``,
    ``--torch-version`` and ``--cudnn-version``; a command without one of them gets its default.

    Raises:
        UnknownGpuError: ``--gpu`` is neither a catalog GPU nor a size with a unit.
        GpuSpecError: ``--context-overhead`` is not below the GPU's total memory.
        ConfigError: ``--alloc-conf`` is a setting PyTorch would reject.
    """
    return Target.resolve(
        getattr(args, "gpu", None) or "h100",
        alloc_conf=getattr(args, "alloc_conf", None),
        context_overhead_bytes=getattr(args, "context_overhead", None),
        torch_version=getattr(args, "torch_version", None),
        cudnn_version=getattr(args, "cudnn_version", None),
    )
