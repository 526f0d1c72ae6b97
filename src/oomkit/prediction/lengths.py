"""Per-step sequence lengths for the epoch envelope: read from a file, padded, put in order.

A lengths file is one of: one length a line; ``length,count`` rows (a histogram); or a JSON list
of lengths. Blank lines and ``#`` comments are ignored. Every malformed line is an error that
names its line, so a wrong file never becomes a wrong answer.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

from oomkit._files import refuse_special_file
from oomkit.errors import ConfigError

__all__ = ["MAX_STEPS", "padded", "parse_lengths", "read_lengths", "run_order"]

# The most steps an envelope replays (a 10M-event replay is about 20 s; see benchmarks).
MAX_STEPS = 1_000_000
# A lengths file larger than this is refused before it is read (a length a line: ~100M lines).
MAX_FILE_BYTES = 512 * 2**20


def _length(text: str, where: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ConfigError(
            f"{where}: {text.strip()!r} is not a whole number; a lengths file holds one length a "
            "line, 'length,count' rows, or a JSON list"
        ) from None
    if value < 1:
        raise ConfigError(f"{where}: a sequence length must be at least 1; got {value}")
    return value


def parse_lengths(text: str, *, name: str = "<lengths>") -> tuple[int, ...]:
    """The per-step lengths a lengths file's text lists, in file order (histograms expanded).

    Raises:
        ConfigError: an empty list, a non-numeric or non-positive entry, or more than
            ``MAX_STEPS`` steps.
    """
    stripped = text.strip()
    lengths: list[int] = []
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except ValueError as exc:
            raise ConfigError(f"{name}: not a JSON list of lengths ({exc})") from exc
        if not isinstance(data, list):
            raise ConfigError(f"{name}: a JSON lengths file must be a list of whole numbers")
        for i, item in enumerate(data):
            if isinstance(item, bool) or not isinstance(item, int):
                raise ConfigError(f"{name}: entry {i} is {item!r}, not a whole number")
            lengths.append(_length(str(item), f"{name}: entry {i}"))
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            where = f"{name}:{number}"
            if "," in line:
                length_text, _, count_text = line.partition(",")
                length = _length(length_text, where)
                try:
                    count = int(count_text.strip())
                except ValueError:
                    raise ConfigError(f"{where}: count {count_text.strip()!r} is not a whole number") from None
                if count < 0:
                    raise ConfigError(f"{where}: a count must be 0 or more; got {count}")
                if len(lengths) + count > MAX_STEPS:
                    raise ConfigError(f"{name}: more than {MAX_STEPS:,} steps; sample fewer")
                lengths.extend([length] * count)
            else:
                lengths.append(_length(line, where))
            if len(lengths) > MAX_STEPS:
                raise ConfigError(f"{name}: more than {MAX_STEPS:,} steps; sample fewer")
    if not lengths:
        raise ConfigError(
            f"{name}: no lengths. Write one sequence length a line (or 'length,count' rows)"
        )
    return tuple(lengths)


def read_lengths(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """:func:`parse_lengths` of a file.

    Raises:
        ConfigError: the file is missing, unreadable, too large or malformed.
    """
    file = Path(path)
    refuse_special_file(file, what="lengths file", error=ConfigError)
    try:
        if file.stat().st_size > MAX_FILE_BYTES:
            raise ConfigError(f"{file}: larger than {MAX_FILE_BYTES // 2**20} MiB; sample it first")
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{file}: cannot read the lengths file ({exc})") from exc
    return parse_lengths(text, name=str(file))


def padded(length: int, pad_to: int) -> int:
    """``length`` rounded up to a multiple of ``pad_to`` (a collator's ``pad_to_multiple_of``)."""
    return -(-length // pad_to) * pad_to


def run_order(
    lengths: Sequence[int],
    *,
    steps: int | None = None,
    pad_to: int = 1,
    seed: int | None = None,
    largest_first: bool = False,
) -> tuple[int, ...]:
    """The padded length of every step of the run, in the order the steps run.

    Args:
        lengths: the dataset's lengths, in dataset order.
        steps: how many steps to run; None = one pass over ``lengths``; more cycles through
            them again (each pass in the same order, or reshuffled with ``seed``).
        pad_to: pad each length up to a multiple of this.
        seed: shuffle each pass with ``random.Random(seed)``; None keeps the given order.
        largest_first: move the longest step of the run to the front (the usual advice).

    Raises:
        ConfigError: ``steps`` or ``pad_to`` below 1, or more than ``MAX_STEPS`` steps.
    """
    if pad_to < 1:
        raise ConfigError(f"--pad-to must be at least 1; got {pad_to}")
    count = len(lengths) if steps is None else steps
    if count < 1:
        raise ConfigError(f"--steps must be at least 1; got {count}")
    if count > MAX_STEPS:
        raise ConfigError(f"--steps {count:,} is more than {MAX_STEPS:,}; replay fewer steps")
    rng = random.Random(seed) if seed is not None else None
    out: list[int] = []
    while len(out) < count:
        epoch = [padded(n, pad_to) for n in lengths]
        if rng is not None:
            rng.shuffle(epoch)
        out.extend(epoch[: count - len(out)])
    if largest_first:
        top = max(range(len(out)), key=lambda i: (out[i], -i))
        out.insert(0, out.pop(top))
    return tuple(out)
