"""format_size and the OOM message pieces (ref §12)."""

from __future__ import annotations

import pytest

from oomkit.core.allocator.oom_message import format_size, oom_message
from oomkit.core.allocator.versions import behaviour_for

MiB = 2**20


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 bytes"),
        (1024, "1024 bytes"),
        (1025, "1.00 KiB"),
        (MiB, "1024.00 KiB"),
        (MiB + 1, "1.00 MiB"),
        (20 * MiB, "20.00 MiB"),
        (2**30, "1024.00 MiB"),
        (2**30 + 1, "1.00 GiB"),
        (80 * 2**30, "80.00 GiB"),
    ],
)
def test_format_size(n, text):
    """§12.1 thresholds are inclusive; two decimals."""
    assert format_size(n) == text


def test_private_pool_figure():
    """§12.3: P > 0 adds the private-pool clause and shifts the split."""
    text = oom_message(
        behaviour_for("2.4"),
        alloc_size=2 * MiB,
        device=1,
        total=10 * MiB,
        free=0,
        allocated=4 * MiB,
        reserved=8 * MiB,
        allowed=None,
        private_pool_cached=MiB,
    )
    assert "GPU 1 has a total capacity of 10.00 MiB" in text
    assert (
        "Of the allocated memory 5.00 MiB is allocated by PyTorch, with 1024.00 KiB allocated in "
        "private pools (e.g., CUDA Graphs), and 3.00 MiB is reserved by PyTorch but unallocated."
    ) in text
