"""Recording whole steps: Linear + AdamW on meta, several steps, module paths, user frames."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from oomkit.errors import UnsupportedOpError
from oomkit.prediction.tracing import EmulationRegistry, Tracer, TraceRecording, trace_step

LINEAR_PARAM_BYTES = 4 * (1024 * 1024 + 1024)
BATCH_BYTES = 4 * 8 * 1024


def _linear_and_adamw() -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    with torch.device("meta"):
        model = torch.nn.Linear(1024, 1024)
    return model, torch.optim.AdamW(model.parameters(), foreach=True)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 1024, device="meta")
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _allocs(recording: TraceRecording, **tags: str) -> list:
    return [
        e
        for e in recording.events
        if e.action == "alloc" and all(dict(e.tags).get(k) == v for k, v in tags.items())
    ]


@pytest.fixture(scope="module")
def three_steps() -> tuple[TraceRecording, torch.optim.AdamW]:
    model, optimizer = _linear_and_adamw()
    # No emulations: these tests are about what meta records (cuBLAS workspaces are tested in
    # test_emulation_cublas.py).
    recording = trace_step(_train_step, model, optimizer, steps=3, emulations=EmulationRegistry())
    return recording, optimizer


def test_parameters_are_recorded_before_the_first_step(three_steps):
    """A model built earlier on meta shows its parameter bytes ahead of step 0."""
    recording, _ = three_steps
    before = recording.events[: recording.step_starts[0]]
    assert [e.size for e in before] == [4 * 1024 * 1024, 4 * 1024]
    assert recording.bytes_by_category["parameter"] == LINEAR_PARAM_BYTES


def test_first_step_bytes_by_category(three_steps):
    """Step 0 of Linear(1024, 1024) + AdamW(foreach) allocates exactly these bytes."""
    recording, _ = three_steps
    got = {c: recording.allocated_bytes(c, step=0) for c in recording.bytes_by_category}
    assert got == {
        "parameter": 0,
        "input": BATCH_BYTES,  # x, saved by addmm for the weight gradient
        "activation": BATCH_BYTES,  # the Linear output, returned from the root module
        "gradient": LINEAR_PARAM_BYTES,
        "optimizer_state": 2 * LINEAR_PARAM_BYTES,  # exp_avg, exp_avg_sq
        # loss (4) + ones_like grad seed (4) + _foreach_sqrt(exp_avg_sq) (param bytes)
        "temporary": 4 + 4 + LINEAR_PARAM_BYTES,
    }


def test_bytes_by_phase(three_steps):
    """Gradients come from backward, optimizer state and sqrt scratch from the optimizer."""
    recording, _ = three_steps
    assert recording.allocated_bytes(phase="backward", step=0) == LINEAR_PARAM_BYTES
    assert recording.allocated_bytes(phase="optimizer", step=0) == 3 * LINEAR_PARAM_BYTES
    assert recording.allocated_bytes(phase="forward", step=0) == BATCH_BYTES
    assert recording.allocated_bytes(phase="user", step=0) == BATCH_BYTES + 4 + 4


def test_adamw_step_counters_live_on_the_host(three_steps):
    """torch 2.13 AdamW keeps `step` as a CPU scalar tensor per parameter: no device bytes."""
    _, optimizer = three_steps
    for state in optimizer.state.values():
        assert state["step"].device.type == "cpu"
        assert state["step"].shape == ()
        assert state["exp_avg"].device.type == "meta"


def test_optimizer_state_is_allocated_once_in_three_steps(three_steps):
    """exp_avg/exp_avg_sq appear in step 0 only; later steps reuse them."""
    recording, _ = three_steps
    per_step = [recording.allocated_bytes("optimizer_state", step=s) for s in range(3)]
    assert per_step == [2 * LINEAR_PARAM_BYTES, 0, 0]
    assert recording.steps == 3


def test_steady_state_steps_are_identical(three_steps):
    """Steps 1 and 2 allocate and free the same sizes in the same order."""
    recording, _ = three_steps
    shape = [[(e.action, e.size, e.tags) for e in recording.step_events(s)] for s in (1, 2)]
    assert shape[0] == shape[1]


def test_gradients_are_freed_by_zero_grad(three_steps):
    """zero_grad(set_to_none=True) frees both gradients within the step that made them."""
    recording, _ = three_steps
    events = recording.step_events(1)
    grads = {
        e.address for e in events if e.action == "alloc" and ("category", "gradient") in e.tags
    }
    freed = {e.address for e in events if e.action == "free_completed"}
    assert len(grads) == 2 and grads <= freed


def test_every_free_is_requested_then_completed(three_steps):
    """Each free is a free_requested immediately followed by its free_completed."""
    recording, _ = three_steps
    for i, event in enumerate(recording.events):
        if event.action == "free_requested":
            nxt = recording.events[i + 1]
            assert (nxt.action, nxt.address, nxt.size) == (
                "free_completed",
                event.address,
                event.size,
            )


def test_alloc_tags_name_the_aten_op(three_steps):
    """The weight gradient comes from aten.mm in backward; the Linear output from addmm."""
    recording, _ = three_steps
    grads = _allocs(recording, category="gradient")
    assert {dict(e.tags)["op"] for e in grads} == {"aten.mm.default", "aten.sum.dim_IntList"}
    assert all(e.stream == 0 for e in recording.events)


def test_module_paths_on_a_sequential():
    """Allocations inside a 2-layer Sequential are tagged with the layer's named_modules path."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))

    def forward(m):
        m(torch.randn(2, 16, device="meta"))

    recording = trace_step(forward, model, emulations=EmulationRegistry())
    forward_allocs = _allocs(recording, phase="forward")
    assert [(dict(e.tags)["module"], e.size) for e in forward_allocs] == [
        ("0", 4 * 2 * 32),
        ("1", 4 * 2 * 4),
    ]


