"""Layout planning: enumeration, pruning by state bytes, ranking, JSON and the plan command."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.errors import OomkitError
from oomkit.executors import InProcessExecutor
from oomkit.scenario.planning import (
    Layout,
    PlanRequest,
    enumerate_layouts,
    plan,
    plan_to_data,
)

# gpt2-124m: 124,439,808 parameters; bf16-mixed AdamW keeps fp32 parameters, gradients and two
# states: 16 B each (prediction/models/state_bytes.py).
GPT2_STATE_BYTES = 124_439_808 * 16
SMALL = PlanRequest(
    "gpt2-124m", 4, 64, ("l40s",), max_gpus=2, checkpointing=("none", "full"),
    precisions=("bf16-mixed",), max_micro_batch=2,
)


def test_enumeration_divides_the_global_batch():
    """Global batch 4 on 1-2 GPUs, micro-batch <= 2: single, FSDP 2 and DDP 2, 12 layouts."""
    layouts = enumerate_layouts(SMALL)
    assert len(layouts) == 12
    assert layouts[0] == Layout("l40s", 1, None, None, None, 1, 4, "none", "bf16-mixed")
    assert {(x.strategy, x.gpus, x.micro_batch, x.grad_accum) for x in layouts} == {
        ("single", 1, 1, 4), ("single", 1, 2, 2),
        ("fsdp", 2, 1, 2), ("fsdp", 2, 2, 1), ("ddp", 2, 1, 2), ("ddp", 2, 2, 1),
    }
    for x in layouts:
        ranks = x.gpus // (x.tp or 1)
        assert x.micro_batch * x.grad_accum * ranks == 4


def test_llama_gets_tensor_parallel_and_hsdp_layouts():
    """TP degrees for the Llama presets, HSDP groups of 2/4/8, no DDP of a TP model."""
    layouts = enumerate_layouts(PlanRequest(
        "llama3-8b", 16, 128, ("h100",), max_gpus=16, checkpointing=("full",),
        precisions=("bf16",), max_micro_batch=1,
    ))
    strategies = {(x.strategy, x.fsdp, x.dp, x.tp) for x in layouts}
    assert ("hsdp+tp", 2, 2, 4) in strategies
    assert ("hsdp", 8, 2, None) in strategies
    assert ("tp", None, None, 8) in strategies
    assert not any(x.strategy == "ddp+tp" for x in layouts)
    assert max(x.tp or 1 for x in layouts) == 8


def _fake_predictor(data):
    """Peak = 1 GiB per micro-batch sequence; the scenario's own batch, so tests know it."""
    batch = data["step"]["batch"]
    return {"peak_reserved_bytes": batch << 30, "fits": batch < 2, "headroom_bytes": (2 - batch) << 30}


def test_ranking_fits_first_then_cheapest_then_least_recompute():
    """Fitting layouts (micro-batch 1 here) rank first; one GPU before two; AC none first."""
    result = plan(SMALL, InProcessExecutor(), predictor=_fake_predictor)
    best = result.candidates[0]
    assert (best.layout.gpus, best.layout.micro_batch, best.layout.checkpointing) == (1, 1, "none")
    assert result.winner == best
    assert [c.fits for c in result.candidates] == [True] * 6 + [False] * 6
    # Each layout is its own scenario (sharded accumulation is predicted with its micro-batches).
    assert result.predicted == 12 and result.pruned == 0
    assert result.notes[0].startswith("pipeline (PP, Llama presets with untied embeddings) and context")


