"""StepOptions validation: bad values say what is allowed."""

from __future__ import annotations

import pytest

from oomkit.prediction.models import StepOptions


def test_defaults():
    """Defaults are batch 8, the model's own precision (None), adamw, train, 128 new tokens."""
    options = StepOptions()
    assert (options.batch_size, options.precision, options.optimizer, options.mode) == (
        8,
        None,
        "adamw",
        "train",
    )
    assert options.new_tokens == 128


def test_a_preset_built_without_precision_is_fp32():
    """precision=None resolves to a preset's own fp32: in the description and the options."""
    from oomkit.prediction.models import build_preset_step

    built = build_preset_step("gpt2-124m", StepOptions(batch_size=1, seq_len=8))
    assert built.options is not None and built.options.precision == "fp32"
    assert built.precision_source is None
    assert built.description == "GPT-2 124M, batch 1, seq 8, fp32, adamw, train"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp8"}, "precision must be one of fp32, fp16-mixed, bf16-mixed, bf16, fp16"),
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