def test_user_frame_points_at_the_test_file():
    """An allocation's frame is the user's line, not torch's or oomkit's."""
    with Tracer() as tracer:
        line = sys._getframe().f_lineno + 1
        kept = torch.empty(100, device="meta")
    (alloc,) = _allocs(tracer.recording)
    assert alloc.frames[0].filename == __file__
    assert (alloc.frames[0].line, alloc.frames[0].name) == (
        line,
        "test_user_frame_points_at_the_test_file",
    )
    del kept


def test_model_built_inside_the_trace():
    """Parameters created under the tracer are allocations of category parameter."""

    def build_and_run():
        with torch.device("meta"):
            model = torch.nn.Linear(64, 64)
        model(torch.randn(4, 64, device="meta")).sum().backward()

    recording = trace_step(build_and_run)
    assert recording.bytes_by_category["parameter"] == 4 * (64 * 64 + 64)
    assert recording.bytes_by_category["gradient"] == 4 * (64 * 64 + 64)
    # addmm (forward) and mm (backward, autograd's thread) each set up a 32 MiB cuBLAS workspace.
    assert recording.bytes_by_category["workspace"] == 2 * 32 * 2**20
    assert recording.warnings == ()


def test_ops_without_emulation_are_reported():
    """With no emulation hooks, the cuBLAS ops and SDPA leave one warning each, naming the op."""

    def build_and_run():
        with torch.device("meta"):
            model = torch.nn.Linear(64, 64)
        model(torch.randn(4, 64, device="meta")).sum().backward()
        q = torch.randn(1, 2, 16, 8, device="meta")
        torch.nn.functional.scaled_dot_product_attention(q, q, q)

    recording = trace_step(build_and_run, emulations=EmulationRegistry())
    assert (
        "aten.addmm.default ran 1 time(s) and is recorded as meta runs it; its CUDA memory "
        "(cuBLAS workspace) is not emulated yet"
    ) in recording.warnings
    assert (
        "aten.mm.default ran 1 time(s) and is recorded as meta runs it; its CUDA memory "
        "(cuBLAS workspace) is not emulated yet"
    ) in recording.warnings
    assert any(
        w.startswith("torch.nn.functional.scaled_dot_product_attention ran 1")
        for w in recording.warnings
    )


def test_sdpa_is_emulated_by_default():
    """With the default emulations an fp32 SDPA runs the efficient kernel and warns of nothing."""

    def attend():
        q = torch.randn(1, 2, 16, 8, device="meta")
        torch.nn.functional.scaled_dot_product_attention(q, q, q)

    recording = trace_step(attend)
    ops = {dict(e.tags).get("op") for e in recording.events if e.action == "alloc"}
    assert "aten._scaled_dot_product_efficient_attention.default" in ops
    assert recording.warnings == ()


