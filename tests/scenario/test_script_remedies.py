"""A whole script that does not fit gets its own batch argument, halved, measured by predicting
the script again (``scenario/script_remedies.py``)."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import pytest

from oomkit.scenario import scenario_from_data
from oomkit.scenario.script_remedies import MAX_TRIES, script_batch_remedy

GiB = 2**30


def _outcome(required_bytes: int, usable_bytes: int = 10 * GiB) -> SimpleNamespace:
    return SimpleNamespace(
        required_bytes=required_bytes,
        usable_bytes=usable_bytes,
        fits=required_bytes <= usable_bytes,
    )


class _Predictor:
    """Predicts a script's need as ``per_example`` bytes times its batch argument (and the
    accumulation it is given); keeps each scenario's arguments."""

    def __init__(self, name: str, per_example: int) -> None:
        self.name, self.per_example, self.seen = name, per_example, []

    def __call__(self, scenario):
        # The scenario predicted is a valid one: what validating its own data gives, its
        # arguments a tuple (a list would make pydantic warn on every dump).
        assert scenario == scenario_from_data(scenario.model_dump(mode="json"))
        assert type(scenario.model.script_args) is tuple
        args = list(scenario.model.script_args)
        self.seen.append(args)
        assert scenario.step.batch is None
        batch = next(int(w.split("=")[1]) for w in args if w.startswith(self.name + "="))
        return _outcome(batch * self.per_example)


def _scenario(tmp_path, args, **model):
    script = tmp_path / "t.py"
    script.write_text('p.add_argument("--batch-size")\n')
    return scenario_from_data(
        {"model": {"script": str(script), "script_args": args, **model}}
    )


