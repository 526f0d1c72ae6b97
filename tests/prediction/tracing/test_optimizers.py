"""torch.optim under the tracer behaves as on CUDA: foreach by default, fused, state, zero_grad."""

from __future__ import annotations

import pytest
import torch
import torch.optim.optimizer as optimizer_module

from oomkit.core.trace import TraceEvent
from oomkit.prediction.tracing import TraceRecording, cuda_optimizer_defaults, trace_step

WEIGHT_BYTES = 32 * 16 * 4  # Linear(16, 32) weight, fp32
BIAS_BYTES = 32 * 4
PARAM_BYTES = WEIGHT_BYTES + BIAS_BYTES


def _tag(event: TraceEvent, key: str) -> str | None:
    return dict(event.tags).get(key)


def _run(make_optimizer, *, steps: int = 2, set_to_none: bool = True):
    with torch.device("meta"):
        model = torch.nn.Linear(16, 32)
    optimizer = make_optimizer(model.parameters())

    def step(model, optimizer):
        model(torch.randn(4, 16, device="meta")).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)

    return trace_step(step, model, optimizer, steps=steps), optimizer


def _peak(recording: TraceRecording, category: str, phase: str, step: int) -> int:
    """Most bytes of one category/phase allocated in ``step`` that are live at once."""
    sizes: dict[int, int] = {}
    live = peak = 0
    for event in recording.step_events(step):
        if event.action == "alloc" and _tag(event, "category") == category:
            if _tag(event, "phase") == phase:
                sizes[event.address] = event.size
                live += event.size
                peak = max(peak, live)
        elif event.action == "free_requested" and event.address in sizes:
            live -= sizes.pop(event.address)
    return peak


def _optimizer_ops(recording: TraceRecording, step: int) -> list[str]:
    return [
        _tag(e, "op") or ""
        for e in recording.step_events(step)
        if e.action == "alloc" and _tag(e, "phase") == "optimizer"
    ]


def test_adam_defaults_to_foreach_as_on_cuda():
    """Adam() with no foreach/fused runs _multi_tensor_adam: one sqrt copy of all exp_avg_sq."""
    recording, _ = _run(torch.optim.Adam)
    assert _optimizer_ops(recording, 1) == ["aten._foreach_sqrt.default"] * 2
    assert _peak(recording, "temporary", "optimizer", 1) == PARAM_BYTES


def test_adam_single_tensor_when_foreach_is_false():
    """foreach=False keeps the per-parameter loop: sqrt and div live together, 2x the weight."""
    recording, _ = _run(lambda p: torch.optim.Adam(p, foreach=False))
    assert _optimizer_ops(recording, 1) == [
        "aten.sqrt.default",
        "aten.div.Tensor",
        "aten.sqrt.default",
        "aten.div.Tensor",
    ]
    # weight: sqrt + div (2 x 2048); bias: previous denom (2048) + sqrt + div (2 x 128).
    assert _peak(recording, "temporary", "optimizer", 1) == 2 * WEIGHT_BYTES


def test_adam_fused_allocates_no_temporaries():
    """fused=True: _fused_adam_ is in place; only `step` moves onto the device (4 bytes each)."""
    recording, optimizer = _run(lambda p: torch.optim.Adam(p, fused=True))
    assert _peak(recording, "temporary", "optimizer", 1) == 0
    assert recording.allocated_bytes("optimizer_state", step=0) == 2 * PARAM_BYTES + 2 * 4
    assert {state["step"].device.type for state in optimizer.state.values()} == {"meta"}


def test_first_step_creates_the_state_and_keeps_step_on_the_host():
    """Step 0 allocates exp_avg and exp_avg_sq per parameter; `step` is a CPU tensor; no more later."""
    recording, optimizer = _run(torch.optim.AdamW, steps=3)
    per_step = [recording.allocated_bytes("optimizer_state", step=s) for s in range(3)]
    assert per_step == [2 * PARAM_BYTES, 0, 0]
    assert {state["step"].device.type for state in optimizer.state.values()} == {"cpu"}


def test_sgd_with_momentum_defaults_to_foreach():
    """SGD(momentum) takes the foreach path: no per-parameter temporaries after step 0."""
    recording, _ = _run(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert recording.allocated_bytes("optimizer_state", step=0) == PARAM_BYTES
    assert _optimizer_ops(recording, 1) == []


def test_zero_grad_set_to_none_frees_gradients():
    """zero_grad() (set_to_none=True) frees both gradients inside every step."""
    recording, _ = _run(torch.optim.Adam)
    for step in range(2):
        events = recording.step_events(step)
        grads = {
            e.address for e in events if e.action == "alloc" and _tag(e, "category") == "gradient"
        }
        freed = {e.address for e in events if e.action == "free_completed"}
        assert len(grads) == 2 and grads <= freed


def test_zero_grad_without_set_to_none_keeps_gradients():
    """set_to_none=False zeroes in place: gradients are allocated once and never freed."""
    recording, _ = _run(torch.optim.Adam, set_to_none=False)
    assert [recording.allocated_bytes("gradient", step=s) for s in range(2)] == [PARAM_BYTES, 0]
    grads = {
        e.address
        for e in recording.events
        if e.action == "alloc" and _tag(e, "category") == "gradient"
    }
    assert not any(e.action == "free_completed" and e.address in grads for e in recording.events)


def test_clip_grad_norm_takes_the_foreach_path():
    """clip_grad_norm_ on meta gradients uses _foreach_norm, as on CUDA."""
    with torch.device("meta"):
        model = torch.nn.Linear(16, 32)

    def step(model):
        model(torch.randn(4, 16, device="meta")).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    recording = trace_step(step, model)
    ops = {_tag(e, "op") for e in recording.events if e.action == "alloc"}
    assert "aten._foreach_norm.Scalar" in ops


def test_device_lists_are_restored_on_exit():
    """Inside, the foreach/fused/capturable lists name meta; after exit they do not."""
    with cuda_optimizer_defaults():
        assert "meta" in optimizer_module._get_foreach_kernels_supported_devices()
        assert "meta" in optimizer_module._get_fused_kernels_supported_devices()
        assert "meta" in optimizer_module._get_capturable_supported_devices()
    assert "meta" not in optimizer_module._get_foreach_kernels_supported_devices()
    assert "meta" not in optimizer_module._get_fused_kernels_supported_devices()


def test_default_choice_outside_the_tracer_is_single_tensor():
    """Without the patch, meta parameters give foreach=False (the reason this module exists)."""
    params = [torch.empty(4, device="meta")]
    assert optimizer_module._default_to_fused_or_foreach(params, False, False) == (False, False)
    with cuda_optimizer_defaults():
        assert optimizer_module._default_to_fused_or_foreach(params, False, False) == (
            False,
            True,
        )


@pytest.mark.parametrize("foreach", [True, False])
def test_explicit_foreach_choice_is_respected(foreach):
    """An explicit foreach=True/False wins over the CUDA default."""
    recording, _ = _run(lambda p: torch.optim.Adam(p, foreach=foreach))
    uses_foreach = "aten._foreach_sqrt.default" in _optimizer_ops(recording, 1)
    assert uses_foreach is foreach
