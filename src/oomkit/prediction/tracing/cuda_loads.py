"""``torch.load`` of tensors saved on CUDA or mapped to it, as device allocations of the recording.

``torch.load("ckpt.pt", map_location="cuda")``, or a checkpoint saved from a GPU and loaded
without ``map_location``, puts each of its storages on the GPU: torch's CUDA deserializer
(torch/serialization.py ``_deserialize("cuda", ...)``, registered at priority 20) reads the
storage from the file to the host, checks the device (``_validate_device``: CUDA available, the
index below ``device_count()``) and copies it with ``storage.to(device=...)``, one device
allocation of the storage's bytes. The weights loaded that way sit on the GPU beside the model's
own until they are dropped, which is why loading a state dict to CUDA can run out of memory.

While :func:`restoring_on` is open, a deserializer registered ahead of torch's
(``torch.serialization.register_package``, priority 1) does that for the CUDA locations: every
``map_location`` form reaches it (``"cuda"``, ``torch.device("cuda")``, a dict of locations, a
callable that returns ``None``, or none with a CUDA-saved file; torch/serialization.py
``_get_restore_location``), and it returns an empty storage of the same bytes on the
recording's device, made by ``torch.empty`` so that the recorder sees the allocation and its
release. Tensors are then rebuilt on it as torch rebuilds them (``_utils._rebuild_tensor``:
``set_`` onto the storage), so tensors saved sharing a storage (tied weights) share it loaded.
Outside the block the deserializer declines (returns ``None``) and torch's own runs.

Where it may differ: a ``map_location`` callable that moves storages itself
(``lambda storage, loc: storage.cuda()``) is not answered, and the file is still read from disk
to the host as torch reads it (a large checkpoint takes its reading time here too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.serialization

__all__ = ["restoring_on"]

# Ahead of torch's CPU (10) and CUDA (20) deserializers: a lower priority runs first
# (torch/serialization.py register_package). The registry sorts its tuples, so the number must
# be one no other package uses.
_PRIORITY = 1

# The devices the open blocks put CUDA storages on, innermost last.
_landing: list[torch.device] = []


def _no_tag(storage: Any) -> None:
    """Saving is torch's own business: the next tagger names the location."""
    return None


def _on_the_recording(storage: Any, location: str) -> Any:
    """A CUDA location's storage, as the recording's allocation; ``None`` elsewhere."""
    if not _landing or not (location == "cuda" or location.startswith("cuda:")):
        return None
    validate = getattr(torch.serialization, "_validate_device", None)
    if validate is not None:
        validate(location, "cuda")  # torch's own check: CUDA available, index in range
    return torch.empty(storage.nbytes(), dtype=torch.uint8, device=_landing[-1]).untyped_storage()


def _registered() -> None:
    if not any(entry[2] is _on_the_recording for entry in torch.serialization._package_registry):
        torch.serialization.register_package(_PRIORITY, _no_tag, _on_the_recording)


@contextlib.contextmanager
def restoring_on(device: torch.device) -> Iterator[None]:
    """While open, storages ``torch.load`` puts on CUDA are made on ``device`` (``meta``, or a
    distributed recording's fake ``cpu``) as allocations the recorder sees (module docstring)."""
    _registered()
    _landing.append(device)
    try:
        yield
    finally:
        _landing.pop()
