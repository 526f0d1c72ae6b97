"""Tests for oomkit.prediction.predictor: replaying a recorded step on a named GPU."""

from __future__ import annotations

import pytest

from oomkit.core.gpus import GpuSpec, get_gpu
from oomkit.core.target import Target
from oomkit.core.trace import Frame, TraceEvent
from oomkit.errors import ConfigError, TraceFormatError, UnknownGpuError
from oomkit.prediction import Prediction, predict, predict_recording
from oomkit.prediction._replay import MAX_TIMELINE_POINTS

torch = pytest.importorskip("torch")
from oomkit.prediction.tracing import TraceRecording  # noqa: E402

MiB = 2**20
GiB = 2**30


def _alloc(ident, size, category, module=None, op=None, frames=()):
    tags = [("category", category), ("phase", "forward")]
    if module is not None:
        tags.append(("module", module))
    if op is not None:
        tags.append(("op", op))
    return TraceEvent("alloc", ident, size, frames=frames, tags=tuple(tags))


def _free(ident, size):
    return [TraceEvent("free_requested", ident, size), TraceEvent("free_completed", ident, size)]


def _gpu(total_bytes, overhead_bytes):
    return GpuSpec(name="test GPU", total_memory_bytes=total_bytes, context_overhead_bytes=overhead_bytes)


# 1000 B rounds to a 1024-B block (512-B rounding) in a 2 MiB small-pool segment; 3 MiB is a
# large request under 10 MiB, so it gets a 20 MiB segment (17 MiB stay free there); 30 MiB + 1 B
# rounds to 30 MiB + 512 and gets its own segment rounded up to 2 MiB: 32 MiB
# (CUDACachingAllocator.cpp round_size and get_allocation_size).
THREE = [
    _alloc(1, 1000, "parameter"),
    _alloc(2, 3 * MiB, "activation", module="encoder.0", op="aten.mm.default"),
    _alloc(3, 30 * MiB + 1, "temporary", module="encoder.1", op="aten.gelu.default",
           frames=(Frame("train.py", 12, "step"),)),
]
THREE_ALLOCATED = 1024 + 3 * MiB + 30 * MiB + 512
THREE_RESERVED = 2 * MiB + 20 * MiB + 32 * MiB


def _recording(events, step_starts=(0,), warnings=()):
    return TraceRecording(events=tuple(events), warnings=tuple(warnings), step_starts=tuple(step_starts))


def test_three_allocs_exact_peaks_and_headroom():
    """Peaks are the allocator's rounded bytes; headroom is usable minus peak reserved."""
    p = predict_recording(_recording(THREE), target=Target.resolve(_gpu(1 * GiB, 100 * MiB)))
    assert p.peak_allocated_bytes == THREE_ALLOCATED
    assert p.peak_reserved_bytes == THREE_RESERVED
    assert p.capacity_bytes == GiB
    assert p.context_overhead_bytes == 100 * MiB
    assert p.usable_bytes == GiB - 100 * MiB
    assert p.fits is True and p.oom is None
    assert p.required_bytes == THREE_RESERVED
    assert p.headroom_bytes == GiB - 100 * MiB - THREE_RESERVED
    assert p.num_device_alloc == 3
    assert p.events == 3


def test_breakdown_by_category_sums_to_peak_allocated():
    """At peak the breakdown gives each category's block bytes, largest first."""
    p = predict_recording(_recording(THREE), target=Target.resolve(_gpu(1 * GiB, 0)))
    assert list(p.by_category_bytes.items()) == [
        ("temporary", 30 * MiB + 512),
        ("activation", 3 * MiB),
        ("parameter", 1024),
    ]
    assert p.top_modules == (("encoder.1", 30 * MiB + 512), ("encoder.0", 3 * MiB))
    assert p.peak_allocated_at.unattributed_bytes == 1024
    assert p.peak_allocated_at.allocated_bytes == p.peak_allocated_bytes
    assert p.peak_allocated_at.reserved_bytes == THREE_RESERVED


