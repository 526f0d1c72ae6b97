"""Tests for `oomkit fit`: the largest batch, the smallest GPU, exit codes and the report."""

from __future__ import annotations

import argparse
import io
import json
import textwrap

import pytest

from oomkit.interfaces.cli import main
from oomkit.interfaces.cli.fit import progress_enabled

pytest.importorskip("torch")

MiB = 2**20

# Steps whose peak reserved memory is exact: one request of (k * batch + 4) * 2 MiB, at least
# 10 MiB, so it gets its own segment of exactly that size (CUDACachingAllocator.cpp
# get_allocation_size), plus 10 MiB of "weights" tracked from the start (a 10 MiB segment).
USER_FILE = """
import torch

MiB = 2**20

def build(batch_size, seq_len=16):
    weights = torch.empty(10 * MiB, dtype=torch.uint8)

    def step():
        torch.empty((batch_size + 4) * 2 * MiB, dtype=torch.uint8)

    return step, [weights]

def evaluate(batch_size):
    weights = torch.empty(10 * MiB, dtype=torch.uint8)
    return (lambda: torch.empty((3 * batch_size + 4) * 2 * MiB, dtype=torch.uint8)), [weights]

def no_batch(seq_len=16):
    return lambda: torch.empty(12 * MiB, dtype=torch.uint8)

def raises(batch_size):
    def step():
        raise RuntimeError("shape mismatch in my step")
    return step
"""

# A 100 MiB device with no context overhead: build fits while 10 + (b + 4) * 2 <= 100 MiB.
SMALL = ["--gpu", "100MiB", "--context-overhead", "0"]


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "steps.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_json_has_answer_curve_and_traces(user_file, capsys):
    """Exactly 41 fits with no margin: 12 sizes tried, 4 traced (1, 2 to learn the affine
    step, 41 as the last size bisection tries and 42 to confirm) and 9 interpolated; the JSON
    carries the whole curve."""
    code = main(["fit", f"{user_file}:build", *SMALL, "--margin", "0", "--json"])
    out = _json(capsys)
    assert code == 0
    assert out["batch_size"] == 41
    assert out["peak_reserved_bytes"] == 100 * MiB
    assert out["margin_bytes"] == 0 and out["margin_is_default"] is False
    assert out["traces"] == 4 and out["synthesized"] == 9
    assert out["probe_order"] == [1, 2, 4, 8, 16, 32, 64, 48, 40, 44, 42, 41]
    traced = [p["batch_size"] for p in out["curve"] if not p["synthesized"]]
    assert traced == [1, 2, 41, 42]
    assert [p["batch_size"] for p in out["curve"]] == sorted(out["probe_order"])
    assert out["first_failing_batch"] == 42
    assert out["verdict"] == (
        "largest batch that fits on custom 100.00 MiB: 41 (peak reserved 100.00 MiB, margin "
        "0 B, 4 traces, 9 interpolated); at batch 42, train step 1 does not fit"
    )


def test_margin_flag_lowers_the_answer(user_file, capsys):
    """--margin 10MiB keeps 10 MiB free: 36 instead of 41."""
    assert main(["fit", f"{user_file}:build", *SMALL, "--margin", "10MiB", "--json"]) == 0
    out = _json(capsys)
    assert out["batch_size"] == 36
    assert out["headroom_bytes"] == 10 * MiB


def test_batch_one_not_fitting_exits_1(user_file, capsys):
    """With an 85 MiB margin batch 1 (20 MiB) does not fit in 15 MiB: exit 1 with what to try."""
    code = main(["fit", f"{user_file}:build", *SMALL, "--margin", "85MiB"])
    captured = " ".join(capsys.readouterr().err.split())
    assert code == 1
    assert "not even batch 1 fits on custom 100.00 MiB: train step 1 needs 20.00 MiB" in captured
    assert "a margin of 85.00 MiB must stay free" in captured
    # --json: the same figures as numbers, for scripts.
    assert main(["fit", f"{user_file}:build", *SMALL, "--margin", "85MiB", "--json"]) == 1
    out = _json(capsys)
    assert out["batch_size"] is None and out["error"].startswith("not even batch 1 fits")
    assert (out["needed_reserved_bytes"], out["usable_bytes"], out["margin_bytes"]) == (
        20 * MiB, 100 * MiB, 85 * MiB
    )


