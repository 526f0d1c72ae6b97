"""``fit --compile``, ``--compile --lengths`` and ``--compile --mode generate`` from the CLI.

Compiled recordings run dynamo and AOTAutograd for real, which costs seconds per recording even
for one layer, so these tests use a one-layer GPT-2 preset (``gpt2-tiny``, added to the preset
table for the test) and one or two steps.
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType

import pytest

pytest.importorskip("torch")

from oomkit.interfaces.cli import main  # noqa: E402
from oomkit.prediction.models import presets  # noqa: E402
from oomkit.prediction.models.gpt2 import GPT2Shape  # noqa: E402

COMPILED = "compiled (AOTAutograd partitioner real, Inductor fusion emulated)"
# A plain-size GPU with no context, searched with no margin: fit's probes and predict then
# replay on the same usable bytes, so their peaks compare exactly.
_DEVICE = ["--gpu", "230MiB", "--context-overhead", "0"]


@pytest.fixture
def tiny(monkeypatch):
    """A one-layer GPT-2 (width 256, vocabulary 8192, 512 positions) as preset gpt2-tiny."""
    base = presets.get_preset("gpt2-124m")
    shape = GPT2Shape(hidden=256, layers=1, heads=4, vocab=8192, positions=512)
    preset = dataclasses.replace(base, name="gpt2-tiny", title="GPT-2 tiny", shape=shape)
    monkeypatch.setattr(presets, "PRESETS", MappingProxyType({**presets.PRESETS, "gpt2-tiny": preset}))
    return "gpt2-tiny"


def _json(argv, capsys, code=0):
    assert main(argv) == code
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def _printed_once():
    """What ``predict gpt2-tiny --compile --batch 1 --seq 256 --steps 1 --json`` printed, once
    it has been run in this module (``[]`` before)."""
    return []


@pytest.fixture
def short_compiled(tiny, capsys, _printed_once):
    """``predict gpt2-tiny --compile --batch 1 --seq 256 --steps 1``'s JSON (a fresh copy each):
    recorded once for the two tests that read it (the 256-long step of --lengths and the saved
    prediction that explain re-predicts)."""
    if not _printed_once:
        argv = ["predict", tiny, "--compile", "--batch", "1", "--seq", "256", "--steps", "1", "--json"]
        assert main(argv) == 0
        _printed_once.append(capsys.readouterr().out)
    return json.loads(_printed_once[0])


def test_fit_compile_answer_fits_compiled_and_the_next_batch_does_not(tiny, capsys):
    """fit --compile finds batch 3 on 230 MiB (with an allocator retry; 2 without); predict
    --compile at 3 fits and at 4 does not, with exactly the bytes of fit's probes, and the
    report says the step was compiled."""
    shape = ["--seq", "512", "--steps", "1"]
    found = _json(
        ["fit", tiny, "--compile", *shape, *_DEVICE, "--margin", "0", "--batch", "3",
         "--max-batch", "4", "--json"],
        capsys,
    )
    # Batch 3 fits only with an allocator retry: 2 is the answer without, 3 is named.
    assert (found["batch_size"], found["with_retries_batch_size"], found["first_failing_batch"]) == (
        2, 3, 4)
    assert found["assumptions"]["torch.compile"].startswith(COMPILED)
    assert "torch.compile" in found["description"].split(", ")
    assert any(w.startswith(f"torch.compile: {COMPILED}") for w in found["warnings"])
    curve = {probe["batch_size"]: probe for probe in found["curve"]}
    fits = _json(["predict", tiny, "--compile", *shape, *_DEVICE, "--batch", "3", "--json"], capsys)
    # --no-remedies: the remedies of a step that does not fit are measured by re-predicting it
    # compiled with each change (11 s of CPU); this test reads only the verdict and the bytes.
    over = _json(
        ["predict", tiny, "--compile", *shape, *_DEVICE, "--batch", "4", "--no-remedies", "--json"],
        capsys,
        code=1,
    )
    assert fits["fits"] and not over["fits"]
    for probe, predicted in ((curve[3], fits), (curve[4], over)):
        assert probe["peak_reserved_bytes"] == predicted["required_bytes"]
        assert probe["peak_allocated_bytes"] == predicted["peak_allocated_bytes"]
    assert fits["workload"]["options"]["compile"] is True


def test_compile_with_lengths_gives_each_length_its_compiled_peaks(tiny, tmp_path, capsys, short_compiled):
    """predict --compile --lengths: step 1 (length 256) has predict --compile --seq 256's peaks,
    step 2 (length 512) the steady step's peak allocated of --seq 512, whose two steps alone give
    the envelope's longest-alone figure (and fit --compile --lengths' run of 512 alone); both
    state the per-length static compile they assumed."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("256\n512\n")  # multiples of 256: no padding remedy records another length
    run = _json(["predict", tiny, "--compile", "--batch", "1", "--lengths", str(lengths), "--json"], capsys)
    assert "each distinct length recorded with its own static compile" in (
        run["assumptions"]["torch.compile lengths"]
    )
    assert run["assumptions"]["torch.compile"].startswith(COMPILED)
    step_1, step_2 = run["step_peaks"]
    one = ["predict", tiny, "--compile", "--batch", "1", "--json"]
    short = short_compiled  # [*one, "--seq", "256", "--steps", "1"]
    long = _json([*one, "--seq", "512", "--steps", "2"], capsys)
    assert (step_1["peak_allocated_bytes"], step_1["peak_reserved_bytes"]) == (
        short["peak_allocated_bytes"],
        short["peak_reserved_bytes"],
    )
    assert step_2["peak_allocated_bytes"] == long["step_peaks"][1]["peak_allocated_bytes"]
    assert run["envelope"]["longest_alone_peak_reserved_bytes"] == long["peak_reserved_bytes"]
    eager = _json(["predict", tiny, "--batch", "1", "--lengths", str(lengths), "--json"], capsys)
    assert eager["step_peaks"][1]["peak_allocated_bytes"] != step_2["peak_allocated_bytes"]
    # fit --compile --lengths: a run of two steps at 512 is exactly its two compiled steps.
    lengths.write_text("512\n512\n")
    found = _json(
        ["fit", tiny, "--compile", "--lengths", str(lengths), "--max-batch", "1", "--json"], capsys
    )
    assert found["probes"][0]["worst_peak_reserved_bytes"] == long["peak_reserved_bytes"]
    assert "torch.compile lengths" in found["assumptions"]