def test_breakdown_is_taken_at_the_peak_not_the_end():
    """A temporary freed after the peak still shows in the breakdown at the peak moment."""
    events = [
        _alloc(1, 4 * MiB, "activation", module="a"),
        _alloc(2, 6 * MiB, "temporary", module="b"),
        *_free(2, 6 * MiB),
        _alloc(3, 2 * MiB, "gradient"),
    ]
    p = predict_recording(_recording(events), target=Target.resolve(_gpu(GiB, 0)))
    assert p.peak_allocated_bytes == 10 * MiB
    assert p.peak_allocated_at.event_index == 1
    assert dict(p.by_category_bytes) == {"temporary": 6 * MiB, "activation": 4 * MiB}
    # Both fit in the first 20 MiB segment; the 2 MiB gradient reuses its freed space.
    assert p.peak_reserved_bytes == 20 * MiB
    assert p.peak_reserved_at.event_index == 0
    assert dict(p.peak_reserved_at.by_category_bytes) == {"activation": 4 * MiB}


def test_oom_point_with_tiny_capacity():
    """The first request the device cannot serve is the OOM point, with op, module and step."""
    events = [TraceEvent("alloc", 99, 512, tags=(("category", "input"),)), *THREE]
    p = predict_recording(
        _recording(events, step_starts=(1,)), target=Target.resolve(_gpu(40 * MiB, 10 * MiB))
    )
    assert p.fits is False
    oom = p.oom
    assert oom is not None
    # Steps count from 1, as users count: the OOM is in the first recorded step.
    assert (oom.event_index, oom.step, oom.op, oom.module) == (3, 1, "aten.gelu.default", "encoder.1")
    assert oom.category == "temporary"
    assert oom.requested_bytes == 30 * MiB + 1
    assert oom.frame == "train.py:12 in step"
    assert "CUDA out of memory. Tried to allocate 32.00 MiB" in oom.message
    # Up to the OOM: 2 MiB small + 20 MiB large segments; on an unlimited device it needs 54 MiB.
    assert p.peak_reserved_bytes == 22 * MiB
    assert p.required_bytes == THREE_RESERVED
    assert p.headroom_bytes == 30 * MiB - THREE_RESERVED
    assert p.events == 4


def test_oom_before_first_step_has_no_step():
    """Storages that exist before the first step can already exceed the device."""
    events = [_alloc(1, 50 * MiB, "parameter")]
    p = predict_recording(
        _recording(events, step_starts=()), target=Target.resolve(_gpu(40 * MiB, 0))
    )
    assert p.oom is not None and p.oom.step is None and p.oom.module is None


def test_budget_checks_required_reserved_bytes():
    """within_budget compares the reserved bytes needed with the budget, inclusive."""
    rec = _recording(THREE)
    assert predict_recording(rec, target=Target.resolve(_gpu(GiB, 0)), budget_bytes=THREE_RESERVED).within_budget is True
    over = predict_recording(
        rec, target=Target.resolve(_gpu(GiB, 0)), budget_bytes=THREE_RESERVED - 1
    )
    assert over.within_budget is False and over.fits is True
    assert predict_recording(rec, target=Target.resolve(_gpu(GiB, 0))).within_budget is None


def test_step_peaks_and_growth_warning():
    """Per-step peaks are reported; growth in the last step adds a warning."""
    events = [
        _alloc(1, 1 * MiB + 1, "activation"),
        *_free(1, MiB + 1),
        _alloc(2, 25 * MiB, "activation"),
        *_free(2, 25 * MiB),
    ]
    p = predict_recording(
        _recording(events, step_starts=(0, 3), warnings=("from tracer",)),
        target=Target.resolve(_gpu(GiB, 0)),
    )
    # 25 MiB gets a 26 MiB segment; the 1 MiB left over is not > kSmallSize, so the block is
    # not split and counts 26 MiB allocated (CUDACachingAllocator.cpp should_split).
    assert [(s.step, s.peak_allocated_bytes, s.peak_reserved_bytes) for s in p.step_peaks] == [
        (1, MiB + 512, 20 * MiB),
        (2, 26 * MiB, 20 * MiB + 26 * MiB),
    ]
    assert p.peak_step == 2
    assert p.warnings[0] == "from tracer"
    assert p.warnings[1] == (
        "peak reserved still grew in the last recorded step (step 1: 20.00 MiB, step 2: "
        "46.00 MiB); later steps may need more: predict with more steps"
    )


