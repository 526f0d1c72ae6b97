"""Layout planning with pipeline and context parallel: degrees, schedules, the winner's scenario."""

from __future__ import annotations

import json

from oomkit.executors import InProcessExecutor
from oomkit.scenario.files import load_scenario, scenario_to_data
from oomkit.scenario.planning import PlanRequest, enumerate_layouts, plan, plan_to_data

# llama3-8b: 32 blocks, untied; 16 sequences over at most 16 H100s, micro-batch 1.
PIPELINED = PlanRequest(
    "llama3-8b", 16, 128, ("h100",), max_gpus=16, checkpointing=("full",),
    precisions=("bf16-mixed",), max_micro_batch=1,
)


def test_pipeline_degrees_and_schedules_are_enumerated():
    """PP 2/4/8 with 1F1B and interleaved 1F1B, each with at least one micro-batch a stage."""
    layouts = enumerate_layouts(PIPELINED)
    piped = [x for x in layouts if x.pp is not None]
    assert {x.pp for x in piped} == {2, 4, 8}
    assert {x.pp_schedule for x in piped} == {"1f1b", "interleaved-1f1b"}
    for x in piped:
        ranks = x.gpus // ((x.tp or 1) * x.pp)
        assert x.micro_batch * x.grad_accum * ranks == 16
        assert x.grad_accum >= x.pp  # Schedule1F1B: micro-batches >= stages
        assert x.dp is None or x.fsdp is not None  # no DDP of a pipelined model
    assert any(x.strategy == "fsdp+tp+pp" for x in piped)
    # PP 8 with 1 data rank: 16 micro-batches; PP 8 x FSDP 2: 8.
    assert {(x.fsdp, x.grad_accum) for x in piped if x.pp == 8 and x.tp is None} == {
        (None, 16), (2, 8),
    }


def test_tied_presets_get_no_pipeline():
    """GPT-2 ties its embedding and LM head: no pipelined layout is enumerated."""
    request = PlanRequest("gpt2-124m", 8, 64, ("l40s",), max_gpus=8)
    assert all(x.pp is None for x in enumerate_layouts(request))


def test_pipeline_state_bound_is_split_over_stages():
    """The cheap bound divides the state over FSDP x TP x PP (the stages' average)."""
    result = plan(PIPELINED, InProcessExecutor(), predictor=_only_pipelines_fit)
    single = next(c for c in result.candidates if c.layout.strategy == "single")
    pp2 = next(c for c in result.candidates if c.layout.strategy == "pp" and c.layout.pp == 2)
    assert pp2.state_bytes == -(-single.state_bytes // 2)


def _only_pipelines_fit(data):
    parallel = data.get("parallel") or {}
    fits = "pp" in parallel and parallel.get("pp_schedule") == "interleaved-1f1b"
    return {"peak_reserved_bytes": 1 << 30, "fits": fits, "headroom_bytes": 1 << 30}


def test_the_pipelined_winner_round_trips_through_config(tmp_path):
    """The winner's JSON scenario, saved, loads back as the same pipelined Scenario, asking
    every stage (all_ranks) with the schedule and its micro-batches."""
    result = plan(PIPELINED, InProcessExecutor(), predictor=_only_pipelines_fit)
    data = plan_to_data(result)
    winner = data["winner"]
    assert winner["pp"] == 2 and winner["pp_schedule"] == "interleaved-1f1b"
    path = tmp_path / "winner.json"
    path.write_text(json.dumps(data["winner_scenario"]))
    scenario = load_scenario(path)
    assert scenario_to_data(scenario) == data["winner_scenario"]
    parallel = scenario.parallel
    assert parallel is not None
    assert (parallel.pp, parallel.pp_schedule, parallel.all_ranks) == (2, "interleaved-1f1b", True)
    assert parallel.microbatches == winner["grad_accum"]
    assert scenario.step.batch == winner["micro_batch"] * winner["grad_accum"]


def test_context_parallel_layouts_are_enumerated():
    """CP 2/4/8 for the Llama presets, FSDP2 over the other ranks, the state split count ways."""
    layouts = [x for x in enumerate_layouts(PIPELINED) if x.cp is not None]
    assert {x.cp for x in layouts} == {2, 4, 8}
    assert {x.strategy for x in layouts} == {"cp", "fsdp+cp"}
    for x in layouts:
        assert (x.fsdp or 1) * x.cp == x.gpus == x.state_shards
        assert x.micro_batch * x.grad_accum * (x.fsdp or 1) == 16
    # seq 128 splits into 2 x cp chunks for every degree; seq 12 only for cp 2 (4 chunks of 3)
    short = PlanRequest("llama3-8b", 4, 12, ("h100",), max_gpus=8, checkpointing=("full",),
                        precisions=("bf16",))
    assert {x.cp for x in enumerate_layouts(short) if x.cp is not None} == {2}


def test_the_context_parallel_winner_round_trips_through_config(tmp_path):
    """Where only CP layouts fit, the winner's saved scenario loads back with its cp degree."""

    def only_cp(data):
        fits = "cp" in (data.get("parallel") or {})
        return {"peak_reserved_bytes": 1 << 30, "fits": fits, "headroom_bytes": 1 << 30}

    data = plan_to_data(plan(PIPELINED, InProcessExecutor(), predictor=only_cp))
    winner = data["winner"]
    assert (winner["cp"], winner["gpus"], winner["strategy"]) == (2, 2, "cp")
    path = tmp_path / "winner.json"
    path.write_text(json.dumps(data["winner_scenario"]))
    scenario = load_scenario(path)
    assert scenario_to_data(scenario) == data["winner_scenario"]
    assert scenario.parallel is not None and scenario.parallel.cp == 2
