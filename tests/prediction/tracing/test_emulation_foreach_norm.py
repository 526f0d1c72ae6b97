"""``_foreach_norm`` as CUDA runs it (emulations/foreach_norm.py): the per-chunk partial norms
allocated before the norms and freed after them, on the multi-tensor kernel's route only."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.target import Target
from oomkit.prediction.models import StepOptions, build_preset_step
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.emulations.foreach_norm import foreach_norm_partials_bytes

torch = pytest.importorskip("torch")

H200 = Target.resolve("h200")


def _events(step, *inputs):
    recording = trace_step(step, torch.nn.Identity(), *inputs, target=H200)
    start = recording.step_starts[0]
    return [
        (e.action, e.size, e.tag("emulated")) for e in recording.events[start:]
        if e.action in ("alloc", "free_completed")
    ]


def _meta(*sizes, dtype=torch.float32):
    return torch.empty(*sizes, device="meta", dtype=dtype)


def _norms(*tensors, ord=2.0, dtype=None):
    def step(model, *ts):
        torch._foreach_norm(list(ts), ord, dtype=dtype)

    return _events(step, *tensors)


def test_the_partials_come_first_and_are_freed_after_the_norms():
    """Three gradients, the largest 400 x 70,000 (28,000,000 elements: 428 chunks of 65,536):
    3 x 428 float partials (5,136 bytes), then one 4-byte norm each; the partials are freed
    when the op returns, the norms when the step drops them."""
    events = _norms(_meta(400, 300), _meta(400), _meta(70_000, 400))
    assert events[:5] == [
        ("alloc", 5136, "foreach_norm_partials"),
        ("alloc", 4, None),
        ("alloc", 4, None),
        ("alloc", 4, None),
        ("free_completed", 5136, None),
    ]
    assert [e[:2] for e in events[5:]] == [("free_completed", 4)] * 3


def test_half_precision_sums_in_float_and_double_in_double():
    """opmath of the output dtype: bf16 gradients' partials are float (4 bytes), their norms
    bf16 (2 bytes); float64's partials 8 bytes; a float32 norm asked of bf16 gradients (dtype=)
    makes float32 norms over float partials."""
    assert [e[1] for e in _norms(_meta(65_537, dtype=torch.bfloat16))[:2]] == [2 * 1 * 4, 2]
    assert [e[1] for e in _norms(_meta(10, dtype=torch.float64))[:2]] == [8, 8]
    asked = _norms(_meta(65_536, dtype=torch.bfloat16), _meta(3, dtype=torch.bfloat16),
                   dtype=torch.float32)
    assert [e[1] for e in asked[:3]] == [2 * 1 * 4, 4, 4]


def test_off_the_fast_route_only_the_norms_are_recorded():
    """ForeachUtils.h can_use_fast_route: a strided slice (not dense), mixed dtypes, an ord
    other than 1, 2 or inf: foreach_tensor_norm_slow, one linalg_vector_norm each."""
    wide = _meta(8, 16)

    def sliced(model, w):
        torch._foreach_norm([w[:, :5], w], 2.0)

    for events in (
        _events(sliced, wide),
        _norms(_meta(4), _meta(4, dtype=torch.float64)),
        _norms(_meta(4), _meta(5), ord=3.0),
    ):
        assert not [e for e in events if e[2]]
    for ord_ in (1.0, math.inf, 2):
        assert _norms(_meta(4), ord=ord_)[0] == ("alloc", 4, "foreach_norm_partials")


def test_an_empty_gradient_takes_a_fresh_zero_and_frees_an_unused_norm():
    """An empty tensor's norm is a new at::zeros({}) after the others, and as many of the
    norms made first go unused, freed before the partials; an all-empty list has no partials
    (a zero-byte request allocates nothing)."""
    events = _norms(_meta(100_000), _meta(0))
    assert events[:6] == [
        ("alloc", 2 * 2 * 4, "foreach_norm_partials"),
        ("alloc", 4, "foreach_norm_unused_result"),
        ("alloc", 4, None),
        ("alloc", 4, None),
        ("free_completed", 4, None),
        ("free_completed", 16, None),
    ]
    assert [e[2] for e in _norms(_meta(0), _meta(0))[:3]] == [
        "foreach_norm_unused_result", "foreach_norm_unused_result", None,
    ]


def test_gpt2_clipping_stages_348688_bytes_before_its_148_norms():
    """GPT-2 124M's step with --max-grad-norm 1 (clip_grad_norm_ before the optimizer step):
    its 148 gradients' norms (wte: 50,257 x 768 elements, 589 chunks) after 148 x 589 float
    partials, in every step."""
    built = build_preset_step("gpt2-124m", StepOptions(batch_size=1, seq_len=32, max_grad_norm=1.0))
    recording = trace_step(built.step_fn, *built.track, steps=2, target=H200)
    events = recording.events
    partials = [i for i, e in enumerate(events) if e.tag("emulated") == "foreach_norm_partials"]
    assert [events[i].size for i in partials] == [348_688, 348_688]
    for i in partials:
        assert [e.tag("op") for e in events[i + 1:i + 149]] == ["aten._foreach_norm.Scalar"] * 148
        assert events[i + 149].action == "free_requested" and events[i + 149].size == 348_688


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(0, 10**10), min_size=1, max_size=300),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
)
def test_partials_are_every_tensor_times_the_most_chunks(numels, dtype):
    chunks = [-(-n // 65536) for n in numels]
    opmath = 8 if dtype is torch.float64 else 4
    got = foreach_norm_partials_bytes(numels, dtype)
    assert got == len(numels) * max(chunks) * opmath
    assert got % opmath == 0 and (got == 0) == (max(numels) == 0)
