"""cuDNN convolution workspaces (bounded by CUDNN_CONV_WSCAP_DBG, else warned) and RNN warnings."""

from __future__ import annotations

import pytest
import torch

from oomkit.prediction.tracing import EmulationRegistry, TraceRecording, trace_step
from oomkit.prediction.tracing.emulations import (
    conv_runs_cudnn,
    conv_workspace_cap_bytes,
    register_defaults,
)

MIB = 1 << 20
CONV = "aten.convolution.default"
CONV_BWD = "aten.convolution_backward.default"


def _registry(environ: dict[str, str]) -> EmulationRegistry:
    registry = EmulationRegistry()
    register_defaults(registry, environ=environ)
    return registry


def _conv_events(recording: TraceRecording) -> list[tuple[str, int, str | None]]:
    """(action, size, emulated) of conv allocations and of workspace frees, in order."""
    ops = {CONV, CONV_BWD}
    out = []
    for e in recording.events:
        tags = dict(e.tags)
        if e.action == "alloc" and tags.get("op") in ops:
            out.append(("alloc", e.size, tags.get("emulated")))
        elif e.action == "free_requested" and tags.get("category") == "workspace":
            out.append(("free", e.size, None))
    return out


def _conv_net() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3)
        )


def _train_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def test_cap_parsing():
    """CUDNN_CONV_WSCAP_DBG is whole MiB; unset, negative or unparsable means no cap."""
    assert conv_workspace_cap_bytes({"CUDNN_CONV_WSCAP_DBG": "64"}) == 64 * MIB
    assert conv_workspace_cap_bytes({"CUDNN_CONV_WSCAP_DBG": " 0 "}) == 0
    assert conv_workspace_cap_bytes({}) is None
    assert conv_workspace_cap_bytes({"CUDNN_CONV_WSCAP_DBG": "-1"}) is None
    assert conv_workspace_cap_bytes({"CUDNN_CONV_WSCAP_DBG": "64MB"}) is None


def test_conv_net_records_one_capped_workspace_per_cudnn_call():
    """2 convs, input without grad: 2 forward + 3 backward cuDNN calls, 64 MiB each, each freed
    at once, after the tensor its call makes (Conv_v8.cpp run_conv_plan). conv2's gradient is
    sum()'s expanded one: each of its input and weight backwards copies it contiguous first
    (ConvShared.cpp grad_output.contiguous(layout)); conv1's, from the ReLU, is contiguous."""
    x = torch.randn(2, 3, 16, 16, device="meta")
    recording = trace_step(
        _train_step, _conv_net(), x, emulations=_registry({"CUDNN_CONV_WSCAP_DBG": "64"})
    )
    ws = ("alloc", 64 * MIB, "cudnn_conv_workspace")
    freed = ("free", 64 * MIB, None)
    assert _conv_events(recording) == [
        ("alloc", 2 * 8 * 14 * 14 * 4, None), ws, freed,  # conv1 output
        ("alloc", 2 * 8 * 12 * 12 * 4, None), ws, freed,  # conv2 output
        ("alloc", 2 * 8 * 12 * 12 * 4, "cudnn_layout_copy"),  # conv2's expanded gradient
        ("alloc", 2 * 8 * 14 * 14 * 4, None), ws, freed,  # conv2 grad_input
        ("alloc", 2 * 8 * 12 * 12 * 4, "cudnn_layout_copy"),  # again, for the weight's
        ("alloc", 8 * 8 * 3 * 3 * 4, None), ws, freed,  # conv2 grad_weight
        ("alloc", 8 * 4, None),  # conv2 grad_bias (a reduction, no cuDNN plan)
        ("alloc", 8 * 3 * 3 * 3 * 4, None), ws, freed,  # conv1 grad_weight only
        ("alloc", 8 * 4, None),
    ]
    assert recording.assumptions["cuDNN convolution workspace"] == (
        "heuristic mode; at most 64 MiB per call (CUDNN_CONV_WSCAP_DBG), recorded"
    )
    assert recording.kernel_choices == {"cuDNN convolution": 5}
    assert recording.warnings == ()


def test_capped_workspace_raises_the_peak_by_exactly_the_cap():
    """The workspace is transient: the peak grows by one cap, not by one per call."""
    x = torch.randn(2, 3, 16, 16, device="meta")
    capped = trace_step(
        _train_step, _conv_net(), x, emulations=_registry({"CUDNN_CONV_WSCAP_DBG": "64"})
    )
    uncapped = trace_step(_train_step, _conv_net(), x, emulations=_registry({}))
    workspace = capped.allocated_bytes("workspace")
    assert workspace == 5 * 64 * MIB
    assert capped.peak_allocated_bytes() > 64 * MIB
    assert capped.peak_allocated_bytes() - uncapped.peak_allocated_bytes() <= 64 * MIB


def test_zero_cap_records_nothing_and_warns_nothing():
    """CUDNN_CONV_WSCAP_DBG=0: cuDNN may use no workspace; nothing to record, nothing unknown."""
    x = torch.randn(2, 3, 16, 16, device="meta")
    recording = trace_step(
        _train_step, _conv_net(), x, emulations=_registry({"CUDNN_CONV_WSCAP_DBG": "0"})
    )
    assert recording.allocated_bytes("workspace") == 0
    assert recording.warnings == ()


