"""``oomkit gpus``: the built-in GPU catalog, with where each memory figure comes from."""

from __future__ import annotations

import argparse
from typing import Any

from oomkit.interfaces.cli._common import add_json_flag, print_json, stdout_console

__all__ = ["add_parser", "run", "gpu_to_json"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "gpus",
        help="list the GPUs --gpu can name, with their memory",
        description="List the built-in GPU catalog: the name --gpu takes, the total memory "
        "PyTorch sees (torch.cuda.get_device_properties().total_memory), the CUDA context "
        "oomkit counts outside the allocator, what the allocator may reserve (usable), the "
        "compute capability kernels are chosen for, and where the memory figure comes from. "
        "--gpu also takes a size (24GiB). No torch needed.",
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def gpu_to_json(spec: Any) -> dict[str, Any]:
    """One catalog entry as JSON: every ``GpuSpec`` field, bytes as ints, plus ``usable_bytes``."""
    return {
        "name": spec.name,
        "aliases": list(spec.aliases),
        "total_memory_bytes": spec.total_memory_bytes,
        "context_overhead_bytes": spec.context_overhead_bytes,
        "usable_bytes": spec.usable_bytes(),
        "compute_capability": (
            None if spec.compute_capability is None else list(spec.compute_capability)
        ),
        "architecture": spec.architecture,
        "memory_bandwidth_gb_per_s": spec.memory_bandwidth_gb_per_s,
        "multiprocessor_count": spec.multiprocessor_count,
        "total_memory_source": spec.total_memory_source,
        "source_notes": list(spec.source_notes),
    }


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from oomkit.core.gpus import CATALOG
    from oomkit.units import format_bytes

    if args.json:
        print_json({"gpus": [gpu_to_json(spec) for spec in CATALOG]})
        return 0
    table = Table(title=f"{len(CATALOG)} GPUs (oldest architecture first)")
    table.add_column("--gpu", no_wrap=True)
    table.add_column("name", no_wrap=True)
    table.add_column("total", justify="right", no_wrap=True)
    table.add_column("context", justify="right", no_wrap=True)
    table.add_column("usable", justify="right", no_wrap=True)
    table.add_column("cc", justify="right", no_wrap=True)
    table.add_column("architecture", no_wrap=True)
    table.add_column("memory figure", no_wrap=True)
    for spec in CATALOG:
        cc = spec.compute_capability
        table.add_row(
            escape(spec.aliases[0] if spec.aliases else spec.name),
            escape(spec.name),
            format_bytes(spec.total_memory_bytes),
            format_bytes(spec.context_overhead_bytes),
            format_bytes(spec.usable_bytes()),
            "" if cc is None else f"{cc[0]}.{cc[1]}",
            spec.architecture or "",
            spec.total_memory_source or "",
        )
    console = stdout_console()
    console.print(table)
    console.print(
        "total: what PyTorch reports as total_memory; context: the CUDA context's estimate, "
        "outside the allocator (--context-overhead overrides it); usable: total less context. "
        "memory figure: cudaDeviceProp/cudaMemGetInfo are byte-exact outputs, derived a "
        "MiB-rounded print or a sibling's figure; --json gives each source."
    )
    return 0
