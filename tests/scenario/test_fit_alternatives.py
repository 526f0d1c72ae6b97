"""``fit`` when not even batch 1 fits: the largest batch with each change, searched again.

The expected figures are ``oomkit.predict`` of the same flags (``steps=2``, as fit records),
made apart from the search: GPT-2 124M at seq 1024 needs, reserved on a device without limit,

    as given (bf16-mixed, AdamW)          batch 1: 3,300,917,248
    --precision bf16                      batch 1: 1,698,693,120  batch 2: 2,216,689,664
    --checkpointing full                  batch 1: 3,279,945,728
    --optimizer sgd                       batch 1: 2,424,307,712  batch 2: 3,621,781,504
    --optimizer adamw8bit                 batch 1: 2,235,564,032  batch 2: 3,227,516,928
    --checkpointing full --precision bf16 batch 1: 1,669,332,992  batch 2: 1,969,225,728
"""

from __future__ import annotations

import json

import pytest
from rich.console import Console

import oomkit
from oomkit.errors import NoFeasibleBatchSizeError
from oomkit.interfaces.cli import main
from oomkit.interfaces.reports.batch_search import render_alternatives, unmeasured_advice
from oomkit.scenario.alternatives import FitAlternative, searches_alternatives

pytest.importorskip("torch")

GiB = 2**30
# No context and no margin: a batch fits while it needs at most the GPU's size.
EXACT = ["--context-overhead", "0", "--margin", "0"]