def test_untracked_existing_storages_warn():
    """Storages that predate the tracer and were not tracked are recorded at first use, with a warning."""
    with torch.device("meta"):
        model = torch.nn.Linear(8, 8)
    with Tracer() as tracer:
        model(torch.randn(1, 8, device="meta"))
    recording = tracer.recording
    assert recording.bytes_by_category["parameter"] == 4 * (64 + 8)
    assert any("2 storage(s) (288 bytes) existed before tracing" in w for w in recording.warnings)
    # The advice names the ways users have: a builder's return value and predict's track=.
    assert any(
        w.endswith("return (step, (model, optimizer)) from a builder, or pass track= to "
                   "oomkit.predict")
        for w in recording.warnings
    )


def test_data_dependent_op_raises_unsupported():
    """An op that cannot run on meta surfaces as UnsupportedOpError naming the op."""

    def bad():
        torch.randn(4, device="meta").nonzero()

    with pytest.raises(UnsupportedOpError, match="aten.nonzero"):
        trace_step(bad)


def test_steps_must_be_positive():
    """steps=0 is a usage error."""
    with pytest.raises(ValueError, match="steps must be a whole number of at least 1"):
        trace_step(lambda: None, steps=0)


def test_hooks_are_removed_after_tracing():
    """After the tracer exits, nothing of it stays installed on modules or parameters."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    trace_step(lambda m: m(torch.randn(1, 4, device="meta")).sum().backward(), model)
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks
    assert not model.weight._post_accumulate_grad_hooks


def test_untracked_input_warns():
    """An input made before the tracer and used untracked is recorded at first use, with a warning."""
    x = torch.randn(4, 4, device="meta")
    with Tracer() as tracer:
        y = x * 2
    recording = tracer.recording
    assert [(e.size, dict(e.tags)["category"]) for e in recording.events] == [
        (64, "input"),
        (64, "temporary"),
    ]
    assert any("1 storage(s) (64 bytes) existed before tracing" in w for w in recording.warnings)
    del y


def test_recording_round_trips_through_a_trace_file(tmp_path, three_steps):
    """The events are plain oomkit.core.trace events: write_trace/read_trace give them back."""
    from oomkit.core.trace import TraceHeader, read_trace, write_trace

    recording, _ = three_steps
    path = tmp_path / "step.jsonl"
    write_trace(path, recording.events, TraceHeader(source="tracer"))
    header, events = read_trace(path)
    assert header.source == "tracer"
    assert tuple(events) == recording.events


def test_sdpa_emulation_reaches_checkpoint_recomputation():
    """Checkpoint recompute in backward runs the same SDPA emulation as forward (no CheckpointError)."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    q = torch.randn(2, 4, 64, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)

    def attend(x):
        return F.scaled_dot_product_attention(x, x, x, is_causal=True)

    def step(x):
        checkpoint(attend, x, use_reentrant=False).sum().backward()

    from oomkit.core.gpus import get_gpu

    recording = trace_step(step, q, gpu=get_gpu("A100 40GB"))  # sm80: flash, whatever the cuDNN
    calls = Counter(
        (dict(e.tags).get("op"), dict(e.tags).get("phase"))
        for e in recording.events
        if e.action == "alloc"
    )
    flash = "aten._scaled_dot_product_flash_attention.default"
    # The flash kernel's four outputs, once in forward and once more in the recomputation.
    assert calls[(flash, "user")] == calls[(flash, "backward")] == 4
    assert F.scaled_dot_product_attention.__module__ == "torch._C._nn"


def test_a_custom_size_gpu_says_which_architecture_its_kernels_are_chosen_for():
    """--gpu 24GiB: the recording warns that kernels were picked as on compute capability 9.0."""
    from oomkit.core.gpus import get_gpu
    from oomkit.prediction.tracing import trace_step

    x = torch.randn(4, 4, device="meta")
    custom = trace_step(lambda t: t @ t, x, gpu=get_gpu("24GiB")).warnings
    assert any("chosen as on compute capability 9.0 (an H100)" in w for w in custom)
    named = trace_step(lambda t: t @ t, x, gpu=get_gpu("rtx4090")).warnings
    assert not any("plain size" in w for w in named)
