"""Core: the trace record, the allocator simulator, snapshot files, replay, and the GPU catalog.

Pure Python (no torch, rich or argparse). Inside, imports go down this order: ``trace``,
``allocator`` and ``gpus`` (independent), then ``snapshot``, ``workloads`` and ``target``, then
``replay``. Nothing is imported here; import the subpackage you need.
"""

from __future__ import annotations

__all__: list[str] = []
