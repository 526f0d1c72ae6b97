"""predict --lengths: the epoch envelope on the command line, its JSON contract and bad input."""

from __future__ import annotations

import json
import textwrap

import pytest

from oomkit.interfaces.cli import main

STEP = textwrap.dedent(
    """
    import torch

    def build(batch_size=2, seq_len=64):
        model = torch.nn.Sequential(
            torch.nn.Embedding(100, 64), torch.nn.Linear(64, 256), torch.nn.GELU(),
            torch.nn.Linear(256, 100),
        )
        opt = torch.optim.AdamW(model.parameters())
        tokens = torch.randint(0, 100, (batch_size, seq_len))

        def step():
            loss = model(tokens).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, (model, opt, tokens)
    """
)


@pytest.fixture
def step_file(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(STEP)
    return path


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_constant_lengths_equal_the_ordinary_prediction(step_file, tmp_path, capsys):
    """Three steps of length 64 give exactly predict --seq 64 --steps 3's peaks."""
    lengths = tmp_path / "l.txt"
    lengths.write_text("64\n64\n64\n")
    target = f"{step_file}:build"
    assert main(["predict", target, "--seq", "64", "--steps", "3", "--gpu", "8GiB", "--json"]) == 0
    plain = _json(capsys)
    assert main(["predict", target, "--lengths", str(lengths), "--gpu", "8GiB", "--json"]) == 0
    env = _json(capsys)
    assert env["envelope"]["per_step_peak_reserved_bytes"] == [
        p["peak_reserved_bytes"] for p in plain["step_peaks"]
    ]
    assert env["peak_reserved_bytes"] == plain["peak_reserved_bytes"]
    assert env["envelope"]["creep_bytes"] == 0 and env["envelope"]["steps"] == 3


def test_envelope_json_contract_and_html(step_file, tmp_path, capsys):
    """A histogram file, padded to 32: the envelope's fields, and the page written."""
    lengths = tmp_path / "h.csv"
    lengths.write_text("40,2\n100,1\n")
    page = tmp_path / "env.html"
    code = main(
        ["predict", f"{step_file}:build", "--lengths", str(lengths), "--pad-to", "32",
         "--gpu", "8GiB", "--json", "--html", str(page)]
    )
    assert code == 0
    env = _json(capsys)["envelope"]
    assert env["lengths"] == [64, 64, 128]
    assert set(env) >= {
        "steps", "worst_step", "worst_length", "worst_peak_reserved_bytes", "first_oom_step",
        "per_step_peak_reserved_bytes",
    }
    peaks = env["per_step_peak_reserved_bytes"]
    assert len(peaks) == 3 and env["first_oom_step"] is None
    assert env["worst_peak_reserved_bytes"] == max(peaks) == peaks[env["worst_step"] - 1]
    assert env["worst_length"] == env["lengths"][env["worst_step"] - 1]
    assert {r["name"] for r in env["remedies"]} >= {"expandable_segments:True", "largest batch first"}
    assert "fits every step" in page.read_text()


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("", [], "no lengths"),
        ("64\nabc\n", [], "'abc' is not a whole number"),
        ("64\n", ["--seq", "64"], "give --lengths or --seq, not both"),
    ],
)
def test_bad_lengths_input_exits_2(step_file, tmp_path, capsys, content, extra, message):
    """Empty or non-numeric files and --seq with --lengths: exit 2, one message, no output."""
    lengths = tmp_path / "l.txt"
    lengths.write_text(content)
    code = main(["predict", f"{step_file}:build", "--lengths", str(lengths), "--gpu", "8GiB", *extra])
    captured = capsys.readouterr()
    assert code == 2 and message in captured.err and captured.out == ""


def test_steps_zero_and_html_without_lengths_are_refused(step_file, capsys):
    """--steps 0 is refused (exit 2, the flag named); --html without --lengths exits 2 naming
    --lengths."""
    assert main(["predict", f"{step_file}:build", "--steps", "0"]) == 2
    assert "--steps (run.steps): must be at least 1; got '0'" in capsys.readouterr().err
    assert main(["predict", f"{step_file}:build", "--html", "x.html", "--gpu", "8GiB"]) == 2
    assert "with --lengths FILE" in capsys.readouterr().err


def test_images_preset_refuses_lengths(tmp_path, capsys):
    """resnet50 takes images: --lengths is refused before anything is built."""
    lengths = tmp_path / "l.txt"
    lengths.write_text("64\n")
    assert main(["predict", "resnet50", "--lengths", str(lengths)]) == 2
    assert "takes images" in capsys.readouterr().err


def test_fit_lengths_finds_the_batch_of_the_whole_run(step_file, tmp_path, capsys):
    """fit --lengths: the batch found runs the whole file; the next one tried does not fit.
    Recordings traced: both lengths at 1 and 2 (to learn) and 64 (--max-batch, confirmed);
    the embedding backward at length 64 takes its sorting path from batch 49 on (3,136 >
    3,072 indices), a site (emulation_sites.py) synthesized on either path, so the first search
    stands: 6 traced, 10 synthesized, where tracing every probe would make 14 (and the search
    ran twice, 10 traced and 14 synthesized, before the sites)."""
    lengths = tmp_path / "l.txt"
    lengths.write_text("32\n64\n")
    code = main(
        ["fit", f"{step_file}:build", "--lengths", str(lengths), "--gpu", "1GiB",
         "--max-batch", "64", "--json"]
    )
    assert code == 0
    out = _json(capsys)
    best = out["batch_size"]
    assert out["envelope"]["first_oom_step"] is None and out["envelope"]["lengths"] == [32, 64]
    fits = {p["batch_size"]: p["fits"] for p in out["probes"]}
    assert fits[best] is True
    assert best == 64 or fits.get(best + 1) is False
    assert (out["traces"], out["synthesized"]) == (6, 10)
    assert [(p["batch_size"], p["synthesized"]) for p in out["probes"]] == [
        (1, False), (2, False), (4, True), (8, True), (16, True), (32, True), (64, False)
    ]


def test_fit_seed_without_lengths_is_refused(step_file, capsys):
    """--seed alone changes nothing: exit 2 naming --lengths."""
    assert main(["fit", f"{step_file}:build", "--seed", "1", "--gpu", "1GiB"]) == 2
    assert "with --lengths FILE" in capsys.readouterr().err


def test_a_length_past_the_presets_positions_is_refused_before_recording(tmp_path, capsys):
    """GPT-2 has 1024 positions: a 4096 length exits 2 at once, naming the maximum."""
    lengths = tmp_path / "l.txt"
    lengths.write_text("512\n4096\n")
    assert main(["predict", "gpt2-124m", "--lengths", str(lengths), "--gpu", "rtx4090"]) == 2
    captured = capsys.readouterr()
    assert "longer than the model's maximum, 1024" in captured.err
    assert "recording a step" not in captured.err