@pytest.mark.parametrize("as_json", [False, True])
def test_a_given_margin_above_usable_is_a_usage_error(user_file, capsys, as_json):
    """--margin 100MiB on a 100 MiB GPU asks the impossible: exit 2, one line saying what to
    give, nothing traced and no alternatives searched."""
    code = main(["fit", f"{user_file}:build", *SMALL, "--margin", "100MiB"] + ["--json"] * as_json)
    assert code == 2
    captured = capsys.readouterr()
    assert "the margin of 100.00 MiB is not below the 100.00 MiB usable on custom 100.00 MiB" in (
        captured.err
    )
    assert "Traceback" not in captured.err and "searching again" not in captured.err


def test_default_margin_above_usable_json(user_file, capsys):
    """The default margin (256 MiB) leaves nothing of 100 MiB: one JSON object, exit 1."""
    assert main(["fit", f"{user_file}:build", *SMALL, "--json"]) == 1
    out = _json(capsys)
    assert out["batch_size"] is None
    assert out["error"].startswith("nothing fits on custom 100.00 MiB: the margin of 256.00 MiB")
    assert (out["usable_bytes"], out["margin_bytes"]) == (100 * MiB, 256 * MiB)
    assert "needed_reserved_bytes" not in out  # nothing was traced


def test_eval_step_limits(user_file, capsys):
    """--eval FILE:evaluate (3x memory per sample) caps the batch at 13 and is named."""
    code = main(
        ["fit", f"{user_file}:build", *SMALL, "--margin", "0", "--eval", f"{user_file}:evaluate",
         "--json"]
    )
    out = _json(capsys)
    assert code == 0
    # 10 + (3b + 4) * 2 <= 100 MiB  ->  b <= 13
    assert out["batch_size"] == 13
    assert out["limiting_step"] == "eval"


def test_max_batch_and_start_batch(user_file, capsys):
    """--batch is the first size tried; --max-batch stops the search with a warning."""
    assert main(["fit", f"{user_file}:build", *SMALL, "--margin", "0", "--batch", "3",
                 "--max-batch", "10", "--json"]) == 0
    out = _json(capsys)
    assert out["probe_order"] == [3, 6, 10]
    assert out["batch_size"] == 10 and out["first_failing_batch"] is None
    assert any("max_batch" in w for w in out["warnings"])


def test_terminal_report_table_and_verdict(user_file, capsys, monkeypatch):
    """The terminal report lists every batch tried, marks the answer, and ends with the verdict."""
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["fit", f"{user_file}:build", *SMALL, "--margin", "0", "--max-batch", "4"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert "Memory vs batch size" in captured.out
    rows = [line.split("│")[1:-1] for line in lines if line.startswith("│")]
    assert [[c.strip() for c in row] for row in rows] == [
        ["1", "20.00 MiB", "80.00 MiB", "yes", "train step 1"],
        ["2", "22.00 MiB", "78.00 MiB", "yes", "train step 1"],
        ["4 <", "26.00 MiB", "74.00 MiB", "yes", "train step 1"],
    ]
    verdict = lines.index(
        "largest batch that fits on custom 100.00 MiB: 4 (peak reserved 26.00 MiB, margin 0 B, "
        "3 traces); the search stopped at --max-batch 4"
    )
    assert all(line.startswith("warning: ") for line in lines[verdict + 1 :])
    assert "searching the largest batch" in captured.err


def test_smallest_gpu_json(user_file, capsys):
    """--batch 40 --smallest-gpu: 100 MiB fits on every catalog GPU; the smallest is named."""
    code = main(["fit", f"{user_file}:build", "--batch", "40", "--smallest-gpu", "--json"])
    out = _json(capsys)
    assert code == 0
    assert out["smallest"] == "RTX 3080"  # the catalog's smallest memory
    totals = [c["total_memory_bytes"] for c in out["candidates"]]
    assert totals == sorted(totals) and len(totals) == 28
    assert all(c["peak_reserved_bytes"] == 98 * MiB for c in out["candidates"])
    assert out["traces"] == 9  # one per compute capability in the catalog


def test_smallest_gpu_none_fits_exits_1(user_file, capsys):
    """A batch needing 195 GiB fits on no catalog GPU: exit 1 and a verdict naming the largest."""
    code = main(["fit", f"{user_file}:build", "--batch", "100000", "--smallest-gpu"])
    out = capsys.readouterr().out
    assert code == 1
    assert "batch 100000 fits on none of the 28 GPUs checked: on the largest, B200" in " ".join(
        out.split()
    )


def test_smallest_gpu_needs_batch(user_file, capsys):
    """--smallest-gpu without --batch is a usage error."""
    assert main(["fit", f"{user_file}:build", "--smallest-gpu"]) == 2
    assert "give it with --batch N" in capsys.readouterr().err


def test_function_without_batch_size_is_usage_error(user_file, capsys):
    """A function with no batch_size parameter cannot be searched: exit 2 saying what to add."""
    assert main(["fit", f"{user_file}:no_batch", *SMALL, "--margin", "0"]) == 2
    assert "has no batch_size parameter" in capsys.readouterr().err


def test_step_error_is_one_line(user_file, capsys):
    """An error raised by the user's step exits 2 with the step's message."""
    assert main(["fit", f"{user_file}:raises", *SMALL, "--margin", "0"]) == 2
    assert "shape mismatch in my step" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu", "nosuchgpu"], "nosuchgpu"),
        (["--alloc-conf", "max_split_size_mb:2"], "max_split_size_mb"),
        (["--eval", "gpt2-124m"], "--eval (model.eval_function) takes path/to/file.py:function"),
        (["--batch", "20", "--max-batch", "10"], "above --max-batch 10"),
    ],
)
def test_bad_input_exits_2(user_file, capsys, argv, message):
    """Bad flags exit 2 before any trace."""
    assert main(["fit", f"{user_file}:build", *argv]) == 2
    assert message in capsys.readouterr().err