def test_the_batch_is_halved_until_it_fits(tmp_path):
    """64 needs 16 GiB of 10: 32 (8 GiB) fits, the first tried; the remedy says it, measured,
    and that accumulation holds the gradients, not measured."""
    scenario = _scenario(tmp_path, ["--lr", "1", "--batch-size=64"])
    predict = _Predictor("--batch-size", GiB // 4)
    remedy = script_batch_remedy(scenario, _outcome(16 * GiB), predict)
    assert predict.seen == [["--lr", "1", "--batch-size=32"]]
    assert remedy is not None
    assert (remedy.title, remedy.flag, remedy.fits) == (
        "a smaller batch, 32 instead of 64", "-- --batch-size 32", True
    )
    assert (remedy.peak_reserved_bytes, remedy.saving_bytes) == (8 * GiB, 8 * GiB)
    assert "accumulate gradients over 2 micro-batches" in remedy.why
    assert remedy.why.endswith("needs 8.00 GiB reserved instead of 16.00 GiB and fits in the "
                               "10.00 GiB usable.")


def test_at_most_max_tries_halvings_then_the_smallest_is_said_not_to_fit(tmp_path):
    """Nothing fits down to 1024 / 2**MAX_TRIES: that is the remedy, 'still does not fit'."""
    scenario = _scenario(tmp_path, [], script_batch_arg="--batch-size")
    scenario = scenario.model_copy(update={"step": scenario.step.model_copy(update={"batch": 1024})})
    predict = _Predictor("--batch-size", GiB)
    remedy = script_batch_remedy(scenario, _outcome(1024 * GiB), predict)
    sizes = [int(args[-1].split("=")[1]) for args in predict.seen]
    assert sizes == [512, 256, 128, 64][:MAX_TRIES]
    assert remedy is not None and remedy.fits is False
    assert remedy.title == f"a smaller batch, {1024 >> MAX_TRIES} instead of 1024"


def test_the_trainer_s_batch_keeps_its_global_batch_with_accumulation(tmp_path):
    """--per_device_train_batch_size 16 with --gradient_accumulation_steps 2: 8 with 4."""
    scenario = _scenario(tmp_path, ["--per_device_train_batch_size", "16",
                                    "--gradient_accumulation_steps", "2"])
    seen = []

    def recorded(smaller):
        seen.append(list(smaller.model.script_args))
        return _outcome(8 * GiB)

    remedy = script_batch_remedy(scenario, _outcome(16 * GiB), recorded)
    assert seen == [["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4"]]
    assert remedy is not None
    assert remedy.flag == "-- --per_device_train_batch_size 8 --gradient_accumulation_steps 4"
    assert "the Trainer's accumulation recorded" in remedy.why


@pytest.mark.parametrize("args", [["--batch-size", "1"], ["--lr", "1"]])
def test_no_remedy_without_a_batch_to_halve(tmp_path, args):
    """Batch 1, or no batch value known (the parser's option without a value): none."""
    scenario = _scenario(tmp_path, args)
    assert script_batch_remedy(scenario, _outcome(16 * GiB), _Predictor("--batch-size", 1)) is None


SCRIPT = """
import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
args = parser.parse_args()
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024))
model.to("cuda")
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    x = torch.randn(args.batch_size, 64, 1024, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""


def test_predict_of_a_script_that_does_not_fit_measures_a_smaller_batch(tmp_path, capsys):
    """`oomkit predict s.py --gpu 1GiB -- --batch-size 512` runs out of memory; its remedy is
    the first halving that fits, its figure the one `predict -- --batch-size N` gives; the text
    says it under the verdict; --no-remedies measures nothing."""
    pytest.importorskip("torch")
    from oomkit.interfaces.cli import main

    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(SCRIPT))
    words = ["predict", str(script), "--gpu", "1GiB", "--steps", "2"]
    assert main([*words, "--json", "--", "--batch-size", "512"]) == 1
    out = json.loads(capsys.readouterr().out)
    (remedy,) = out["remedies"]
    size = int(remedy["flag"].split()[-1])
    assert size in (256, 128, 64, 32) and remedy["fits"] is True
    assert main([*words, "--json", "--", "--batch-size", str(size)]) == 0
    direct = json.loads(capsys.readouterr().out)
    assert remedy["peak_reserved_bytes"] == direct["required_bytes"]
    if size < 256:  # the halving before it did not fit
        assert main([*words, "--json", "--", "--batch-size", str(2 * size)]) == 1
        capsys.readouterr()
    assert main([*words, "--", "--batch-size", "512"]) == 1
    text = capsys.readouterr().out
    assert f"1. a smaller batch, {size} instead of 512 (-- --batch-size {size})" in text
    assert main([*words, "--json", "--no-remedies", "--", "--batch-size", "512"]) == 1
    assert "remedies" not in json.loads(capsys.readouterr().out)


def test_a_script_that_fails_at_a_smaller_batch_gets_no_remedy(tmp_path):
    """The script's own check refuses the smaller batch (a UserCodeError from its run): no
    remedy, and the prediction that did not fit stands."""
    from oomkit.errors import UserCodeError

    def refusing(smaller):
        raise UserCodeError("t.py: the script raised ValueError: batch must divide 8")

    scenario = _scenario(tmp_path, ["--batch-size", "12"])
    assert script_batch_remedy(scenario, _outcome(16 * GiB), refusing) is None


def test_explain_of_a_saved_script_prediction_measures_the_smaller_batch(tmp_path, capsys):
    """`oomkit explain p.json` of a script's prediction re-runs the script and measures its own
    batch argument halved, as predict does: the measured remedy comes first and the estimate
    of a smaller batch (scaled from the activations) is left out; --no-measure keeps the
    estimate and measures nothing."""
    pytest.importorskip("torch")
    from oomkit.interfaces.cli import main

    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(SCRIPT))
    words = ["predict", str(script), "--gpu", "1GiB", "--steps", "2", "--json"]
    assert main([*words, "--no-remedies", "--", "--batch-size", "512"]) == 1
    saved = tmp_path / "p.json"
    saved.write_text(capsys.readouterr().out)
    assert main([*words, "--", "--batch-size", "512"]) == 1
    (predicted,) = json.loads(capsys.readouterr().out)["remedies"]

    assert main(["explain", str(saved), "--json"]) == 0
    remedies = json.loads(capsys.readouterr().out)["remedies"]
    first = remedies[0]
    assert (first["title"], first["fits"], first["peak_reserved_bytes"]) == (
        predicted["title"], True, predicted["peak_reserved_bytes"]
    )
    assert not any("gradient-accumulation steps" in r["title"] for r in remedies)

    assert main(["explain", str(saved), "--json", "--no-measure"]) == 0
    remedies = json.loads(capsys.readouterr().out)["remedies"]
    assert not any(r["title"].startswith("a smaller batch,") for r in remedies)
    assert any("gradient-accumulation steps" in r["title"] for r in remedies)
