"""diagnose_prediction: a saved `oomkit predict --json` diagnosed like an OOM, with a batch remedy."""

from __future__ import annotations

import copy

import pytest
from cases.prediction import PREDICTION

from oomkit.diagnose.prediction_diagnosis import diagnose_prediction, is_prediction
from oomkit.errors import PredictionFormatError

GiB = 2**30


def test_shortage_of_the_whole_step_comes_first():
    """The step needs 11.40 GiB against 3.61 GiB usable: shortage, 7.79 GiB short, first."""
    d = diagnose_prediction(PREDICTION)
    assert d.source == "prediction"
    assert d.cause == "shortage"
    assert dict(d.causes[0].evidence_bytes) == {
        "required_bytes": 12238979072,
        "usable_bytes": 3875536896,
        "shortfall_bytes": 12238979072 - 3875536896,
    }
    # The OOM point's 58.40 MiB cache (1.6% of reserved) is ordinary overhead, not a cause.
    assert [f.cause for f in d.causes] == ["shortage"]


def test_batch_remedy_uses_the_batch_size():
    """Batch 8: state = parameters x 4 (grad, 2 Adam states): batch 1 with 8 accumulation steps."""
    d = diagnose_prediction(PREDICTION)
    top = d.remedies[0]
    steady = 498558976 * 4
    activation = 12238979072 - steady
    new_batch = (3875536896 - steady) * 8 // activation
    assert new_batch == 1
    assert top.title == "batch size 1 with 8 gradient-accumulation steps"
    assert top.saving_bytes == activation - activation * 1 // 8
    assert "DataLoader(dataset, batch_size=1" in top.code
    assert top.estimate is True


def test_attribution_by_category_and_module():
    """Attribution carries the prediction's categories and modules at the OOM."""
    at = diagnose_prediction(PREDICTION).attribution
    assert at.moment == "oom" and at.event_index == 386
    assert at.by_category_bytes["activation"] == 3225436160
    assert at.top_sites[0].label == "module h.0.attn.c_attn"


def test_a_prediction_that_fits_is_refused():
    """A prediction without an OOM has nothing to explain: PredictionFormatError says so."""
    fits = copy.deepcopy(PREDICTION) | {"oom": None, "headroom_bytes": GiB}
    with pytest.raises(PredictionFormatError, match="fits with 1.00 GiB headroom"):
        diagnose_prediction(fits)


def test_other_json_is_not_a_prediction():
    """JSON without the prediction's keys is refused with how to make one."""
    assert not is_prediction({"cause": "shortage"})
    with pytest.raises(PredictionFormatError, match="oomkit predict"):
        diagnose_prediction({"cause": "shortage"})


def test_a_broken_message_is_refused():
    """A prediction whose oom.message is not an OOM message gets a clear error."""
    broken = copy.deepcopy(PREDICTION)
    broken["oom"]["message"] = "hello"
    with pytest.raises(PredictionFormatError, match="not an OOM message"):
        diagnose_prediction(broken)


def test_the_saved_workload_record_is_read_not_the_description():
    """Batch, mode and optimizer come from `workload`, whatever the description says."""
    saved = copy.deepcopy(PREDICTION) | {
        "description": "my step",
        "workload": {
            "kind": "function",
            "name": "train.py:build",
            "options": {"batch_size": 8, "mode": "train", "optimizer": "adamw"},
            "steps": 3,
        },
    }
    assert diagnose_prediction(saved).remedies[0] == diagnose_prediction(PREDICTION).remedies[0]
    assert diagnose_prediction(saved).remedies[0].title == (
        "batch size 1 with 8 gradient-accumulation steps"
    )


def test_a_function_of_unknown_mode_is_priced_from_its_memory():
    """A file.py:function record (no mode, no optimizer): batch from the record, no Adam state
    assumed before backward (the step's own optimizer is unknown), no re-prediction."""
    saved = copy.deepcopy(PREDICTION) | {
        "description": "train.py:build(batch_size=8)",
        "workload": {"kind": "function", "name": "train.py:build", "options": {"batch_size": 8}},
    }
    d = diagnose_prediction(saved)
    top = d.remedies[0]
    # Parameters only (no gradient or optimizer state recorded yet, mode unknown): not training.
    steady = 498558976
    activation = 12238979072 - steady
    new_batch = (3875536896 - steady) * 8 // activation
    assert new_batch == 2
    assert top.title == f"batch size {new_batch} with 4 gradient-accumulation steps"
    assert not any("before gradients" in w for w in d.warnings)


def test_an_old_save_without_workload_falls_back_to_the_description():
    """Documented fallback: PREDICTION (saved before the record) is read from its description."""
    assert "workload" not in PREDICTION
    assert any("before gradients" in w for w in diagnose_prediction(PREDICTION).warnings)
