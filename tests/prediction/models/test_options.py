"""StepOptions validation: bad values say what is allowed."""

from __future__ import annotations

import pytest

from oomkit.prediction.models import StepOptions


def test_defaults():
    """Defaults are batch 8, fp32, adamw, train, 128 new tokens."""
    options = StepOptions()
    assert (options.batch_size, options.precision, options.optimizer, options.mode) == (
        8,
        "fp32",
        "adamw",
        "train",
    )
    assert options.new_tokens == 128


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp16"}, "precision must be one of fp32, fp16-mixed, bf16-mixed, bf16"),
        ({"optimizer": "lion"}, "optimizer must be one of adamw, adam, sgd"),
        ({"mode": "eval"}, "mode must be one of train, inference, generate"),
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"seq_len": -1}, "seq_len must be a positive integer or None"),
    ],
)
def test_bad_values_are_refused(kwargs, message):
    """Each invalid option raises ValueError naming the field and the allowed values."""
    with pytest.raises(ValueError, match=message):
        StepOptions(**kwargs)
