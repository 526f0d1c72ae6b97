"""A monitor log reduced for ``oomkit diff``: its peak-reserved step, in diagnose's RunMemory.

A monitor samples ``memory_stats()`` once per recorded step, so the moment reserved memory
peaked is known only to the step: the allocated figure used is that step's peak allocated,
an upper bound of what was allocated when reserved peaked (the note says so). Memory outside
PyTorch is NVML's used memory minus reserved, where NVML was read.
"""

from __future__ import annotations

from oomkit.diagnose.run_diff import RunMemory
from oomkit.runtime._monitor_log import MonitorLog

__all__ = ["run_memory_from_monitor_log"]


def run_memory_from_monitor_log(log: MonitorLog) -> RunMemory:
    """Reduce a monitor log to the step in which reserved memory peaked.

    Raises:
        MonitorLogError: the log holds no step record.
    """
    from oomkit.errors import MonitorLogError

    records = log.records
    if not records:
        raise MonitorLogError(
            f"{log.path}: no step records; call mon.step() in the training loop"
        )
    peak = max(records, key=lambda r: r.peak_reserved_bytes)
    allocated = min(peak.peak_allocated_bytes, peak.peak_reserved_bytes)
    outside = None
    if peak.device_used_bytes is not None:
        outside = max(0, peak.device_used_bytes - peak.reserved_bytes)
    device = log.header.get("device")
    return RunMemory(
        kind="monitor",
        name=log.path.name,
        gpu=device if isinstance(device, str) else None,
        peak_reserved_bytes=peak.peak_reserved_bytes,
        allocated_at_peak_bytes=allocated,
        outside_bytes=outside,
        by_category_bytes={},
        by_site_bytes={},
        site_kind=None,
        peak_at=peak.step,
        timeline=tuple(
            (float(r.step), r.peak_allocated_bytes, r.peak_reserved_bytes) for r in records
        ),
        timeline_unit="step",
        sequence=tuple(f"step {r.step} peak reserved {r.peak_reserved_bytes} B" for r in records),
        notes=(
            f"{log.path.name}: sampled once per step; allocated at the peak is that step's peak "
            "allocated (an upper bound)",
        ),
    )
