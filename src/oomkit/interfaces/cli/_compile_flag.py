"""``predict --compile``: the step compiled with ``torch.compile`` (default Inductor mode)."""

from __future__ import annotations

import argparse

__all__ = ["add_compile_flag"]


def add_compile_flag(parser: argparse.ArgumentParser) -> None:
    """--compile: a preset's forward wrapped in torch.compile, and compiled code recorded so."""
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile (default Inductor mode): a preset's or --hf model's forward is "
        "compiled; for file.py:function, the torch.compile calls of the step are recorded as "
        "compiled rather than eagerly. Dynamo and AOTAutograd's partitioner run for real; "
        "Inductor's fusion and buffer reuse are emulated (train and inference modes)",
    )