def test_without_a_cap_each_conv_op_is_warned_by_name():
    """No cap: no workspace is recorded and both conv ops are named with their call counts, in
    one warning (the part they leave out is the same)."""
    x = torch.randn(2, 3, 16, 16, device="meta")
    recording = trace_step(_train_step, _conv_net(), x, emulations=_registry({}))
    assert recording.allocated_bytes("workspace") == 0
    (warning,) = recording.warnings
    assert warning.startswith(
        f"{CONV} ran 2 time(s), {CONV_BWD} ran 2 time(s); their CUDA memory is emulated except "
        "the cuDNN convolution workspace (cuDNN sizes it at run time"
    )
    assert recording.assumptions["cuDNN convolution workspace"] == (
        "heuristic mode; sized by cuDNN at run time, not recorded"
    )


def test_benchmark_mode_is_stated_and_its_search_warned():
    """torch.backends.cudnn.benchmark=True: the assumption says so; the plan search is warned."""
    x = torch.randn(2, 3, 16, 16, device="meta")
    with torch.backends.cudnn.flags(enabled=True, benchmark=True):
        recording = trace_step(
            _train_step, _conv_net(), x, emulations=_registry({"CUDNN_CONV_WSCAP_DBG": "8"})
        )
    assert recording.assumptions["cuDNN convolution workspace"].startswith("benchmark mode")
    assert any("benchmark mode's first call" in w for w in recording.warnings)


def test_depthwise_fp32_runs_pytorchs_own_kernel_without_workspace():
    """groups == C_in, contiguous fp32: CudaDepthwise2d, so no cuDNN workspace and no warning."""
    with torch.device("meta"):
        conv = torch.nn.Conv2d(8, 16, 3, groups=8)
    x = torch.randn(2, 8, 16, 16, device="meta")
    recording = trace_step(_train_step, conv, x, emulations=_registry({"CUDNN_CONV_WSCAP_DBG": "64"}))
    assert recording.allocated_bytes("workspace") == 0
    assert recording.kernel_choices == {"CUDA depthwise convolution": 2}
    assert recording.warnings == ()


@pytest.mark.parametrize(
    ("dtype", "channels_last", "groups", "cudnn"),
    [
        (torch.float32, False, 1, True),
        (torch.float32, False, 8, False),
        (torch.bfloat16, False, 8, False),
        (torch.float16, False, 8, True),
        (torch.float32, True, 8, True),
        (torch.float32, False, 4, True),  # grouped, not depthwise
    ],
)
def test_conv_backend_choice(dtype, channels_last, groups, cudnn):
    """Depthwise contiguous non-fp16 convs skip cuDNN; channels-last, fp16 and others take it."""
    x = torch.empty(2, 8, 16, 16, device="meta", dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    w = torch.empty(16, 8 // groups, 3, 3, device="meta", dtype=dtype)
    assert conv_runs_cudnn(x, w, groups, transposed=False) is cudnn


def test_cudnn_disabled_warns_about_the_slow_path_columns():
    """torch.backends.cudnn.enabled=False: no workspace; the im2col columns are warned about."""
    x = torch.randn(2, 3, 16, 16, device="meta")
    with torch.backends.cudnn.flags(enabled=False):
        recording = trace_step(
            _train_step, _conv_net(), x, emulations=_registry({"CUDNN_CONV_WSCAP_DBG": "64"})
        )
    assert recording.allocated_bytes("workspace") == 0
    assert any("im2col columns" in w for w in recording.warnings)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_rnn_step_is_warned_and_its_assumption_stated(kind):
    """nn.LSTM/GRU/RNN: one cuDNN call each on CUDA; its workspace is warned, not recorded."""
    with torch.device("meta"):
        rnn = getattr(torch.nn, kind)(16, 32, batch_first=True)
    x = torch.randn(2, 5, 16, device="meta")
    recording = trace_step(lambda m, s: m(s)[0].sum().backward(), rnn, x)
    function = {"LSTM": "lstm", "GRU": "gru", "RNN": "rnn_tanh"}[kind]
    assert [w.split(";")[0] for w in recording.warnings if "cuDNN RNN" in w] == [
        f"torch._VF.{function} ran 1 time(s)"
    ]
    assert "reserve space" in recording.assumptions["cuDNN RNN"]
    emulated = {dict(e.tags).get("emulated") for e in recording.events if e.action == "alloc"}
    assert emulated <= {None, "cublas_workspace"}  # no cuDNN buffer is invented


def test_lstm_reserve_stand_in_is_the_reference_cells_activations():
    """LSTM(16, 32), batch 2, seq 5, fp32: per step two [2, 128] gate GEMMs (1024 B), three
    [2, 32] products and one tanh (256 B each); plus h0/c0 zeros and the stacked output, hy,
    cy. What is saved for backward stands in for cuDNN's training reserve space."""
    with torch.device("meta"):
        lstm = torch.nn.LSTM(16, 32, batch_first=True)
    x = torch.randn(2, 5, 16, device="meta")
    recording = trace_step(lambda m, s: m(s)[0].sum().backward(), lstm, x)
    forward = [
        e
        for e in recording.events
        if e.action == "alloc"
        and dict(e.tags)["phase"] == "forward"
        and dict(e.tags)["category"] != "workspace"
    ]
    steps = 5
    per_step = 2 * 1024 + 3 * 256 + 256
    assert sum(e.size for e in forward) == steps * per_step + 2 * 256 + 5 * 2 * 32 * 4 + 2 * 256
    saved = sum(e.size for e in forward if dict(e.tags).get("saved_for_backward") == "true")
    # Saved: each step's gate buffer (the second GEMM is added into it, the activations are
    # applied in place) and tanh(c_t); c_t and h_t of every step but the last (the next step's
    # products and GEMM read them); h0 and c0.
    assert saved == steps * (1024 + 256) + (steps - 1) * (256 + 256) + 2 * 256