def test_no_target_exits_2(capsys):
    """`oomkit fit` alone says what to give, and only that: no "searching ..." line first."""
    assert main(["fit", "--gpu", "rtx4090"]) == 2
    err = capsys.readouterr().err
    assert "name what to fit" in err and "searching" not in err


def test_preset_search_on_small_gpu(capsys):
    """GPT-2 124M at seq 64 on 4 GiB: batches 1 and 2 fit (--max-batch 2), two traces."""
    code = main(["fit", "gpt2-124m", "--seq", "64", "--gpu", "4GiB", "--max-batch", "2", "--json"])
    out = _json(capsys)
    assert code == 0
    assert out["batch_size"] == 2 and out["traces"] == 2
    # The GPT-2 presets default to bf16-mixed (issue 16 item 15).
    assert out["description"] == "GPT-2 124M, batch 2, seq 64, bf16-mixed, adamw, train"
    assert out["margin_bytes"] == 256 * MiB and out["margin_is_default"] is True


def test_progress_bar_only_on_a_terminal_without_json():
    """The bar is drawn on a terminal, never with --json or into a pipe."""

    class Tty(io.StringIO):
        def isatty(self):
            return True

    plain = argparse.Namespace(json=False)
    assert progress_enabled(plain, Tty()) is True
    assert progress_enabled(plain, io.StringIO()) is False
    assert progress_enabled(argparse.Namespace(json=True), Tty()) is False


def test_smallest_gpu_verdicts_exact():
    """The reverse question's verdict names the smallest fit, or the largest GPU when none fits."""
    import torch

    from oomkit.core.gpus import GpuSpec
    from oomkit.interfaces.reports.batch_search import smallest_gpu_verdict
    from oomkit.plan.batch_search import smallest_gpu

    def build(batch):
        return lambda: torch.empty((batch + 4) * 2 * MiB, dtype=torch.uint8)

    gpus = [GpuSpec("Small", 64 * MiB, 0), GpuSpec("Big", 128 * MiB, 0)]
    fits = smallest_gpu(build, 30, candidates=gpus, margin_bytes=0)
    assert smallest_gpu_verdict(fits) == (
        "smallest GPU batch 30 fits on: Big (128.00 MiB total, 60.00 MiB headroom, margin 0 B)"
    )
    none = smallest_gpu(build, 100, candidates=gpus, margin_bytes=0)
    assert smallest_gpu_verdict(none) == (
        "batch 100 fits on none of the 2 GPUs checked: on the largest, Big, it needs 208.00 MiB "
        "of 128.00 MiB usable with a 0 B margin"
    )


def test_target_of_carries_the_cudnn_version_explicitly():
    """target.cudnn_version lands in the Target passed down (no context variable is set)."""
    from oomkit.prediction.tracing.emulations import current_sdpa_settings, default_sdpa_settings
    from oomkit.scenario import TargetSection
    from oomkit.scenario.target import target_of

    target = target_of(TargetSection(gpu="h100", cudnn_version=91501))
    assert (target.gpu.name, target.cudnn_version, target.torch_version) == (
        "H100 SXM 80GB", 91501, None
    )
    assert current_sdpa_settings() == default_sdpa_settings()