def test_compile_with_generate_is_refused_with_the_reason(capsys):
    """--compile --mode generate exits 2: a compiled decode is a dynamic-shape (or CUDA-graph)
    graph, which the emulation does not model; the message says what to predict instead."""
    code = main(["predict", "gpt2-124m", "--compile", "--mode", "generate", "--seq", "16"])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--compile with --mode generate is not modelled" in err
    assert "automatic_dynamic_shapes" in err and "reduce-overhead" in err
    assert "--mode inference --compile --seq PROMPT+NEW_TOKENS" in err


def test_a_saved_compiled_prediction_is_re_predicted_compiled(tiny, short_compiled):
    """explain's re-prediction of a saved predict --compile (batch 1, seq 256, 1 step) gives its
    bytes exactly, compiled (before: the forward wrapped in torch.compile but recorded
    eagerly)."""
    from oomkit.diagnose._model_remedies import _repredict
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.workload import workload_from_json

    data = short_compiled
    workload = workload_from_json(data)
    assert workload.compile is True
    known = {name: value for name, value in workload.options.items() if value is not None}
    again = _repredict(data, workload, StepOptions(**known))
    assert again.assumptions["torch.compile"].startswith(COMPILED)
    assert again.required_bytes == data["required_bytes"]
    assert again.peak_allocated_bytes == data["peak_allocated_bytes"]


def test_smallest_gpu_global_batch_records_each_count_compiled(tiny, capsys):
    """--compile with --smallest-gpu --global-batch 2: one GPU recorded compiled as predict
    --compile records it, two as FSDP2 with each block compiled (before: refused)."""
    code = main(["fit", tiny, "--compile", "--smallest-gpu", "--global-batch", "2",
                 "--max-gpus", "2", "--seq", "16", "--steps", "1", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [(r["gpu_count"], r["per_rank_batch"]) for r in data["rows"]] == [(1, 2), (2, 1)]
    assert "torch.compile" in data["rows"][0]["description"]
    assert "each block compiled (torchtitan apply_compile" in data["rows"][1]["description"]