def test_growth_from_first_step_optimizer_state_is_not_warned_about():
    """Step 0 creates 25 MiB of optimizer state that step 1 keeps: step 1's growth is explained."""
    events = [
        _alloc(1, MiB, "activation"),
        *_free(1, MiB),
        _alloc(2, 25 * MiB, "optimizer_state"),  # exp_avg made by the first optimizer step
        _alloc(3, 3 * MiB, "activation"),  # step 1
        *_free(3, 3 * MiB),
    ]
    p = predict_recording(
        _recording(events, step_starts=(0, 4)), target=Target.resolve(_gpu(GiB, 0))
    )
    # Step 0: 1 MiB in a 2 MiB small-pool segment, then the state's own 26 MiB segment (25 MiB
    # leaves 1 MiB, not split: 26 MiB allocated). Step 1 adds 3 MiB in a new 20 MiB segment.
    assert [(s.peak_allocated_bytes, s.peak_reserved_bytes) for s in p.step_peaks] == [
        (26 * MiB, 28 * MiB),
        (29 * MiB, 48 * MiB),
    ]
    assert not any("still grew" in w for w in p.warnings)
    # The same growth with the 25 MiB made by something other than the optimizer is warned about.
    plain = [e if e.action != "alloc" or e.address != 2 else _alloc(2, 25 * MiB, "activation")
             for e in events]
    q = predict_recording(
        _recording(plain, step_starts=(0, 4)), target=Target.resolve(_gpu(GiB, 0))
    )
    assert any("still grew" in w for w in q.warnings)


def test_growth_explained_by_unsplit_optimizer_state_blocks_is_not_warned_about():
    """Made-once bytes count as blocks, as the step peaks do: an unsplit state block explains all."""
    events = [
        _alloc(1, 40 * MiB, "activation"),
        *_free(1, 40 * MiB),
        # Adam's state reuses the cached 40 MiB block; the 0.5 MiB left is not > kSmallSize, so
        # the block is not split (CUDACachingAllocator.cpp should_split): 40 MiB allocated.
        _alloc(2, 39 * MiB + 512 * 1024, "optimizer_state"),
        _alloc(3, 40 * MiB, "activation"),  # step 2: a new 40 MiB segment
        *_free(3, 40 * MiB),
    ]
    p = predict_recording(
        _recording(events, step_starts=(0, 4)), target=Target.resolve(_gpu(GiB, 0))
    )
    assert [(s.step, s.peak_allocated_bytes, s.peak_reserved_bytes) for s in p.step_peaks] == [
        (1, 40 * MiB, 40 * MiB),
        (2, 80 * MiB, 80 * MiB),
    ]
    # Growth 40 MiB = the state's block (its request was 39.5 MiB, which explained too little).
    assert not any("still grew" in w for w in p.warnings)


def test_timeline_is_bounded_and_keeps_the_peak():
    """A long trace gives at most MAX_TIMELINE_POINTS points whose maximum is the peak."""
    events = []
    for i in range(1500):
        events.append(_alloc(i, (i % 7 + 1) * MiB, "temporary"))
        events += _free(i, (i % 7 + 1) * MiB)
    p = predict_recording(_recording(events), target=Target.resolve(_gpu(GiB, 0)))
    assert len(p.timeline) <= MAX_TIMELINE_POINTS
    assert max(t.allocated_bytes for t in p.timeline) == p.peak_allocated_bytes == 7 * MiB
    assert p.timeline[-1].event_index == len(events) - 1


def test_alloc_conf_is_canonical_and_changes_the_replay():
    """expandable_segments:True maps 2 MiB pages instead of a 20 MiB segment for 3 MiB."""
    events = [_alloc(1, 3 * MiB, "activation")]
    p = predict_recording(
        _recording(events),
        target=Target.resolve(_gpu(GiB, 0), alloc_conf="expandable_segments:True"),
    )
    assert p.alloc_conf == "expandable_segments:True"
    assert p.peak_reserved_bytes == 20 * MiB
    with pytest.raises(ConfigError, match="max_split_size"):
        predict_recording(
            _recording(events),
            target=Target.resolve(_gpu(GiB, 0), alloc_conf="max_split_size_mb:2"),
        )


