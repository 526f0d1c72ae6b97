"""``F.rms_norm`` as CUDA runs it since torch 2.9 (emulations/rms_norm.py): ``_fused_rms_norm``'s
output and rstd, the input, weight and rstd kept for backward, the backward's copies and its
two-pass weight gradient; the composite where CUDA runs it (older torch, a dtype mismatch)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.target import Target
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.emulation_sites import two_pass_gamma_rows

torch = pytest.importorskip("torch")

H100 = Target.resolve("h100", torch_version="2.13.0")
H100_TORCH_2_8 = Target.resolve("h100", torch_version="2.8.0")
FUSED = "aten._fused_rms_norm.default"
BACKWARD = "aten._fused_rms_norm_backward.default"


def _norm(dtype=torch.float32, width=1024):
    with torch.device("meta"):
        return torch.nn.RMSNorm(width, dtype=dtype)


def _live_after_forward(norm, rows, dtype, target=H100, autocast=False):
    """(bytes, op) of every block live when the forward returns (its output held)."""
    held = []

    def step(module):
        x = torch.randn(rows, norm.normalized_shape[0], device="cuda", dtype=dtype,
                        requires_grad=True)
        if autocast:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                held.append(module(x))
        else:
            held.append(module(x))

    recording = trace_step(step, norm, target=target)
    live = {}
    for event in recording.events[recording.step_starts[0]:]:
        if event.action == "alloc":
            live[event.address] = (event.size, event.tag("op"))
        elif event.action == "free_completed":
            live.pop(event.address, None)
    return sorted(live.values())


def _backward(norm, rows, dtype=torch.float32, contiguous_grad=False):
    """(action, bytes, op, emulated) from the backward's first allocation on."""

    def step(module):
        x = torch.randn(rows, norm.normalized_shape[0], device="cuda", dtype=dtype,
                        requires_grad=True)
        y = module(x)
        if contiguous_grad:
            y.backward(torch.ones_like(y))
        else:
            y.sum().backward()  # an expanded, non-contiguous gradient

    recording = trace_step(step, norm, target=H100)
    events = [
        (e.action, e.size, e.tag("op"), e.tag("emulated"))
        for e in recording.events[recording.step_starts[0]:]
        if e.action in ("alloc", "free_completed")
    ]
    start = next(i for i, e in enumerate(events) if e[2] == BACKWARD)
    return events[start:]


def test_the_fused_kernel_keeps_the_input_and_rstd_not_the_composites_product():
    """2,048 rows of 1,024, fp32: the output (8 MiB) and one fp32 rstd per row (8 KiB), both
    made by _fused_rms_norm; the composite (torch 2.8, as CUDA ran it then) also keeps its
    normalised product, 8 MiB more."""
    fused = _live_after_forward(_norm(), 2048, torch.float32)
    assert fused == [(8192, FUSED), (8_388_608, FUSED), (8_388_608, "aten.randn.default")]
    composite = _live_after_forward(_norm(), 2048, torch.float32, target=H100_TORCH_2_8)
    assert FUSED not in {op for _, op in composite}
    assert sum(n for n, _ in composite) - sum(n for n, _ in fused) == 8_388_608


def test_bf16_keeps_a_bf16_output_and_an_fp32_rstd_where_the_composite_keeps_4x_more():
    fused = _live_after_forward(_norm(torch.bfloat16), 2048, torch.bfloat16)
    assert fused == sorted([(4_194_304, FUSED), (4_194_304, "aten.randn.default"), (8192, FUSED)])
    composite = _live_after_forward(_norm(torch.bfloat16), 2048, torch.bfloat16,
                                    target=H100_TORCH_2_8)
    extra = sum(n for n, _ in composite) - sum(n for n, _ in fused)
    assert extra == 4 * 4_194_304  # fp32 copies of the input and of the normalised product


def test_under_autocast_the_input_is_cast_to_fp32_first():
    """rms_norm is on autocast's fp32 list since 2.12: the bf16 input's fp32 copy (kept: it is
    the op's input), then the fused op in fp32."""
    live = _live_after_forward(_norm(), 2048, torch.bfloat16, autocast=True)
    assert sorted(live) == sorted([
        (4_194_304, "aten.randn.default"),
        (8_388_608, "aten._to_copy.default"),
        (8_388_608, FUSED),
        (8192, FUSED),
    ])


def test_a_weight_of_another_dtype_runs_the_composite_as_on_cuda():
    """rms_norm_symint: weight dtype != input dtype warns and takes the composite."""
    live = _live_after_forward(_norm(torch.float32), 2048, torch.bfloat16)
    assert FUSED not in {op for _, op in live}


def test_backward_allocates_dx_dgamma_then_copies_a_non_contiguous_gradient():
    """_fused_rms_norm_backward_cuda: dX (8 MiB), dgamma (4 KiB), then RMSNormBackwardKernelImpl's
    dY.contiguous() of sum()'s expanded gradient, freed first; a contiguous gradient is not
    copied."""
    events = _backward(_norm(), 2048)
    assert events[:5] == [
        ("alloc", 8_388_608, BACKWARD, None),
        ("alloc", 4096, BACKWARD, None),
        ("alloc", 8_388_608, BACKWARD, "norm_grad_copy"),
        ("free_completed", 8_388_608, None, None),
        ("free_completed", 8192, None, None),  # rstd, released with the graph
    ]
    plain = _backward(_norm(), 2048, contiguous_grad=True)
    assert not [e for e in plain if e[3] == "norm_grad_copy"]


def test_more_than_65536_rows_reduce_the_weight_gradient_in_two_passes():
    """100,000 rows of 1,024 (bf16) on an H100 (132 SMs: 1,024 / 32 = 32 < 66): 1,024 rows of
    partial sums (2 MiB), then dgamma_blocks.sum(0) as the new dgamma with the reduction's
    staging; the first dgamma and the partial sums are freed after it."""
    events = _backward(_norm(torch.bfloat16), 100_000, torch.bfloat16)
    assert events[:7] == [
        ("alloc", 204_800_000, BACKWARD, None),
        ("alloc", 2048, BACKWARD, "two_pass_dgamma"),
        ("alloc", 204_800_000, BACKWARD, "norm_grad_copy"),
        ("alloc", 2_097_152, BACKWARD, "two_pass_dgamma_blocks"),
        ("alloc", 2048, BACKWARD, None),
        ("alloc", 8_388_608, BACKWARD, "two_pass_dgamma_reduction_staging"),
        ("alloc", 32, BACKWARD, "two_pass_dgamma_reduction_semaphores"),
    ]
    assert [e[1] for e in events[7:12]] == [32, 8_388_608, 2048, 2_097_152, 204_800_000]


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 10**8),
    columns=st.integers(1, 1 << 20),
    sms=st.integers(1, 200),
)
def test_two_pass_rows_follow_launch_gamma_beta_backward(rows, columns, sms):
    got = two_pass_gamma_rows(rows, columns, sms)
    if rows <= 65536 or columns // 32 >= sms // 2:
        assert got is None
    else:
        blocks_x = -(-columns // 32)
        assert got == min(32768 // blocks_x, -(-rows // 32))
        assert 1 <= got <= -(-rows // 32)
