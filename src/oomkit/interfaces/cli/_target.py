"""The target machine the flags name: one ``Target`` made from ``--gpu`` and its companions."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping

from oomkit.core.target import ParallelLayout, Target

__all__ = [
    "add_cuda_version_flag",
    "add_parallel_flags",
    "installed_torch_version",
    "target_from_args",
]


def add_cuda_version_flag(parser: argparse.ArgumentParser) -> None:
    """The one ``--cuda-version X.Y`` flag (dest ``cuda_version``), for predict and fit."""
    parser.add_argument(
        "--cuda-version",
        metavar="X.Y",
        help="the CUDA of the target's torch (torch.version.cuda), e.g. 12.8; below 11.7 the "
        "CUDA context loads every kernel eagerly (~1 GiB more), as does CUDA_MODULE_LOADING=EAGER "
        "in the environment (default: the installed torch build's CUDA, else the CUDA of that "
        "torch release's default PyPI wheel, e.g. 13.0 for torch 2.13)",
    )


def _module_loading(environ: Mapping[str, str]) -> str | None:
    """``CUDA_MODULE_LOADING`` of the job's environment, when it names a mode."""
    setting = environ.get("CUDA_MODULE_LOADING", "").strip().upper()
    return {"EAGER": "eager", "LAZY": "lazy"}.get(setting)


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    """``--fsdp N``, ``--tp N``, ``--dp N``: predict rank 0 of their product of ranks
    (``Target.parallel``)."""
    parser.add_argument(
        "--fsdp",
        type=int,
        metavar="N",
        help="shard the GPT-2/Llama preset with FSDP2 over N GPUs (per block + root, as "
        "torchtitan) and predict rank 0; --batch is then the per-rank batch",
    )
    parser.add_argument(
        "--tp",
        type=int,
        metavar="N",
        help="split each layer over N GPUs with tensor parallelism (DTensor); world size is "
        "the product of --dp, --fsdp and --tp",
    )
    parser.add_argument(
        "--dp",
        type=int,
        metavar="N",
        help="N DDP replicas, each holding the whole model (or its FSDP shard group)",
    )


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
    args: argparse.Namespace,
    environ: Mapping[str, str] | None = None,
    *,
    default_torch_version: str | None = None,
) -> Target:
    """The ``Target`` of ``--gpu``, ``--alloc-conf``, ``--context-overhead``,
    ``--torch-version``, ``--cudnn-version``, ``--cuda-version`` (with ``CUDA_MODULE_LOADING``
    from ``environ``, default ``os.environ``) and ``--fsdp``/``--tp``/``--dp``
    (``Target.parallel``); a command
    without one of them gets its default.

    Args:
        args: the parsed flags.
        default_torch_version: the PyTorch release to model without ``--torch-version``
            (``predict``/``fit``: the installed torch's); ``None``: the newest release modelled.

    Raises:
        UnknownGpuError: ``--gpu`` is neither a catalog GPU nor a size with a unit.
        GpuSpecError: ``--context-overhead`` is not below the GPU's total memory.
        ConfigError: ``--alloc-conf`` is a setting PyTorch would reject, ``--cuda-version``
            is not X.Y, or a parallel degree is below 1.
    """
    loading = _module_loading(os.environ if environ is None else environ)
    target = Target.resolve(
        getattr(args, "gpu", None) or "h100",
        alloc_conf=getattr(args, "alloc_conf", None),
        context_overhead_bytes=getattr(args, "context_overhead", None),
        torch_version=getattr(args, "torch_version", None) or default_torch_version,
        cudnn_version=getattr(args, "cudnn_version", None),
        cuda_version=getattr(args, "cuda_version", None),
        cuda_module_loading=loading,  # type: ignore[arg-type]
    )
    degrees = {name: getattr(args, name, None) for name in ("fsdp", "tp", "dp")}
    given = {name: value for name, value in degrees.items() if value is not None}
    if not given:
        return target
    return dataclasses.replace(target, parallel=ParallelLayout(**given))