def test_prices_rank_by_dollars_per_hour():
    """With prices, the cheaper $/hour wins: 2 x l4 at 0.5 beats 1 x l40s at 2.0."""
    request = PlanRequest(
        "gpt2-124m", 2, 64, ("l40s", "l4"), max_gpus=2, checkpointing=("none",),
        precisions=("bf16-mixed",), prices={"l40s": 2.0, "l4": 0.5},
    )
    result = plan(request, InProcessExecutor(), predictor=_fake_predictor)
    assert result.winner is not None
    assert result.winner.price_per_hour == 0.5
    assert (result.winner.layout.gpu, result.winner.layout.gpus) == ("l4", 1)
    two_l4 = [c for c in result.candidates if c.layout.gpu == "l4" and c.layout.gpus == 2]
    assert {c.price_per_hour for c in two_l4} == {1.0}


def test_state_bytes_prune_without_predicting():
    """llama3-70b's state on at most 2 L40S: every layout pruned, none predicted."""

    def never(data):
        raise AssertionError("a pruned layout was predicted")

    request = PlanRequest(
        "llama3-70b", 2, 128, ("l40s",), max_gpus=2, checkpointing=("full",),
        precisions=("bf16",),
    )
    result = plan(request, InProcessExecutor(), predictor=never)
    assert result.predicted == 0 and result.pruned == len(result.candidates) > 0
    assert result.winner is None
    assert all("model state alone needs" in (c.pruned or "") for c in result.candidates)


def test_state_bound_is_the_per_rank_share():
    """gpt2-124m bf16-mixed: 16 B a parameter on one GPU, half of it under FSDP 2, all of it
    under DDP 2."""
    result = plan(SMALL, InProcessExecutor(), predictor=_fake_predictor)
    by_strategy = {c.layout.strategy: c.state_bytes for c in result.candidates}
    assert by_strategy == {
        "single": GPT2_STATE_BYTES, "fsdp": GPT2_STATE_BYTES // 2, "ddp": GPT2_STATE_BYTES,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"global_batch": 0}, "global_batch must be a positive int; got 0"),
        ({"gpus": ()}, "name at least one GPU kind"),
        ({"prices": {"h100": 2.0}}, "prices given for GPU kinds not planned: h100"),
        ({"margin_bytes": -1}, "margin_bytes must be >= 0"),
        ({"max_micro_batch": 0}, "max_micro_batch must be >= 1"),
    ],
)
def test_bad_requests_are_refused(kwargs, message):
    """Each bad field gives an OomkitError naming it."""
    base = {"preset": "gpt2-124m", "global_batch": 4, "seq": 64, "gpus": ("l40s",)}
    with pytest.raises(OomkitError, match=message):
        PlanRequest(**{**base, **kwargs})


@settings(max_examples=50, deadline=None)
@given(price=st.floats(allow_nan=True, allow_infinity=True))
def test_a_price_is_a_finite_number_of_dollars(price):
    """NaN had passed the ``< 0`` check and ranked every layout by NaN dollars; so had inf."""
    base = {"preset": "gpt2-124m", "global_batch": 4, "seq": 64, "gpus": ("l40s",)}
    if math.isfinite(price) and price >= 0:
        assert PlanRequest(**base, prices={"l40s": price}).prices == {"l40s": price}
    else:
        with pytest.raises(OomkitError, match=r"a price per GPU-hour is a finite number >= 0; "
                                              rf"got l40s={re.escape(str(price))}$"):
            PlanRequest(**base, prices={"l40s": price})


def test_a_kind_named_twice_is_refused():
    """--gpus h100,h100 would plan every h100 layout twice; --price h100=1,h100=2 keep one."""
    with pytest.raises(OomkitError, match="h100 named more than once in --gpus"):
        PlanRequest("gpt2-124m", 4, 64, ("h100", "l40s", "h100"))
    from oomkit.interfaces.cli import plan as plan_cli

    with pytest.raises(argparse.ArgumentTypeError, match="h100 is priced twice"):
        plan_cli._prices("h100=1,h100=2")