def test_gpu_by_name_and_context_override():
    """A catalog name resolves to its spec; context_overhead_bytes replaces its figure."""
    p = predict_recording(
        _recording(THREE), target=Target.resolve("h100", context_overhead_bytes=1 * GiB)
    )
    h100 = get_gpu("h100")
    assert p.gpu.name == h100.name
    assert p.usable_bytes == h100.total_memory_bytes - GiB
    with pytest.raises(UnknownGpuError, match="Did you mean"):
        predict_recording(_recording(THREE), target=Target.resolve("h1000"))


def test_free_of_unknown_id_is_trace_error():
    """A recording that frees what it never allocated is rejected with the event index."""
    with pytest.raises(TraceFormatError, match="event 0"):
        predict_recording(_recording(_free(5, 10)), target=Target.resolve(_gpu(GiB, 0)))


def test_predict_records_a_real_step_on_meta():
    """predict() traces a tiny model for 3 steps; parameters count from before step 0."""
    with torch.device("meta"):
        model = torch.nn.Linear(16, 16, bias=False)  # 1024-B weight
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(4, 16)

    def step(model, opt, x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    p = predict(step, model, opt, x, target=Target.resolve("24GiB"), description="tiny")
    assert isinstance(p, Prediction)
    assert p.steps == 3 and len(p.step_peaks) == 3
    assert p.fits is True
    assert p.description == "tiny"
    assert p.by_category_bytes["parameter"] == 1024
    assert p.by_category_bytes["input"] == 512
    assert sum(p.by_category_bytes.values()) == p.peak_allocated_bytes
    assert p.capacity_bytes == 24 * GiB


def test_predict_track_objects_are_not_passed():
    """Objects in track= are recorded before step 0 but not passed to the step."""
    with torch.device("meta"):
        weight = torch.empty(256, 256)  # 256 KiB
    calls = []

    def step():
        calls.append(1)
        with torch.device("meta"):
            (weight * 2).sum()

    p = predict(step, target=Target.resolve("24GiB"), steps=2, track=(weight,))
    assert len(calls) == 2
    assert p.peak_allocated_at.by_category_bytes["input"] == 256 * 1024


def test_predict_unknown_gpu_fails_before_tracing():
    """An unknown GPU name raises UnknownGpuError without running the step."""
    with pytest.raises(UnknownGpuError):
        predict(lambda: pytest.fail("traced"), target=Target.resolve("not-a-gpu"))


def test_timeline_points_carry_live_bytes_by_category():
    """Each timeline point has the block bytes of every category live just after its event."""
    events = [
        _alloc(1, 4 * MiB, "activation", module="a"),
        _alloc(2, 6 * MiB, "temporary", module="b"),
        *_free(2, 6 * MiB),
        _alloc(3, 2 * MiB, "gradient"),
    ]
    p = predict_recording(_recording(events), target=Target.resolve(_gpu(GiB, 0)))
    levels = [(t.event_index, dict(t.by_category_bytes)) for t in p.timeline]
    assert levels == [
        (0, {"activation": 4 * MiB}),
        (1, {"temporary": 6 * MiB, "activation": 4 * MiB}),
        (2, {"temporary": 6 * MiB, "activation": 4 * MiB}),  # only requested: still allocated
        (3, {"activation": 4 * MiB}),
        (4, {"activation": 4 * MiB, "gradient": 2 * MiB}),
    ]
    assert all(sum(c.values()) <= t.allocated_bytes for t in p.timeline for c in [t.by_category_bytes])


# --- the Target passed down ---------------------------------------------------------------


def _sdpa_step():
    import torch
    import torch.nn.functional as F

    q = torch.randn(2, 4, 100, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)

    def step():
        F.scaled_dot_product_attention(q, q, q).sum().backward()

    return step


def test_target_cudnn_version_picks_the_sdpa_backend_explicitly():
    """A Target's cuDNN version reaches the tracer as an argument: 9.15.1 cuDNN, 9.10.2 flash."""
    pytest.importorskip("torch")
    from oomkit.prediction.tracing import trace_step
    from oomkit.prediction.tracing.emulations import SdpaSettings, use_sdpa_settings

    newer = trace_step(_sdpa_step(), target=Target.resolve("h100", cudnn_version=91501))
    older = trace_step(_sdpa_step(), target=Target.resolve("h100", cudnn_version=91002))
    assert newer.kernel_choices == {"SDPA cudnn_attention": 1}
    assert older.kernel_choices == {"SDPA flash_attention": 1}
    # The stated version wins over the settings in effect; the other switches still apply.
    with use_sdpa_settings(SdpaSettings(cudnn_version=91002, flash_enabled=False)):
        stated = trace_step(_sdpa_step(), target=Target.resolve("h100", cudnn_version=91501))
        unstated = trace_step(_sdpa_step(), target=Target.resolve("h100"))
    assert stated.kernel_choices == {"SDPA cudnn_attention": 1}
    assert unstated.kernel_choices == {"SDPA efficient_attention": 1}


def test_predict_with_a_target_equals_the_keywords_and_saves_the_cudnn_traced_with():
    """predict(target=T) stating the cuDNN equals one under those settings; the result names T."""
    pytest.importorskip("torch")
    from oomkit.prediction.tracing.emulations import SdpaSettings, use_sdpa_settings

    target = Target.resolve("rtx4090", "expandable_segments:True", cudnn_version=91002)
    by_target = predict(_sdpa_step(), target=target, steps=1)
    with use_sdpa_settings(SdpaSettings(cudnn_version=91002)):
        by_keywords = predict(
            _sdpa_step(),
            target=Target.resolve("rtx4090", alloc_conf="expandable_segments:True"),
            steps=1,
        )
    assert by_target.target == target
    assert by_keywords.target == target  # the version in effect is filled in
    assert by_target.peak_reserved_bytes == by_keywords.peak_reserved_bytes
    assert by_target.alloc_conf == "expandable_segments:True"
    assert by_target.gpu.name == "RTX 4090"


def test_no_target_is_an_h100_with_the_default_allocator_and_the_newest_torch():
    """predict_recording without target= predicts for Target.resolve("h100")."""
    p = predict_recording(_recording(THREE))
    assert p.target == Target.resolve("h100")
    assert (p.gpu.name, p.alloc_conf) == ("H100 SXM 80GB", "")
    assert p.peak_reserved_bytes == THREE_RESERVED
    with pytest.raises(TypeError, match="positional"):
        predict_recording(_recording(THREE), "h100")  # type: ignore[misc]


def test_predict_refuses_the_target_as_keywords():
    """gpu= (...) for predict is a ConfigError naming target=, before anything is traced."""
    pytest.importorskip("torch")
    import torch

    with torch.device("meta"):
        x = torch.empty(1024)
    with pytest.raises(ConfigError, match=r"one target=, not gpu=, alloc_conf=\. Example"):
        predict(lambda x: x * 2, x, gpu="rtx4090", alloc_conf="expandable_segments:True")
    with pytest.raises(ConfigError, match=r"not torch_version="):
        predict(lambda x: x * 2, x, torch_version="2.6", target=Target.resolve("rtx4090"))
    # No target: an H100; the input (4 KiB) and the product (4 KiB) are alive at the peak.
    p = predict(lambda x: x * 2, x, steps=1)
    assert (p.gpu.name, p.alloc_conf, p.peak_allocated_bytes) == ("H100 SXM 80GB", "", 8192)


def test_required_bytes_with_expandable_segments_after_an_oom():
    """The unlimited re-run maps pages of a huge reservation without a table of its size.

    Small pool: one 2 MiB page for the 1024-B block; large pool: one expandable segment whose
    20 MiB pages grow to cover 3 MiB + 30 MiB + 512 B, so 2 pages: 2 + 40 MiB in all.
    """
    p = predict_recording(
        _recording(THREE), target=Target.resolve(_gpu(40 * MiB, 10 * MiB), alloc_conf="expandable_segments:True")
    )
    assert p.fits is False
    assert p.oom is not None and p.oom.requested_bytes == 30 * MiB + 1
    assert p.required_bytes == 42 * MiB
