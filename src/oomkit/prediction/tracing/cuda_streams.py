"""Side CUDA streams a script makes, as the caching allocator sees them: a pool of blocks each.

PyTorch's caching allocator keeps the blocks freed on a stream for requests on that stream: a
cached block is reused only by a request made while the same stream is current
(c10/cuda/CUDACachingAllocator.cpp: ``BlockComparatorSize`` orders free blocks by stream first,
and ``get_free_block`` looks up ``(stream, size)``). A data prefetcher that copies the next batch
on its own stream (``with torch.cuda.stream(s): x = x.cuda(non_blocking=True)``) so holds its
own cached blocks beside the default stream's.

While :func:`user_streams` is open (``cuda_device.as_one_cuda_gpu`` opens it):

- ``torch.cuda.Stream(...)`` makes a stream object; its ``query()`` is True, and its
  ``synchronize``, ``wait_stream``, ``wait_event`` do nothing (nothing runs on a device);
  ``record_event`` returns a ``torch.cuda.Event``.
- ``torch.cuda.stream(s)`` (``StreamContext``) and ``with s:`` make ``s`` current in their
  block, ``torch.cuda.set_stream(s)`` from then on; ``current_stream()`` and
  ``default_stream()`` answer the stream objects.
- A recording reads :func:`current_stream_id` for each request (``Tracer.current_stream``), so
  what is allocated while ``s`` is current goes to ``s``'s pool in the replay.
- ``tensor.record_stream(s)`` does nothing here.

Where it may differ: frees complete at once, as when the GPU keeps up. On a GPU a block a
tensor used on another stream (``record_stream``) comes back to its pool only when that
stream's work recorded at the free is done, so a prefetcher's pool can hold one batch more
when the GPU trails the CPU.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["TimingEvent", "current_stream_id", "user_streams"]


class TimingEvent:
    """``torch.cuda.Event``: a script's timing reads 0 ms (nothing runs on a device), and its
    synchronisation returns at once."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _Stream:
    """``torch.cuda.Stream``: an id for the allocator's pools, and no work to wait for."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority
        self.device = torch.device("cuda", 0)
        # Ids never repeat in a process: a stream a builder made keeps its own in the steps.
        self.stream_id = next(_ids)
        self.cuda_stream = self.stream_id  # the cudaStream_t libraries read (0: the default)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def is_capturing(self) -> bool:
        # torch.Stream.is_capturing (2.13+): the optimizer's graph-capture check reads it on
        # the accelerator's current stream. CUDA graphs are not recorded: never capturing.
        return False

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return torch.cuda.Event() if event is None else event

    def __enter__(self) -> _Stream:
        _current.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _current.pop()

    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:0 stream_id={self.stream_id} (emulated)>"


class _DefaultStream(_Stream):
    """The default stream, id 0."""

    def __init__(self) -> None:
        self.priority = 0
        self.device = torch.device("cuda", 0)
        self.stream_id = self.cuda_stream = 0


class _StreamContext:
    """``torch.cuda.stream(s)`` / ``torch.cuda.StreamContext(s)``: ``s`` current in the block
    (``None``: no change, as torch's)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __enter__(self) -> Any:
        if self.stream is not None:
            _current.append(self.stream)
        return self.stream

    def __exit__(self, *exc_info: object) -> None:
        if self.stream is not None:
            _current.pop()


# The ids of the streams made (0 is the default stream's), and the current stream's stack,
# innermost last.
_ids = itertools.count(1)
_current: list[Any] = []


def current_stream_id() -> int:
    """The id of the stream new requests are made on (0: the default stream)."""
    return _current[-1].stream_id if _current else 0


def _record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """``tensor.record_stream(s)``: nothing to wait for (module docstring)."""
    return None


def _set_stream(stream: Any) -> None:
    if stream is not None:
        _current[-1:] = [stream]


@contextlib.contextmanager
def user_streams() -> Iterator[None]:
    """While open, ``torch.cuda``'s streams are emulated (module docstring)."""
    outer = _current[:]
    default = _DefaultStream()
    _current[:] = [default]
    answers = {
        "Stream": _Stream,
        "StreamContext": _StreamContext,
        "stream": _StreamContext,
        "set_stream": _set_stream,
        "current_stream": lambda device=None: _current[-1],
        "default_stream": lambda device=None: default,
    }
    saved = {name: getattr(torch.cuda, name) for name in answers if hasattr(torch.cuda, name)}
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
    # Tensor.record_stream's argument parser refuses a stream that is not torch's before any
    # mode sees the call: the method itself is answered (frees complete at once here).
    own_record_stream = torch.Tensor.__dict__.get("record_stream")
    torch.Tensor.record_stream = _record_stream  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own_record_stream is None:
            del torch.Tensor.record_stream
        else:
            torch.Tensor.record_stream = own_record_stream  # type: ignore[method-assign]
        for name in answers:
            if name in saved:
                setattr(torch.cuda, name, saved[name])
            else:
                delattr(torch.cuda, name)
        _current[:] = outer
