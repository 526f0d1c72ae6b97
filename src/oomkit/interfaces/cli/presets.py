"""``oomkit presets``: the built-in models ``predict`` and ``fit`` take, with their defaults."""

from __future__ import annotations

import argparse
from typing import Any

from oomkit.interfaces.cli._common import add_json_flag, print_json, stdout_console

__all__ = ["add_parser", "run", "preset_to_json"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "presets",
        help="list the built-in models predict and fit take, with their defaults",
        description="List the built-in model presets: parameters, the flag that sizes the "
        "input (--seq for text models, --image-size for vision ones) and its default, and the "
        "precision and batch predict uses without --precision / --batch. Needs torch (the "
        "presets are PyTorch modules).",
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def preset_to_json(preset: Any) -> dict[str, Any]:
    """One preset as JSON: name, title, task, parameters, its defaults and its source."""
    vision = preset.task == "image_classification"
    return {
        "name": preset.name,
        "title": preset.title,
        "task": preset.task,
        "parameters": preset.parameter_count(),
        "input_flag": "--image-size" if vision else "--seq",
        "default_seq_len": preset.default_seq_len,
        "default_image_size": getattr(preset.shape, "image_size", 224) if vision else None,
        "default_precision": preset.default_precision,
        "default_batch_size": preset.default_batch_size,
        "source": preset.source,
    }


def run(args: argparse.Namespace) -> int:
    from oomkit.scenario._torch import require_torch

    require_torch("oomkit presets", why="builds the presets, which are PyTorch modules,")
    from rich.markup import escape
    from rich.table import Table

    from oomkit.prediction.models import PRESETS

    rows = [preset_to_json(preset) for preset in PRESETS.values()]
    if args.json:
        print_json({"presets": rows})
        return 0
    table = Table(title=f"{len(rows)} model presets")
    for name, justify in (
        ("preset", "left"),
        ("model", "left"),
        ("task", "left"),
        ("parameters", "right"),
        ("input (default)", "left"),
        ("precision", "left"),
        ("batch", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in rows:
        if row["input_flag"] == "--seq":
            shape = f"--seq {row['default_seq_len']}"
        else:
            shape = f"--image-size {row['default_image_size']}"
        table.add_row(
            escape(row["name"]),
            escape(row["title"]),
            row["task"],
            f"{row['parameters'] / 1e6:,.1f}M",
            shape,
            row["default_precision"],
            str(row["default_batch_size"]),
        )
    console = stdout_console()
    console.print(table)
    console.print(
        "Defaults apply to `oomkit predict PRESET` without --seq/--image-size, --precision and "
        "--batch (optimizer adamw, mode train); --json lists each shape's source."
    )
    return 0