def test_each_change_gets_its_largest_batch_in_the_cli(capsys, monkeypatch):
    """On 2.5 GiB (2,684,354,560 bytes) batch 1 needs 3,300,917,248: QLoRA fits batch 4, LoRA
    3, pure bf16 2, SGD and 8-bit AdamW 1, checkpointing alone none, and with pure bf16 4; the
    text leads with the largest batch (the first of the largest, QLoRA) and lists only what it
    did not measure (no "Try ... --precision bf16")."""
    argv = ["fit", "gpt2-124m", "--seq", "1024", "--gpu", "2.5GiB", *EXACT]
    assert main([*argv, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["needed_reserved_bytes"] == 3_300_917_248
    assert out["error"].endswith("a margin of 0 B must stay free.")  # no unmeasured "Try ..."
    rows = [(a["flags"], a["batch_size"], a["peak_reserved_bytes"]) for a in out["alternatives"]]
    assert rows == [
        ("--precision bf16", 2, 2_216_689_664),
        ("--checkpointing full", None, 3_279_945_728),
        ("--optimizer sgd", 1, 2_424_307_712),
        # LoRA and QLoRA on a bf16 base, as peft users load it: LoRA's batch 4 needs
        # 2,971,664,384; QLoRA's batch 4 fits without the allocator retrying.
        ("--lora 8 --precision bf16", 3, 2_334_130_176),
        ("--lora 8 --quantize nf4 --precision bf16", 4, 2_449_473_536),
        ("--optimizer adamw8bit", 1, 2_235_564_032),
        # Then the combinations, to the first that fits: batch 5 needs 3,095,396,352.
        ("--checkpointing full --precision bf16", 4, 2_529_165_312),
    ]
    assert [a["combined"] for a in out["alternatives"]] == [False] * 6 + [True]
    assert out["alternatives"][4]["settings"] == {
        "lora.rank": 8,
        "quantize.format": "nf4",
        "quantize.double_quant": False,
        "step.precision": "bf16",
    }
    assert out["not_measured"] == ["a shorter sequence or smaller images"]

    # The text of the same answer (the searches above, not run again).
    measured = tuple(
        FitAlternative(a["change"], a["flags"], a["settings"], a["batch_size"],
                       a["peak_reserved_bytes"], a["combined"])
        for a in out["alternatives"]
    )
    monkeypatch.setattr("oomkit.scenario.alternatives.fit_alternatives", lambda *a, **k: measured)
    assert main(argv) == 1
    captured = capsys.readouterr()
    err, text = " ".join(captured.err.split()), " ".join(captured.out.split())
    assert (
        "not even batch 1 fits on custom 2.50 GiB: train step 1 needs 3.07 GiB reserved, and of "
        "the 2.50 GiB usable a margin of 0 B must stay free. searching again" in err
    )
    assert "Try" not in err  # the unmeasured advice is replaced by the measurements
    assert (
        "with --lora 8 --quantize nf4 --precision bf16: batch 4 fits (peak reserved 2.28 GiB)"
        in text
    )
    assert "batch 1 needs 3.05 GiB" in text  # checkpointing alone
    assert text.endswith(
        "not measured: a shorter sequence or smaller images, a smaller margin (--margin), a GPU "
        "with more memory (--batch 1 --smallest-gpu names the smallest)"
    )


def test_no_change_alone_fits_then_the_least_combination(monkeypatch):
    """On 1.3 GiB (1,395,864,371 bytes), of pure bf16 and checkpointing neither fits batch 1
    alone; together they fit, freeing the cache once on the way (1,367,343,104 reserved at
    the peak there, as `oomkit predict` of those flags on that GPU says), and their batch 2
    does not: the search stops at that first fitting combination. (LoRA and QLoRA, which fit
    GPT-2's batch 1 there alone, and the optimizer changes are left out of the changes tried.)"""
    from oomkit.diagnose import remedy_measurement

    every_change = remedy_measurement.step_changes

    def precision_and_checkpointing(base, compute_capability):
        return [
            c for c in every_change(base, compute_capability)
            if c.fields.keys() <= {"precision", "checkpointing"}
        ]

    monkeypatch.setattr(remedy_measurement, "step_changes", precision_and_checkpointing)
    found = oomkit.fit_alternatives(
        "gpt2-124m", seq=1024, gpu="1.3GiB", context_overhead="0B", margin="0B"
    )
    assert [(a.flags, a.batch_size, a.peak_reserved_bytes, a.combined) for a in found] == [
        ("--precision bf16", None, 1_698_693_120, False),
        ("--checkpointing full", None, 3_279_945_728, False),
        ("--checkpointing full --precision bf16", 1, 1_367_343_104, True),
    ]
    assert found[-1].title == (
        "activation checkpointing + pure bf16 weights, gradients and optimizer states"
    )
    assert dict(found[-1].settings) == {"step.checkpointing": "full", "step.precision": "bf16"}


@pytest.mark.parametrize(
    ("what", "keywords"),
    [
        ("gpt2-124m", {"mode": "inference"}),
        ("gpt2-124m", {"batch": 4, "smallest_gpu": True}),
        ("train.py:build", {}),
    ],
)
def test_searched_only_for_a_training_batch_search_of_a_preset_or_hf_model(what, keywords):
    """An inference step, the reverse question and a file.py:function (whose precision is the
    user's code) get no alternatives; a preset's training batch search does."""
    from oomkit.scenario.keywords import scenario_from_keywords

    assert not searches_alternatives(scenario_from_keywords(what, "fit", **keywords))
    assert searches_alternatives(scenario_from_keywords("gpt2-124m", "fit", seq=64))
    # A whole run's batch (--lengths) is searched too.
    assert searches_alternatives(scenario_from_keywords("gpt2-124m", "fit", lengths="l.txt"))


def test_unmeasured_advice_drops_what_a_single_change_measured():
    """An item whose flag runs, word for word, in a measured change's flags is dropped ("--lora
    8" in "--lora 8 --precision bf16-mixed"; "--precision bf16" is not "--precision
    bf16-mixed"); a combination's flags do not count (its changes were measured alone first)."""
    error = NoFeasibleBatchSizeError(
        "m",
        advice=(
            "activation checkpointing (--checkpointing full)",
            "SGD with momentum, one state instead of two (--optimizer sgd)",
            "LoRA adapters instead of full fine-tuning (--lora 8)",
            "bf16 weights, gradients and optimizer states (--precision bf16)",
            "a shorter sequence or smaller images",
        ),
    )
    measured = [
        FitAlternative("activation checkpointing", "--checkpointing full", {}, None, 1),
        FitAlternative("both", "--optimizer sgd", {}, 1, 1, combined=True),
        FitAlternative("LoRA", "--lora 8 --precision bf16-mixed", {}, 1, 1),
    ]
    assert unmeasured_advice(error, measured) == (
        "SGD with momentum, one state instead of two (--optimizer sgd)",
        "bf16 weights, gradients and optimizer states (--precision bf16)",
        "a shorter sequence or smaller images",
    )
    assert error.reason == "m"  # a message without advice is its own reason


def test_a_run_of_lengths_gets_each_change_searched_as_fit_lengths(tmp_path, capsys, monkeypatch):
    """fit --lengths (256, 512, 384) on 2 GiB: batch 1's run of GPT-2 runs out of memory at its
    first step. Pure bf16 (the only change let run here) fits batch 4, whose worst step needs
    2,139,095,040 bytes, as `oomkit fit --lengths ... --precision bf16` made apart says. The
    advice left unmeasured is the step's: no mixed precision (the preset's step is bf16-mixed
    already), and the run's lengths are the data's to truncate."""
    from oomkit.diagnose import remedy_measurement

    every_change = remedy_measurement.step_changes
    monkeypatch.setattr(
        remedy_measurement, "step_changes",
        lambda base, cc: [c for c in every_change(base, cc) if c.fields.keys() <= {"precision"}],
    )
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("256\n512\n384\n")
    argv = ["fit", "gpt2-124m", "--lengths", str(lengths), "--gpu", "2GiB", *EXACT, "--json"]
    assert main(argv) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == (
        "not even batch 1 runs the whole run on custom 2.00 GiB: its step 1 runs out of memory "
        "(2.00 GiB reserved before it did), and of the 2.00 GiB usable a margin of 0 B must stay "
        "free."
    )
    assert [(a["flags"], a["batch_size"], a["peak_reserved_bytes"]) for a in out["alternatives"]] \
        == [("--precision bf16", 4, 2_139_095_040)]
    assert out["not_measured"] == [
        "activation checkpointing (--checkpointing full)",
        "8-bit AdamW states (--optimizer adamw8bit)",
        "SGD with momentum, one state instead of two (--optimizer sgd)",
        "LoRA adapters instead of full fine-tuning (--lora 8)",
        "a shorter sequence or smaller images (truncate the longest the run will see)",
    ]


def test_a_run_that_runs_out_part_way_has_no_figure_but_says_so():
    """A change whose batch-1 run runs out of memory part-way (--lengths) has no need to
    print: the row says the run runs out."""
    error = NoFeasibleBatchSizeError("m", advice=("a shorter sequence or smaller images",))
    rows = [FitAlternative("SGD", "--optimizer sgd", {}, None, None)]
    console = Console(record=True, width=200)
    render_alternatives(error, rows, console)
    text = " ".join(console.export_text().split())
    assert "│ SGD │ --optimizer sgd │ none │ batch 1 runs out part-way │" in text


def test_a_sharded_search_is_pointed_at_gpu_counts_not_smallest_gpu():
    """--smallest-gpu refuses --fsdp/--tp/--dp: a sharded search's last suggestion is the
    --global-batch table instead; with no change fitting, the verdict says so."""
    error = NoFeasibleBatchSizeError("m", advice=("a shorter sequence or smaller images",))
    rows = [FitAlternative("activation checkpointing", "--checkpointing full", {}, None, 5 * GiB)]
    console = Console(record=True, width=200)
    render_alternatives(error, rows, console, sharded=True)
    text = " ".join(console.export_text().split())
    assert "batch 1 needs 5.00 GiB" in text
    assert "no change searched here fits even batch 1" in text
    assert text.endswith(
        "not measured: a shorter sequence or smaller images, a smaller margin (--margin), more "
        "GPUs or GPUs with more memory (--smallest-gpu --global-batch B, without "
        "--fsdp/--tp/--dp, tabulates both)"
    )


def test_a_margin_that_leaves_nothing_searches_no_change(capsys):
    """The default margin (256 MiB) leaves nothing of 200 MiB: no step was recorded and no
    change can make room, so nothing is searched again and the message keeps its advice."""
    assert main(["fit", "gpt2-124m", "--gpu", "200MiB", "--context-overhead", "0", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["error"].startswith("nothing fits on custom 200.00 MiB: the margin of 256.00 MiB")
    assert "alternatives" not in out and "needed_reserved_bytes" not in out