FIT_GOLDEN = """\
steps.py:build(batch_size=4) on custom 100.00 MiB (100.00 MiB total, 0 B outside PyTorch, margin 0
B, allocator settings: default, 2 training steps per probe)
                   Memory vs batch size
┏━━━━━━━┳━━━━━━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━┳━━━━━━━━━━━━━━┓
┃ batch ┃ peak reserved ┃  headroom ┃ fits ┃ limited by   ┃
┡━━━━━━━╇━━━━━━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━╇━━━━━━━━━━━━━━┩
│     1 │     20.00 MiB │ 80.00 MiB │ yes  │ train step 1 │
│     2 │     22.00 MiB │ 78.00 MiB │ yes  │ train step 1 │
│   4 < │     26.00 MiB │ 74.00 MiB │ yes  │ train step 1 │
└───────┴───────────────┴───────────┴──────┴──────────────┘
warning: custom 100.00 MiB is a plain size with no architecture: the SDPA backend and the cuBLAS and attention workspaces were chosen as on compute capability 9.0 (an H100); name the GPU (e.g. rtx4090, a100-40gb) for its own
warning: batch 4 (max_batch) fits; the search stopped there: raise max_batch (--max-batch) to look further
largest batch that fits on custom 100.00 MiB: 4 (peak reserved 26.00 MiB, margin 0 B, 3 traces); the
search stopped at --max-batch 4
"""


def test_terminal_report_golden(user_file, capsys, monkeypatch):
    """At 100 columns without colour: header, curve table, the warnings, then the verdict last."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.chdir(user_file.parent)  # a relative target: the header does not hold tmp_path
    assert main(["fit", "steps.py:build", *SMALL, "--margin", "0", "--max-batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == FIT_GOLDEN


SMALLEST_GPU_GOLDEN = """\
steps.py:build(batch_size=40) on 28 GPUs
                                 Fit by GPU
