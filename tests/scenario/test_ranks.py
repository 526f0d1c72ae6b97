"""--rank and --all-ranks: each pipeline stage predicted, the peaking rank named."""

from __future__ import annotations

import pytest

from oomkit.core.target import ParallelLayout
from oomkit.interfaces.reports.prediction import prediction_to_json
from oomkit.prediction.models import pipeline
from oomkit.prediction.models.llama import LlamaShape
from oomkit.prediction.models.presets import ModelPreset
from oomkit.prediction.summary import verdict_line
from oomkit.scenario.files import scenario_from_data
from oomkit.scenario.ranks import distinct_ranks, pp_rank_of
from oomkit.scenario.run import predict

_SHAPE = LlamaShape(
    hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256, tied=False,
    positions=128,
)


def _use_tiny(monkeypatch):
    preset = ModelPreset("tiny", "Tiny Llama", _SHAPE, 16, "test", default_precision="fp32")
    monkeypatch.setattr(pipeline, "shaped_preset", lambda name, options: preset)


@pytest.fixture
def tiny(monkeypatch):
    """The pipelined preset is the tiny Llama whatever preset it is named."""
    _use_tiny(monkeypatch)


@pytest.fixture(scope="module")
def by_rank(tmp_path_factory):
    """PP 2's rank 0 and rank 1 each predicted alone (--rank R), once for the tests that read
    them (with a recording cache of their own, as tests/conftest.py gives each test)."""
    with pytest.MonkeyPatch.context() as patch:
        _use_tiny(patch)
        patch.setenv("OOMKIT_CACHE_DIR", str(tmp_path_factory.mktemp("oomkit-cache")))
        return {r: predict(_scenario(rank=r)) for r in (0, 1)}


def _scenario(**parallel):
    """PP 2 of the tiny Llama, one step recorded (not the default 3: the tests that take it
    compare --all-ranks with --rank R, or one stage's rank with the other's, on the same steps;
    one step is a third of the time) of 2 microbatches (one a stage, the fewest a 2-stage
    schedule takes: what the tests compare is the same for any count, and each microbatch is
    another forward and backward traced on each stage)."""
    return scenario_from_data({
        "model": {"preset": "llama3-8b"},
        "step": {"batch": 4, "seq": 16, "precision": "fp32"},
        "parallel": {"pp": 2, "microbatches": 2, **parallel},
        "target": {"gpu": "h100"},
        "run": {"steps": 1},
    })


def test_all_ranks_names_the_rank_that_peaks(tiny, by_rank):
    """Each stage's rank is predicted alone (--rank R); the verdict names the larger peak."""
    every = predict(_scenario(all_ranks=True))
    top = max(by_rank, key=lambda r: (by_rank[r].peak_reserved_bytes,
                                      by_rank[r].peak_allocated_bytes, -r))
    assert every.peak_allocated_bytes == by_rank[top].peak_allocated_bytes
    assert every.peak_reserved_bytes == by_rank[top].peak_reserved_bytes
    assert every.rank_peaks == tuple(
        {"rank": r, "stage": r, "peak_allocated_bytes": one.peak_allocated_bytes,
         "peak_reserved_bytes": one.peak_reserved_bytes, "fits": True}
        for r, one in by_rank.items()
    )
    assert f"rank {top} (pipeline stage {top}) peaks, of 2 distinct ranks" in verdict_line(every)
    text = str(every)
    for rank in (0, 1):
        assert f"rank {rank} (pipeline stage {rank}): peak reserved" in text
    # The saved scenario is the peaking rank's: re-predicting it gives the same figures.
    assert every.scenario["parallel"]["rank"] == top
    assert prediction_to_json(every)["rank_peaks"] == [dict(p) for p in every.rank_peaks]


def test_ranks_differ_by_stage(by_rank):
    """Stage 0 holds the embedding, stage 1 the LM head and loss: their peaks differ."""
    first, last = by_rank[0], by_rank[1]
    assert first.peak_allocated_bytes != last.peak_allocated_bytes
    assert "rank 0 runs stage(s) 0" in (first.description or "")
    assert "rank 1 runs stage(s) 1" in (last.description or "")