def test_no_layout_divides_an_odd_batch_beyond_one_gpu_is_still_one_gpu():
    """An odd global batch has only the single-GPU layouts (1 GPU divides anything)."""
    layouts = enumerate_layouts(PlanRequest(
        "gpt2-124m", 3, 64, ("l40s",), max_gpus=8, checkpointing=("none",),
        precisions=("bf16",),
    ))
    assert {(x.gpus, x.micro_batch, x.grad_accum) for x in layouts} == {(1, 1, 3)}


def _parser():
    from oomkit.interfaces.cli import plan as plan_cli

    parser = argparse.ArgumentParser(prog="oomkit")
    plan_cli.add_parser(parser.add_subparsers())
    return parser


def test_plan_command_json_winner_is_a_runnable_scenario(capsys):
    """`oomkit plan --json` on a one-layout plan: the winner's scenario predicts the same peak."""
    from oomkit.scenario import predict, scenario_from_data

    args = _parser().parse_args([
        "plan", "gpt2-124m", "--global-batch", "1", "--seq", "64", "--gpus", "l40s",
        "--max-gpus", "1", "--checkpointing", "none", "--precision", "bf16-mixed",
        "--jobs", "1", "--price", "l40s=1.5", "--json",
    ])
    assert args.run(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["enumerated"], data["predicted"], data["pruned"]) == (1, 1, 0)
    winner = data["winner"]
    assert winner["price_per_hour"] == 1.5 and winner["fits"] is True
    assert data["winner_scenario"]["model"] == {"preset": "gpt2-124m"}
    again = predict(scenario_from_data(data["winner_scenario"]))
    assert again.peak_reserved_bytes == winner["peak_reserved_bytes"]


def test_plan_command_says_what_it_plans_before_it_starts(capsys):
    """Without --json, one line on stderr says what is planned before the search (which may
    take minutes), terminal or not; the table follows on stdout."""
    args = _parser().parse_args([
        "plan", "gpt2-124m", "--global-batch", "1", "--seq", "64", "--gpus", "l40s",
        "--max-gpus", "1", "--checkpointing", "none", "--precision", "bf16-mixed", "--jobs", "1",
    ])
    assert args.run(args) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        "planning gpt2-124m: global batch 1, seq 64, on l40s, up to 1 GPU(s); each layout whose "
        "state fits is recorded (minutes for a large model) ...\n"
    )
    assert "gpt2-124m: global batch 1, seq 64" in captured.out


def test_plan_command_rejects_bad_flags(capsys):
    """argparse refuses an unknown AC policy and a price without '=' (exit 2)."""
    parser = _parser()
    base = ["plan", "gpt2-124m", "--global-batch", "4", "--seq", "64", "--gpus", "l40s"]
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([*base, "--checkpointing", "some"])
    assert exc.value.code == 2
    assert "some: not one of none, selective-op, full" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--price", "h100"])
    assert "write KIND=DOLLARS_PER_GPU_HOUR" in capsys.readouterr().err


def test_plan_to_data_without_a_winner():
    """No layout fits: winner and winner_scenario are null, every candidate is listed."""
    request = PlanRequest("gpt2-124m", 2, 64, ("l40s",), max_gpus=1, checkpointing=("none",),
                          precisions=("bf16-mixed",))
    result = plan(request, InProcessExecutor(),
                  predictor=lambda d: {"peak_reserved_bytes": 1, "fits": False, "headroom_bytes": -1})
    data = plan_to_data(result)
    assert data["winner"] is None and data["winner_scenario"] is None
    assert len(data["candidates"]) == 2


def test_a_refused_scenario_is_its_candidates_error():
    """predict_candidate turns a refusal (a pipelined GPT-2: tied embeddings) into the row's error."""
    from oomkit.scenario.planning import predict_candidate

    result = predict_candidate({
        "model": {"preset": "gpt2-124m"}, "step": {"batch": 2, "seq": 64},
        "parallel": {"pp": 2}, "target": {"gpu": "l40s"},
    })
    assert list(result) == ["error"]
    assert result["error"].startswith("ConfigError: --pp is modelled for the Llama presets")
