"""A fake DeviceMemory for the monitor callback tests: allocated memory grows 1 MiB per read."""

from __future__ import annotations

MiB = 2**20


class GrowingDevice:
    """A DeviceMemory whose allocated level grows by 1 MiB per read (8 MiB reserved, 16 total)."""

    name = "fake"

    def __init__(self) -> None:
        self.reads = 0

    def memory_stats(self):
        self.reads += 1
        return {"allocated_bytes.all.current": self.reads * MiB, "reserved_bytes.all.current": 8 * MiB}

    def reset_peak_memory_stats(self):
        pass

    def mem_get_info(self):
        return 0, 16 * MiB
