"""``native_layer_norm`` and its backward as CUDA runs them (emulations/layer_norm.py): the
inputs' contiguous copies, and past 65,536 rows the two-pass weight and bias gradients of
``LaunchGammaBetaBackwardCUDAKernel`` (torch 2.8 on)."""

from __future__ import annotations

import pytest

from oomkit.core.target import Target
from oomkit.prediction.tracing import trace_step

torch = pytest.importorskip("torch")

H100 = Target.resolve("h100", torch_version="2.13.0")
H100_TORCH_2_7 = Target.resolve("h100", torch_version="2.7.1")
FORWARD = "aten.native_layer_norm.default"
BACKWARD = "aten.native_layer_norm_backward.default"


def _events(step, target=H100):
    recording = trace_step(step, torch.nn.Identity(), target=target)
    return [
        (e.action, e.size, e.tag("op"), e.tag("emulated"))
        for e in recording.events[recording.step_starts[0]:]
        if e.action in ("alloc", "free_completed")
    ]


def _from(events, op):
    return events[next(i for i, e in enumerate(events) if e[2] == op):]


def _backward(rows, width=768, dtype=torch.float32, target=H100):
    """The events from the backward's first allocation on, for a contiguous gradient."""
    ln = torch.nn.LayerNorm(width, device="meta", dtype=dtype)

    def step(model):
        x = torch.randn(rows, width, device="cuda", dtype=dtype, requires_grad=True)
        y = ln(x)
        y.backward(torch.ones_like(y))

    return _from(_events(step, target), BACKWARD)


def test_the_forward_copies_a_transposed_input_before_its_outputs():
    """layer_norm_cuda: input.expect_contiguous() of a [197, 8, 768] fp32 input seen through a
    transpose (4,841,472 bytes), then Y, mean and rstd (8 x 197 fp32 each), the copy freed when
    it returns; a contiguous input is not copied."""
    ln = torch.nn.LayerNorm(768, device="meta")

    def transposed(model):
        x = torch.randn(197, 8, 768, device="cuda")
        ln(x.transpose(0, 1))

    assert _from(_events(transposed), FORWARD)[:5] == [
        ("alloc", 4_841_472, FORWARD, "layer_norm_contiguous_copy"),
        ("alloc", 4_841_472, FORWARD, None),
        ("alloc", 6304, FORWARD, None),
        ("alloc", 6304, FORWARD, None),
        ("free_completed", 4_841_472, None, None),
    ]
    plain = _events(lambda model: ln(torch.randn(8, 197, 768, device="cuda")))
    assert [e for e in plain if e[2] == FORWARD] == [
        ("alloc", 4_841_472, FORWARD, None),
        ("alloc", 6304, FORWARD, None),
        ("alloc", 6304, FORWARD, None),
    ]


def test_the_backward_copies_the_saved_transposed_input_before_dx():
    """layer_norm_backward_cuda: the saved input is the transposed view, copied again before dX,
    dgamma and dbeta; sum()'s expanded gradient is copied after them; the two copies are freed
    when the op returns, the gradient's first."""
    ln = torch.nn.LayerNorm(768, device="meta")

    def transposed(model):
        x = torch.randn(197, 8, 768, device="cuda", requires_grad=True)
        ln(x.transpose(0, 1)).sum().backward()

    assert _from(_events(transposed), BACKWARD)[:7] == [
        ("alloc", 4_841_472, BACKWARD, "layer_norm_contiguous_copy"),
        ("alloc", 4_841_472, BACKWARD, None),  # dX
        ("alloc", 3072, BACKWARD, None),  # dgamma
        ("alloc", 3072, BACKWARD, None),  # dbeta
        ("alloc", 4_841_472, BACKWARD, "norm_grad_copy"),
        ("free_completed", 4_841_472, None, None),
        ("free_completed", 4_841_472, None, None),
    ]


def test_more_than_65536_rows_reduce_the_weight_and_bias_gradients_in_two_passes():
    """100,000 rows of 768 (fp32) on an H100 (132 SMs: 768 / 32 = 24 < 66): 1,365 rows of
    partial sums for each (32,768 // 24 blocks; 4,193,280 bytes), then dgamma_blocks.sum(0) as
    the new dgamma with the reduction's staging, the first dgamma freed, the same for dbeta,
    then the partial sums, dbeta's first."""
    events = _backward(100_000)
    partial = 1365 * 768 * 4
    assert events[:6] == [
        ("alloc", 307_200_000, BACKWARD, None),  # dX
        ("alloc", 3072, BACKWARD, "two_pass_dgamma"),
        ("alloc", 3072, BACKWARD, "two_pass_dbeta"),
        ("alloc", partial, BACKWARD, "two_pass_dgamma_blocks"),
        ("alloc", partial, BACKWARD, "two_pass_dbeta_blocks"),
        ("alloc", 3072, BACKWARD, None),  # dgamma_blocks.sum(0)
    ]
    sums = [i for i, e in enumerate(events[:20]) if e[:2] == ("alloc", 3072) and e[3] is None]
    assert len(sums) == 2
    between = events[sums[0] + 1:sums[1]]
    staging = [e for e in between if e[0] == "alloc"]
    assert [e[3] for e in staging] == [
        "two_pass_dgamma_reduction_staging", "two_pass_dgamma_reduction_semaphores"
    ]
    # Each staging block is freed, then the first dgamma, before dbeta's sum asks.
    assert between[-1] == ("free_completed", 3072, None, None)
    after = events[sums[1] + 1:]
    frees = [e[1] for e in after if e[0] == "free_completed"]
    assert frees[len(staging):len(staging) + 3] == [3072, partial, partial]


@pytest.mark.parametrize(
    ("rows", "width", "target", "two_pass"),
    [
        (65_536, 768, H100, False),  # M > 64 * 1024 is strict
        (65_537, 768, H100, True),
        (100_000, 4096, H100, False),  # 4,096 / 32 = 128 >= 66
        (100_000, 768, H100_TORCH_2_7, False),  # before pytorch#148605
    ],
)
def test_the_two_pass_branch_runs_where_launch_gamma_beta_backward_takes_it(
    rows, width, target, two_pass
):
    emulated = {e[3] for e in _backward(rows, width, target=target)}
    assert ("two_pass_dgamma_blocks" in emulated) is two_pass
    assert ("two_pass_dbeta_blocks" in emulated) is two_pass


def test_without_an_affine_weight_nothing_is_reduced_in_two_passes():
    """LayerNorm(elementwise_affine=False): no dgamma or dbeta, so no partial sums."""
    ln = torch.nn.LayerNorm(768, elementwise_affine=False, device="meta")

    def step(model):
        x = torch.randn(100_000, 768, device="cuda", requires_grad=True)
        y = ln(x)
        y.backward(torch.ones_like(y))

    events = _from(_events(step), BACKWARD)
    assert events[0] == ("alloc", 307_200_000, BACKWARD, None)
    assert not [e for e in events if e[3] and e[3].startswith(("layer_norm_", "two_pass_"))]
