"""Training batch norm recorded as cudnn_batch_norm runs it on CUDA."""

from __future__ import annotations

import torch

from oomkit.prediction.tracing import TraceRecording, trace_step
from oomkit.prediction.tracing.emulations import uses_cudnn

BN = "aten.native_batch_norm.default"
BN_BWD = "aten.native_batch_norm_backward.default"
N, C, H, W = 4, 8, 5, 5
FP32 = 4


def _allocs(recording: TraceRecording, op: str) -> list[tuple[int, str | None]]:
    return [
        (e.size, dict(e.tags).get("emulated"))
        for e in recording.events
        if e.action == "alloc" and dict(e.tags).get("op") == op
    ]


def _bn(**kwargs) -> torch.nn.BatchNorm2d:
    with torch.device("meta"):
        return torch.nn.BatchNorm2d(C, **kwargs)


def _input(memory_format=torch.contiguous_format, dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(N, C, H, W, device="meta", dtype=dtype)
    return x.contiguous(memory_format=memory_format).requires_grad_()


def _sum_step(m, t):
    m(t).sum().backward()


def _relu_step(m, t):
    torch.relu(m(t)).sum().backward()


def test_forward_records_output_and_fp32_stats_without_warning():
    """cudnn_batch_norm NCHW: output [N, C, H, W] and save_mean/save_var [C] fp32; no reserve."""
    recording = trace_step(_sum_step, _bn(), _input())
    assert _allocs(recording, BN) == [
        (N * C * H * W * FP32, None),
        (C * FP32, None),
        (C * FP32, None),
    ]
    assert recording.warnings == ()


def test_half_input_keeps_fp32_statistics():
    """An fp16 input with fp32 weight goes to cuDNN; save_mean/save_var use the weight's fp32."""
    recording = trace_step(_sum_step, _bn(), _input(dtype=torch.float16))
    assert _allocs(recording, BN) == [(N * C * H * W * 2, None), (C * FP32, None), (C * FP32, None)]


def test_backward_copies_a_non_contiguous_grad_output():
    """.sum()'s expanded gradient: a contiguous copy (input-sized) lives during the backward."""
    recording = trace_step(_sum_step, _bn(), _input())
    assert _allocs(recording, BN_BWD) == [
        (N * C * H * W * FP32, "cudnn_bn_grad_output"),
        (N * C * H * W * FP32, None),
        (C * FP32, None),
        (C * FP32, None),
    ]
    events = recording.events
    last_bwd = max(
        i for i, e in enumerate(events) if e.action == "alloc" and dict(e.tags).get("op") == BN_BWD
    )
    copy = next(e for e in events if dict(e.tags).get("emulated") == "cudnn_bn_grad_output")
    # Freed when the op returns, after grad_input, grad_weight and grad_bias were allocated.
    assert (events[last_bwd + 1].action, events[last_bwd + 1].address) == (
        "free_requested",
        copy.address,
    )


def test_backward_with_contiguous_grad_output_copies_nothing():
    """ReLU's backward hands batch norm a contiguous gradient: no copy, just the three grads."""
    recording = trace_step(_relu_step, _bn(), _input())
    assert _allocs(recording, BN_BWD) == [
        (N * C * H * W * FP32, None),
        (C * FP32, None),
        (C * FP32, None),
    ]


def test_channels_last_warns_about_the_persistent_reserve():
    """Channels-last training uses the persistent kernels, whose reserve space stays a warning:
    one, naming the forward and the backward op."""
    recording = trace_step(_relu_step, _bn(), _input(torch.channels_last))
    (warning,) = recording.warnings
    assert warning.startswith(f"{BN} ran 1 time(s), {BN_BWD} ran 1 time(s); their CUDA memory")
    assert "persistent (channels-last) batch-norm reserve space" in warning


def test_a_sliced_channels_last_input_is_channels_last_as_cuda_reads_it():
    """TensorImpl::suggest_memory_format reads channels last from the strides' order, dense or
    not (c10 is_channels_last_strides_2d): a channels-last batch sliced on W takes the
    persistent kernels too. The rule had asked is_contiguous(channels_last), false here."""
    wide = torch.randn(N, C, H, 2 * W, device="meta").contiguous(memory_format=torch.channels_last)
    sliced = wide[..., ::2].detach().requires_grad_()
    assert not sliced.is_contiguous(memory_format=torch.channels_last)
    recording = trace_step(_relu_step, _bn(), sliced)
    assert "persistent (channels-last) batch-norm reserve space" in recording.warnings[0]


def test_eval_mode_is_recorded_as_meta_runs_it():
    """Inference batch norm needs no reserve: output only, no warning."""
    bn = _bn().eval()
    x = torch.randn(N, C, H, W, device="meta")
    recording = trace_step(lambda m, t: m(t), bn, x)
    assert [size for size, _ in _allocs(recording, BN)][0] == N * C * H * W * FP32
    assert recording.warnings == ()


def test_uses_cudnn_mirrors_select_batch_norm_backend():
    """bf16, fp16 weights, 2-D inputs, missing affine and huge batches take the native kernel."""
    x = torch.empty(4, 8, 5, 5, device="meta")
    w = torch.empty(8, device="meta")
    stats = (torch.empty(8, device="meta"), torch.empty(8, device="meta"))
    assert uses_cudnn(x, w, w, *stats, True)
    assert uses_cudnn(x, w, w, None, None, True)
    assert not uses_cudnn(x, w, w, None, None, False)
    assert not uses_cudnn(x.bfloat16(), w.bfloat16(), w.bfloat16(), *stats, True)
    assert not uses_cudnn(x.half(), w.half(), w.half(), *stats, True)
    assert uses_cudnn(x.half(), w, w, *stats, True)
    assert not uses_cudnn(torch.empty(4, 8, device="meta"), w, w, *stats, True)
    assert not uses_cudnn(x, None, None, *stats, True)
    assert not uses_cudnn(torch.empty(880802, 8, 1, device="meta"), w, w, *stats, True)
    assert uses_cudnn(torch.empty(880801, 8, 1, device="meta"), w, w, *stats, True)