def test_distinct_ranks_are_each_stage_first_and_last():
    """PP 4 x FSDP 2 x TP 2: each stage's first and last rank (pp outermost in the mesh); no
    FSDP: one rank a stage."""
    layout = ParallelLayout(fsdp=2, tp=2, pp=4)
    assert distinct_ranks(layout) == (0, 3, 4, 7, 8, 11, 12, 15)
    assert [pp_rank_of(layout, r) for r in range(16)] == [r // 4 for r in range(16)]
    assert distinct_ranks(ParallelLayout(tp=2, pp=2)) == (0, 2)
    assert distinct_ranks(ParallelLayout(fsdp=3)) == (0, 2)


def test_the_last_fsdp_rank_holds_shorter_shards(tiny, monkeypatch):
    """FSDP 3 of a 64-wide model: rank 2's chunks are shorter (torch.chunk), so its optimizer
    states are smaller and rank 0 peaks; --rank 2 records rank 2's own shards."""
    from oomkit.prediction.models import parallel

    preset = ModelPreset("tiny", "Tiny Llama", _SHAPE, 16, "test", default_precision="fp32")
    monkeypatch.setattr(parallel, "shaped_preset", lambda name, options: preset)
    # Two steps (not the default 3): the first creates the optimizer state, the second holds it
    # throughout, as fit's probes record.
    data = {"model": {"preset": "llama3-8b"}, "step": {"batch": 2, "seq": 16, "precision": "fp32"},
            "target": {"gpu": "h100"}, "run": {"steps": 2}}
    every = predict(scenario_from_data({**data, "parallel": {"fsdp": 3, "all_ranks": True}}))
    first, last = every.rank_peaks
    assert (first["rank"], last["rank"]) == (0, 2)
    assert last["peak_allocated_bytes"] < first["peak_allocated_bytes"]
    assert "rank 0 peaks, of 2 distinct ranks" in verdict_line(every)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        ({"fsdp": 2, "rank": 2}, "--rank 2 is outside the layout's 2 ranks"),
        ({"fsdp": 2, "rank": 0, "all_ranks": True}, "exclude each other"),
        ({"rank": 0}, "pick ranks of a layout"),
        ({"fsdp": 2, "pp_schedule": "gpipe"}, "set a pipeline: add --pp N"),
        ({"fsdp": 2, "microbatches": 4}, "set a pipeline: add --pp N"),
    ],
)
def test_bad_rank_and_pipeline_settings_are_refused(parallel, message):
    """Each bad combination is a ScenarioError naming the flag."""
    from oomkit.errors import OomkitError

    with pytest.raises(OomkitError, match=message):
        scenario_from_data({"model": {"preset": "llama3-8b"}, "parallel": parallel})


def test_all_ranks_under_tensor_parallel_records_each_rank(tiny):
    """PP 2 x TP 2: both stages' ranks recorded one after the other in this process (DTensor's
    sharding caches, which hold each fake group's meshes, cleared between them)."""
    every = predict(_scenario(tp=2, all_ranks=True))
    assert [(p["rank"], p["stage"]) for p in every.rank_peaks] == [(0, 0), (2, 1)]
    assert all(p["peak_allocated_bytes"] > 0 for p in every.rank_peaks)
    top = max(every.rank_peaks, key=lambda p: (p["peak_reserved_bytes"],
                                                 p["peak_allocated_bytes"], -p["rank"]))
    assert every.peak_allocated_bytes == top["peak_allocated_bytes"]
    assert every.scenario["parallel"]["rank"] == top["rank"]


def test_a_pipeline_that_does_not_fit_gets_no_rebuilt_remedies(tiny):
    """Remedies re-predict from the workload record, which lacks the schedule: none for PP."""
    from oomkit.diagnose.remedy_measurement import prediction_remedies

    data = {"model": {"preset": "llama3-8b"}, "step": {"batch": 4, "seq": 16, "precision": "fp32"},
            "parallel": {"pp": 2, "microbatches": 2},
            "target": {"gpu": "600MiB", "context_overhead_bytes": "560MiB"}, "run": {"steps": 1}}
    prediction = predict(scenario_from_data(data))
    assert not prediction.fits
    assert prediction_remedies(prediction) == ()


def test_context_parallel_through_a_scenario(monkeypatch):
    """--cp 2 with --fsdp 2: the layout saved in the target, the step on half the sequence."""
    from oomkit.prediction.models import context_parallel

    preset = ModelPreset("tiny", "Tiny Llama", _SHAPE, 16, "test", default_precision="bf16")
    monkeypatch.setattr(context_parallel, "shaped_preset", lambda name, options: preset)
    prediction = predict(scenario_from_data({
        "model": {"preset": "llama3-8b"}, "step": {"batch": 2, "seq": 32, "precision": "bf16"},
        "parallel": {"fsdp": 2, "cp": 2}, "target": {"gpu": "h100"}, "run": {"steps": 1},
    }))
    assert prediction_to_json(prediction)["target"]["parallel"] == {
        "fsdp": 2, "tp": 1, "dp": 1, "pp": 1, "cp": 2,
    }
    assert "16 of 32 tokens a rank" in (prediction.description or "")
    assert "FSDP2 over 4 ranks (fsdp x cp" in (prediction.description or "")
