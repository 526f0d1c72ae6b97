"""read_live_allocator: what the running torch reports, through a stand-in torch module."""

from __future__ import annotations

from types import SimpleNamespace

from oomkit.runtime.allocator_probe import read_live_allocator


def _torch(available, backend="native", settings=None):
    snapshot = {"segments": [], "device_traces": []}
    if settings is not None:
        snapshot["allocator_settings"] = settings
    memory = SimpleNamespace(_snapshot=lambda: snapshot)
    cuda = SimpleNamespace(
        is_available=lambda: available, get_allocator_backend=lambda: backend, memory=memory
    )
    return SimpleNamespace(__version__="2.13.0+cu130", cuda=cuda)


def test_without_cuda_only_the_version_is_read():
    """No CUDA device: cuda_available False, nothing else asked."""
    live = read_live_allocator(_torch(False))
    assert (live.torch_version, live.cuda_available, live.backend, live.settings) == (
        "2.13.0+cu130",
        False,
        None,
        None,
    )


def test_native_backend_reads_the_snapshot_settings():
    """CUDA + native: backend and the snapshot's allocator_settings."""
    live = read_live_allocator(_torch(True, settings={"expandable_segments": True}))
    assert (live.backend, live.settings) == ("native", {"expandable_segments": True})


def test_async_backend_does_not_ask_for_native_settings():
    """cudaMallocAsync: the backend only (its snapshot has no native settings)."""
    live = read_live_allocator(_torch(True, backend="cudaMallocAsync", settings={"x": 1}))
    assert (live.backend, live.settings) == ("cudaMallocAsync", None)


def test_the_installed_cpu_torch_reports_no_cuda():
    """The real CPU build: cuda_available False and its version string."""
    import torch

    live = read_live_allocator()
    assert live.cuda_available is False and live.torch_version == torch.__version__
