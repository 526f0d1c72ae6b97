"""Device-level used memory from NVML, read off the training thread.

``torch.cuda.memory_stats()`` sees only this process's caching allocator; NVML
(``nvmlDeviceGetMemoryInfo``) sees the whole GPU: the CUDA context, other processes, NCCL
buffers. The query goes to the driver and can take tens of microseconds to milliseconds, so a
:class:`BackgroundSampler` runs it in a daemon thread; the monitor's ``step()`` only reads the
latest value and asks for a fresh one.

``pynvml`` (package ``nvidia-ml-py``) is imported only by :func:`open_nvml`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["BackgroundSampler", "NvmlUsedMemory", "open_nvml"]


class NvmlUsedMemory:
    """``used`` bytes of one GPU from ``nvmlDeviceGetMemoryInfo`` (all processes)."""

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self._pynvml = pynvml
        self._handle = handle

    def __call__(self) -> int:
        return int(self._pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def close(self) -> None:
        self._pynvml.nvmlShutdown()


def _torch_uuid(index: int) -> str | None:
    """The GPU's UUID as NVML spells it (``GPU-...``), or None when torch cannot tell."""
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:  # noqa: BLE001 - any failure: fall back to the index
        return None
    return None if uuid is None else f"GPU-{uuid}"


def open_nvml(index: int) -> tuple[NvmlUsedMemory | None, str | None]:
    """An NVML reader for torch's CUDA device ``index``, or ``(None, why not)``.

    The device is found by UUID, since torch's index and NVML's differ under
    ``CUDA_VISIBLE_DEVICES``; without a UUID, by index.
    """
    try:
        import pynvml  # noqa: TID251 - the one module that reads NVML (test_layers ALLOWED)
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError subclasses
        return None, f"NVML could not start: {exc}"
    try:
        uuid = _torch_uuid(index)
        if uuid is not None:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        reader = NvmlUsedMemory(pynvml, handle)
        reader()
    except Exception as exc:  # noqa: BLE001
        pynvml.nvmlShutdown()
        return None, f"NVML cannot read device {index}: {exc}"
    return reader, None


class BackgroundSampler:
    """Runs ``read()`` in a daemon thread whenever :meth:`request` asks; :attr:`latest` is cheap.

    The first value is read synchronously in the constructor, so :attr:`latest` always holds a
    value (from the previous request at worst: one step old). A read that raises stops the
    sampler; :attr:`error` says why and :attr:`latest` becomes None.
    """

    def __init__(self, read: Callable[[], int], *, name: str = "oomkit-nvml") -> None:
        self._read = read
        self.error: str | None = None
        self.latest: int | None = None
        try:
            self.latest = int(read())
        except Exception as exc:  # noqa: BLE001
            self.error = f"{type(exc).__name__}: {exc}"
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if self.error is None:
            self._thread.start()

    def request(self) -> None:
        """Ask for a fresh value (returns at once)."""
        if self.error is None:
            self._idle.clear()
            self._wake.set()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until the requested read is done (tests; never called on the training path)."""
        self._idle.wait(timeout_s)

    def close(self) -> None:
        """Stop the thread."""
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                self._idle.set()
                return
            try:
                self.latest = int(self._read())
            except Exception as exc:  # noqa: BLE001
                self.error = f"{type(exc).__name__}: {exc}"
                self.latest = None
                self._idle.set()
                return
            self._idle.set()
