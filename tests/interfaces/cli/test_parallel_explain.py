"""A saved `predict --dp/--fsdp --json` keeps its layout and DDP's bucket options, and explain
re-predicts rank 0 of that same run (not one GPU)."""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType

import pytest

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def gpt2_tiny(monkeypatch):
    """A one-layer GPT-2 (width 256, vocabulary 8192, 512 positions) as preset gpt2-tiny: what is
    saved and re-predicted (the layout, DDP's bucket options) does not depend on the depth."""
    from oomkit.prediction.models import presets
    from oomkit.prediction.models.gpt2 import GPT2Shape

    base = presets.get_preset("gpt2-124m")
    shape = GPT2Shape(hidden=256, layers=1, heads=4, vocab=8192, positions=512)
    preset = dataclasses.replace(base, name="gpt2-tiny", title="GPT-2 tiny", shape=shape)
    monkeypatch.setattr(presets, "PRESETS", MappingProxyType({**presets.PRESETS, "gpt2-tiny": preset}))


def _saved(argv, capsys):
    code = main(["predict", "gpt2-tiny", *argv, "--batch", "1", "--seq", "16", "--steps", "2",
                 "--json"])
    assert code == 0
    return json.loads(capsys.readouterr().out)


def _repredicted(data):
    from oomkit.diagnose._model_remedies import _repredict
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.workload import workload_from_json

    workload = workload_from_json(data)
    known = {name: value for name, value in workload.options.items() if value is not None}
    return workload, _repredict(data, workload, StepOptions(**known))


def test_ddp_bucket_options_are_saved_and_re_predicted(capsys):
    """--dp 2 --bucket-cap-mb 5 --gradient-as-bucket-view: the workload record keeps both, and
    re-predicting it gives the saved bytes exactly (the buckets counted as gradients)."""
    data = _saved(["--dp", "2", "--bucket-cap-mb", "5", "--gradient-as-bucket-view"], capsys)
    assert data["workload"]["ddp"] == {"bucket_cap_mb": 5.0, "gradient_as_bucket_view": True}
    assert data["workload"]["name"] == "gpt2-tiny"
    workload, again = _repredicted(data)
    assert (workload.ddp_bucket_cap_mb, workload.ddp_gradient_as_bucket_view) == (5.0, True)
    assert again.required_bytes == data["required_bytes"]
    assert again.peak_allocated_bytes == data["peak_allocated_bytes"]
    assert "ddp_bucket" not in again.by_category_bytes  # views: gradients, as saved
    assert again.target.parallel.dp == 2


def test_fsdp_run_is_re_predicted_as_rank_0_of_its_layout(capsys):
    """A saved --fsdp 2 prediction re-predicts to its own bytes (before: as one GPU, holding
    every parameter); no DDP record is saved for it."""
    data = _saved(["--fsdp", "2"], capsys)
    assert "ddp" not in data["workload"]
    _, again = _repredicted(data)
    assert again.required_bytes == data["required_bytes"]
    assert again.by_category_bytes["parameter"] == data["by_category_bytes"]["parameter"]


def test_a_bad_saved_layout_is_refused():
    """A saved target.parallel that is not a layout is an error, not one GPU."""
    from oomkit.diagnose._model_remedies import saved_parallel
    from oomkit.errors import ConfigError

    assert saved_parallel({"target": {"parallel": None}}) is None
    with pytest.raises(ConfigError, match="at least 1"):
        saved_parallel({"target": {"parallel": {"fsdp": 0}}})
    with pytest.raises(ConfigError, match="not a layout"):
        saved_parallel({"target": {"parallel": {"ep": 2}}})
