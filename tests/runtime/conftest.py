"""Fixtures for runtime tests: a simulated CUDA device instead of a GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from oomkit.runtime import SimulatedCudaDevice


@pytest.fixture
def simulated_device() -> Iterator[Callable[..., SimulatedCudaDevice]]:
    """A factory of simulated devices, entered for the rest of the test and exited after it.

    ``simulated_device("64MiB")`` gives a 64 MiB device with no CUDA context (round numbers);
    keyword arguments go to :class:`SimulatedCudaDevice` (``alloc_conf``, ``record_history``,
    ``device_type``...); ``enter=False`` returns it without entering it.
    """
    with contextlib.ExitStack() as stack:

        def make(gpu: str = "64MiB", *, enter: bool = True, **kwargs: Any) -> SimulatedCudaDevice:
            kwargs.setdefault("context_overhead_bytes", 0)
            device = SimulatedCudaDevice(gpu, **kwargs)
            if enter:
                stack.enter_context(device)
            return device

        yield make