┏━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━┓
┃ GPU            ┃      total ┃     needs ┃   headroom ┃     margin ┃ fits ┃
┡━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━┩
│ RTX 3080       │  10.00 GiB │ 98.00 MiB │   9.51 GiB │ 256.00 MiB │ yes  │
│ RTX 3060 12GB  │  12.00 GiB │ 98.00 MiB │  11.51 GiB │ 256.00 MiB │ yes  │
│ T4             │  14.76 GiB │ 98.00 MiB │  14.37 GiB │ 296.00 MiB │ yes  │
│ RTX 4080       │  15.67 GiB │ 98.00 MiB │  15.16 GiB │ 312.00 MiB │ yes  │
│ V100 16GB      │  15.77 GiB │ 98.00 MiB │  15.38 GiB │ 316.00 MiB │ yes  │
│ P100 16GB      │  15.90 GiB │ 98.00 MiB │  15.51 GiB │ 318.00 MiB │ yes  │
│ L4             │  21.99 GiB │ 98.00 MiB │  21.48 GiB │ 440.00 MiB │ yes  │
│ A10G           │  22.06 GiB │ 98.00 MiB │  21.57 GiB │ 442.00 MiB │ yes  │
│ A10            │  22.07 GiB │ 98.00 MiB │  21.58 GiB │ 442.00 MiB │ yes  │
│ RTX 3090       │  23.70 GiB │ 98.00 MiB │  23.21 GiB │ 476.00 MiB │ yes  │
│ RTX 4090       │  23.99 GiB │ 98.00 MiB │  23.47 GiB │ 482.00 MiB │ yes  │
│ RTX 5090       │  31.35 GiB │ 98.00 MiB │  30.72 GiB │ 630.00 MiB │ yes  │
│ V100 32GB      │  31.75 GiB │ 98.00 MiB │  31.36 GiB │ 644.00 MiB │ yes  │
│ A100 40GB      │  39.39 GiB │ 98.00 MiB │  38.91 GiB │ 798.00 MiB │ yes  │
│ L40            │  44.31 GiB │ 98.00 MiB │  43.79 GiB │ 898.00 MiB │ yes  │
│ L40S           │  44.31 GiB │ 98.00 MiB │  43.79 GiB │ 898.00 MiB │ yes  │
│ A40            │  44.34 GiB │ 98.00 MiB │  43.85 GiB │ 900.00 MiB │ yes  │
│ RTX 6000 Ada   │  47.37 GiB │ 98.00 MiB │  46.86 GiB │ 960.00 MiB │ yes  │
│ RTX A6000      │  47.65 GiB │ 98.00 MiB │  47.16 GiB │ 966.00 MiB │ yes  │
│ H100 PCIe      │  79.11 GiB │ 98.00 MiB │  78.34 GiB │   1.57 GiB │ yes  │
│ A100 80GB PCIe │  79.14 GiB │ 98.00 MiB │  78.65 GiB │   1.57 GiB │ yes  │
│ H100 SXM 80GB  │  79.19 GiB │ 98.00 MiB │  78.42 GiB │   1.57 GiB │ yes  │
│ A100 80GB SXM  │  79.21 GiB │ 98.00 MiB │  78.72 GiB │   1.58 GiB │ yes  │
│ H100 NVL       │  93.10 GiB │ 98.00 MiB │  92.33 GiB │   1.85 GiB │ yes  │
│ GH200 96GB     │  95.00 GiB │ 98.00 MiB │  94.24 GiB │   1.88 GiB │ yes  │
│ H200           │ 139.80 GiB │ 98.00 MiB │ 139.04 GiB │   2.78 GiB │ yes  │
│ H200 NVL       │ 139.80 GiB │ 98.00 MiB │ 139.04 GiB │   2.78 GiB │ yes  │
│ B200           │ 178.36 GiB │ 98.00 MiB │ 177.73 GiB │   3.55 GiB │ yes  │
└────────────────┴────────────┴───────────┴────────────┴────────────┴──────┘
smallest GPU batch 40 fits on: RTX 3080 (10.00 GiB total, 9.51 GiB headroom, margin 256.00 MiB)
"""


def test_smallest_gpu_report_golden(user_file, capsys, monkeypatch):
    """At 100 columns: one row per catalog GPU (smallest first) and the smallest that fits."""
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.chdir(user_file.parent)
    assert main(["fit", "steps.py:build", "--batch", "40", "--smallest-gpu"]) == 0
    out = capsys.readouterr().out
    assert "\n".join(line.rstrip() for line in out.splitlines()) + "\n" == SMALLEST_GPU_GOLDEN


def test_torch_version_reaches_the_search(user_file, capsys, monkeypatch):
    """--torch-version reaches max_batch_size and smallest_gpu; 2.0 rejects expandable segments."""
    import oomkit.plan.batch_search as batch_search

    versions = []
    real_max, real_smallest = batch_search.max_batch_size, batch_search.smallest_gpu

    def spy_max(*args, **kwargs):
        versions.append(("max_batch_size", kwargs["target"].torch_version))
        return real_max(*args, **kwargs)

    def spy_smallest(*args, **kwargs):
        versions.append(("smallest_gpu", kwargs["target"].torch_version))
        return real_smallest(*args, **kwargs)

    monkeypatch.setattr(batch_search, "max_batch_size", spy_max)
    monkeypatch.setattr(batch_search, "smallest_gpu", spy_smallest)
    target = f"{user_file}:build"
    argv = ["fit", target, *SMALL, "--margin", "0", "--max-batch", "4", "--json"]
    assert main([*argv, "--torch-version", "2.5"]) == 0
    assert _json(capsys)["batch_size"] == 4
    assert main(["fit", target, "--batch", "2", "--smallest-gpu", "--torch-version", "2.4",
                 "--json"]) == 0
    capsys.readouterr()
    assert versions == [("max_batch_size", "2.5"), ("smallest_gpu", "2.4")]
    argv = ["fit", target, *SMALL, "--alloc-conf", "expandable_segments:True"]
    assert main([*argv, "--torch-version", "2.0"]) == 2
    assert "(torch 2.0 rules)" in capsys.readouterr().err


def test_the_python_answer_names_its_batch_and_peak(user_file):
    """oomkit.fit(...).batch_size and .peak_reserved_bytes are the search's (41, 100 MiB with
    no margin), as a user reads them; a smallest-GPU answer has no batch of its own there."""
    import oomkit

    answer = oomkit.fit(f"{user_file}:build", gpu="100MiB", context_overhead="0B", margin="0B")
    assert (answer.kind, answer.batch_size, answer.peak_reserved_bytes) == ("batch", 41, 100 * MiB)
    assert answer.batch_size == answer.result.batch_size
    smallest = oomkit.fit(f"{user_file}:build", batch=4, smallest_gpu=True)
    assert (smallest.kind, smallest.batch_size, smallest.peak_reserved_bytes) == (
        "smallest_gpu", None, None
    )
    # repr() is the answer in one line (it had been every field, kilobytes of them).
    assert repr(answer) == (
        "<FitAnswer: batch 41 on custom 100.00 MiB, peak reserved 100.00 MiB of 100.00 MiB "
        "usable>"
    )
    assert repr(smallest) == f"<FitAnswer: smallest GPU {smallest.result.smallest.name}>"
