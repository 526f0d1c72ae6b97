"""Softmax and SDPA's math path as CUDA runs them (emulations/softmax.py, inplace_adds.py): the
scores' mask added in place, ``_safe_softmax``'s three temporaries, the softmax backward's
``grad * output``; each in the order the H200's trace of Llama 1B fp32 has them."""

from __future__ import annotations

import pytest

from oomkit.core.target import Target
from oomkit.prediction.tracing import trace_step

torch = pytest.importorskip("torch")
F = torch.nn.functional

H200 = Target.resolve("h200")


def _requests(step, *inputs):
    recording = trace_step(step, torch.nn.Identity(), *inputs, target=H200)
    return [(e.action, e.size, e.tag("op", ""), e.tag("emulated")) for e in recording.events
            if e.action in ("alloc", "free_completed")]


def _param(*sizes):
    return torch.empty(*sizes, device="meta", requires_grad=True)


def test_the_softmax_backward_multiplies_grad_by_output_first():
    """SoftMax.cu softmax_backward_cuda_out: the gradient (2 x 4 x 8 fp32), then grad * output
    of the same size, freed at once."""
    x = _param(2, 4, 8)
    events = _requests(lambda model, x: F.softmax(x, -1).sum().backward(), x)
    at = next(i for i, e in enumerate(events) if e[2] == "aten._softmax_backward_data.default")
    assert events[at:at + 3] == [
        ("alloc", 256, "aten._softmax_backward_data.default", None),
        ("alloc", 256, "aten._softmax_backward_data.default", "softmax_backward_product"),
        ("free_completed", 256, "", None),
    ]


def _gqa_attention(model, q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum()


def test_the_math_path_adds_the_mask_in_place_and_safe_softmax_takes_three_temporaries():
    """fp32 grouped-query attention on an H200 runs the math path (as Llama 1B fp32 did):
    scores 1 x 4 x 16 x 16 fp32 (4 KiB), the mask added in place (no second scores buffer),
    then the softmax's output, 1 byte per score, 1 byte per row and a 4-byte zero."""
    q = torch.empty(1, 4, 16, 8, device="meta")
    k = v = torch.empty(1, 2, 16, 8, device="meta")
    mask = torch.empty(1, 1, 16, 16, device="meta")
    events = _requests(_gqa_attention, q, k, v, mask)
    ops = [e[2] for e in events if e[0] == "alloc"]
    assert "aten.bmm.default" in ops and "aten.add.Tensor" not in ops
    at = next(i for i, e in enumerate(events) if e[2] == "aten._safe_softmax.default")
    assert [e[:2] + (e[3],) for e in events[at:at + 7]] == [
        ("alloc", 4096, None),
        ("alloc", 1024, "safe_softmax_neginf_mask"),
        ("alloc", 64, "safe_softmax_masked_rows"),
        ("alloc", 4, "safe_softmax_zero"),
        ("free_completed", 4, None),
        ("free_completed", 64, None),
        ("free_completed", 1024, None),
    ]


def test_outside_the_math_path_an_add_is_out_of_place_as_before():
    """The in-place add is the math path's alone: a plain ``a + b`` still allocates."""
    a, b = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")
    events = _requests(lambda model, a, b: a + b, a, b)
    assert ("alloc", 128, "aten.add.Tensor", None) in events


def test_linear_on_its_matmul_path_adds_the_bias_in_place():
    """Linear.cpp: a transposed 3-D input (nn.MultiheadAttention's batch_first inputs) takes
    matmul then ``output.add_(bias)``: the [197, 8, 2304] fp32 output once, not twice (as
    torchvision's ViT-B/16 in-projection on an H200); a contiguous input takes addmm."""
    weight = torch.empty(2304, 768, device="meta")
    bias = torch.empty(2304, device="meta")
    x = torch.empty(8, 197, 768, device="meta")

    def project(model, x, weight, bias):
        return F.linear(x.transpose(0, 1), weight, bias)

    events = _requests(project, x, weight, bias)
    outputs = [e for e in events if e[0] == "alloc" and e[1] == 197 * 8 * 2304 * 4]
    assert [e[2] for e in outputs] == ["aten.bmm.default"]  # matmul's batched product
    assert not [e for e in events if e[0] == "alloc" and e[2] == "aten.add.Tensor"]
    contiguous = _requests(lambda model, x, w, b: F.linear(x, w, b), x, weight, bias)
    assert [e[2] for e in contiguous if e[0] == "alloc" and e[1] == 197 * 8 * 2304 * 4] == [
        "aten.addmm.default"
    ]


def test_a_layer_norm_backward_copies_a_transposed_gradient_after_its_outputs():
    """layer_norm_kernel.cu: the CUDA kernel runs on dY.contiguous(), made after dX, dgamma and
    dbeta (ViT's ln_1, whose output nn.MultiheadAttention transposes); a contiguous gradient is
    not copied."""
    ln = torch.nn.LayerNorm(768, device="meta")
    x = torch.empty(8, 197, 768, device="meta", requires_grad=True)

    def transposed(model, x):
        y = ln(x).transpose(0, 1).contiguous()
        (y * y).sum().backward()  # ln's gradient: y's, transposed back (not contiguous)

    events = _requests(transposed, x)
    at = next(i for i, e in enumerate(events) if e[2] == "aten.native_layer_norm_backward.default")
    assert [e[:2] + (e[3],) for e in events[at:at + 5]] == [
        ("alloc", 8 * 197 * 768 * 4, None),  # dX
        ("alloc", 768 * 4, None),  # dgamma
        ("alloc", 768 * 4, None),  # dbeta
        ("alloc", 8 * 197 * 768 * 4, "norm_grad_copy"),
        ("free_completed", 8 * 197 * 768 * 4, None),
    ]
    plain = _requests(lambda model, x: (ln(x) * ln(x)).sum().backward(), x)
    assert not [e for e in plain if e[3] == "norm_grad_copy"]
