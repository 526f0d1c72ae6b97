"""A trace entry's extra fields: the pool id and the string tags, checked and read.

PyTorch records ``pool_id`` as a MempoolId_t (a pair of ints) and ``compile_context`` /
``user_metadata`` as std::string (CUDACachingAllocator.h TraceEntry); ``"N/A"`` and ``""`` mean
"not recorded".
"""

from __future__ import annotations

from oomkit.core.snapshot._validate import pool_id_problem, show

__all__ = ["TAG_FIELDS", "entry_tags", "extras_problem"]

# Trace entry fields kept as TraceEvent tags (strings).
TAG_FIELDS = ("compile_context", "user_metadata")


def extras_problem(raw: dict, device: int | None, index: int) -> str | None:
    """A pool id that is not a pair of ints, or a tag that is not a string, in words (naming
    ``device_traces[device][index]``); None when both are as PyTorch records them."""
    where = f"device_traces[{device}][{index}]"
    pool_id = raw.get("pool_id")
    problem = None if pool_id is None else pool_id_problem(pool_id, where, "pool_id")
    for key in TAG_FIELDS:
        value = raw.get(key)
        if problem is None and value is not None and type(value) is not str:
            problem = f"{where}: {key!r} is {show(value)}; PyTorch records a string"
    return problem


def entry_tags(raw: dict) -> tuple[tuple[str, str], ...]:
    """The entry's recorded tags and its pool id (when not the default), as TraceEvent tags;
    ``raw`` passed :func:`extras_problem`."""
    tags = []
    for key in TAG_FIELDS:
        value = raw.get(key)
        if value not in (None, "", "N/A"):
            tags.append((key, value))  # a str (checked by extras_problem)
    pool_id = raw.get("pool_id")  # None or a pair of ints (checked by extras_problem)
    if pool_id is not None and tuple(pool_id) != (0, 0):
        tags.append(("pool_id", ",".join(str(p) for p in pool_id)))
    return tuple(tags)
