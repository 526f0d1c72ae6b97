"""cuBLAS / cuBLASLt workspaces, sized as CublasHandlePool.cpp sizes them."""

from __future__ import annotations

import torch

from oomkit.core.gpus import get_gpu
from oomkit.prediction.tracing import EmulationRegistry, trace_step
from oomkit.prediction.tracing.emulations import (
    cublas_workspace_bytes,
    cublaslt_unified,
    cublaslt_workspace_bytes,
    register_cublas,
)

H100 = get_gpu("h100-sxm")
A100 = get_gpu("a100-80gb")
MIB = 2**20


def test_default_size_by_architecture():
    """32 MiB on Hopper; :4096:2:16:8 (8 MiB + 128 KiB) on Ampere."""
    assert cublas_workspace_bytes(H100, {}) == 32 * MIB
    assert cublas_workspace_bytes(A100, {}) == 8 * MIB + 128 * 1024


def test_cublas_workspace_config_pairs_are_summed():
    """ ":4096:8" is 32 MiB; ":4096:2:16:8" is 8 MiB + 128 KiB; ":16:8" is 128 KiB."""
    assert cublas_workspace_bytes(A100, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) == 32 * MIB
    assert cublas_workspace_bytes(H100, {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == (
        8 * MIB + 128 * 1024
    )
    assert cublas_workspace_bytes(H100, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024


def test_unparsable_config_uses_the_default():
    """No :SIZE:COUNT pair found: PyTorch warns and keeps the architecture default."""
    assert cublas_workspace_bytes(H100, {"CUBLAS_WORKSPACE_CONFIG": "4096"}) == 32 * MIB


def test_lt_workspace_unified_or_separate():
    """Unified (default): capped at the cuBLAS size; separate: CUBLASLT_WORKSPACE_SIZE KiB."""
    assert cublaslt_workspace_bytes(H100, {}) == 32 * MIB
    assert cublaslt_workspace_bytes(H100, {"CUBLASLT_WORKSPACE_SIZE": "65536"}) == 32 * MIB
    separate = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    assert cublaslt_workspace_bytes(H100, separate) == 1024 * 1024
    assert cublaslt_workspace_bytes(H100, {**separate, "CUBLASLT_WORKSPACE_SIZE": "4096"}) == (
        4 * MIB
    )


def _registry(environ: dict[str, str]) -> EmulationRegistry:
    registry = EmulationRegistry()
    register_cublas(registry, environ)
    return registry


def _linear_train_step(model: torch.nn.Linear) -> None:
    model(torch.randn(4, 64, device="meta")).sum().backward()


def _workspaces(recording) -> list[tuple[int, str, str]]:
    return [
        (e.size, dict(e.tags)["phase"], dict(e.tags)["emulated"])
        for e in recording.events
        if e.action == "alloc" and dict(e.tags)["category"] == "workspace"
    ]


def test_one_workspace_per_thread_never_freed():
    """Forward (caller's thread) and backward (autograd's thread) each allocate one, kept."""
    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
    recording = trace_step(_linear_train_step, model, steps=2, emulations=_registry({}))
    assert _workspaces(recording) == [
        (32 * MIB, "forward", "cublas_workspace"),
        (32 * MIB, "backward", "cublas_workspace"),
    ]
    frees = [e for e in recording.events if e.action == "free_requested"]
    assert all(dict(e.tags)["category"] != "workspace" for e in frees)


def test_workspace_size_follows_the_target_gpu_and_environment():
    """An A100 target gets 8 MiB + 128 KiB; CUBLAS_WORKSPACE_CONFIG=:0:0 allocates nothing."""
    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
    on_a100 = trace_step(_linear_train_step, model, gpu=A100, emulations=_registry({}))
    assert [size for size, _, _ in _workspaces(on_a100)] == [8 * MIB + 128 * 1024] * 2
    zero = trace_step(
        _linear_train_step, model, emulations=_registry({"CUBLAS_WORKSPACE_CONFIG": ":0:0"})
    )
    assert _workspaces(zero) == []


def test_separate_lt_workspace_for_addmm_with_bias():
    """TORCH_CUBLASLT_UNIFIED_WORKSPACE=0: Linear's addmm gets the Lt handle, which is the cuBLAS
    handle (its workspace first), then a 1 MiB Lt workspace; backward's mm only the cuBLAS one."""
    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
    env = {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}
    recording = trace_step(_linear_train_step, model, emulations=_registry(env))
    assert _workspaces(recording) == [
        (32 * MIB, "forward", "cublas_workspace"),
        (MIB, "forward", "cublaslt_workspace"),
        (32 * MIB, "backward", "cublas_workspace"),
    ]


def test_the_running_torch_decides_when_none_is_stated(monkeypatch):
    """No torch version given: the rule of the torch that records (``torch.__version__``)."""
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
    recording = trace_step(_linear_train_step, model, emulations=_registry({}))
    assert [what for _, _, what in _workspaces(recording)] == [
        "cublas_workspace", "cublaslt_workspace", "cublas_workspace"
    ]


def test_unification_by_default_follows_the_torch_version():
    """Unset: separate before torch 2.12 (pytorch#175879), unified from it; set: as set."""
    assert not cublaslt_unified({}, "2.9.1")
    assert not cublaslt_unified({}, "2.11.0+cu130")
    assert cublaslt_unified({}, "2.12.0")
    assert cublaslt_unified({}, "2.13.0+cpu")
    assert cublaslt_unified({}, None)  # the newest rule
    assert cublaslt_unified({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "1"}, "2.10.0")
    assert not cublaslt_unified({"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}, "2.13.0")
    # 2.9-2.11 unset: the size parser still caps at the cuBLAS size, so min(1 MiB, cuBLAS).
    assert cublaslt_workspace_bytes(H100, {}, "2.11.0") == MIB
    tiny = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    assert cublaslt_workspace_bytes(H100, tiny, "2.11.0") == 128 * 1024


def test_torch_2_11_records_a_separate_lt_workspace_by_default():
    """A target on torch 2.11: Linear's forward addmm takes both workspaces."""
    with torch.device("meta"):
        model = torch.nn.Linear(64, 64)
    registry = EmulationRegistry()
    register_cublas(registry, {}, torch_version="2.11.0+cu130")
    recording = trace_step(_linear_train_step, model, emulations=registry)
    assert _workspaces(recording) == [
        (32 * MIB, "forward", "cublas_workspace"),
        (MIB, "forward", "cublaslt_workspace"),
        (32 * MIB, "backward", "cublas_workspace"),
    ]
