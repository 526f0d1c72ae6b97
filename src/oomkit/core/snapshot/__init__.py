"""Reading and writing PyTorch CUDA memory snapshots (``torch.cuda.memory._dump_snapshot``).

``load_snapshot`` reads every generation of the format (ref §11.2) with an unpickler that refuses
every global, and normalises it into :class:`Snapshot` records; ``write_snapshot`` writes the
newest layout as plain data.
"""

from __future__ import annotations

from oomkit.core.snapshot.model import (
    FORMAT_GENERATIONS,
    BlockState,
    SegmentType,
    Snapshot,
    SnapshotBlock,
    SnapshotSegment,
)
from oomkit.core.snapshot.reader import (
    READING_FILE,
    LoadProgress,
    load_snapshot,
    looks_like_pickle,
    snapshot_from_data,
)
from oomkit.core.snapshot.torch_version import infer_torch_version
from oomkit.core.snapshot.unpickler import HOW_TO_RECORD, RestrictedUnpickler
from oomkit.core.snapshot.writer import snapshot_to_data, write_snapshot

__all__ = [
    "BlockState",
    "FORMAT_GENERATIONS",
    "HOW_TO_RECORD",
    "LoadProgress",
    "READING_FILE",
    "RestrictedUnpickler",
    "SegmentType",
    "Snapshot",
    "SnapshotBlock",
    "SnapshotSegment",
    "infer_torch_version",
    "load_snapshot",
    "looks_like_pickle",
    "snapshot_from_data",
    "snapshot_to_data",
    "write_snapshot",
]
