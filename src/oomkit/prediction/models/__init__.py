"""Built-in model workloads for prediction: presets written in plain torch, and HF models.

``build_preset_step("gpt2-124m", StepOptions(batch_size=8, precision="bf16-mixed"))`` builds the
model on the meta device (no weights, no downloads) and returns a step function to trace with
``oomkit.prediction.tracing.trace_step(built.step_fn, *built.track, steps=3)``. ``expected_state_bytes``
gives the exact parameter, gradient and optimizer-state bytes of a preset by arithmetic.

Needs torch; the rest of oomkit imports this package lazily.
"""

from __future__ import annotations

from oomkit.errors import UnknownPresetError
from oomkit.prediction.models.bnb_config import bnb_step_fields
from oomkit.prediction.models.hf import build_hf_step, config_precision, load_hf_config
from oomkit.prediction.models.options import BuiltStep, StepOptions
from oomkit.prediction.models.presets import PRESETS, ModelPreset, build_preset_step, get_preset
from oomkit.prediction.models.state_bytes import expected_state_bytes
from oomkit.prediction.models.trainer_args import read_trainer_args, trainer_step_options

__all__ = [
    "BuiltStep",
    "ModelPreset",
    "PRESETS",
    "StepOptions",
    "UnknownPresetError",
    "bnb_step_fields",
    "build_hf_step",
    "build_preset_step",
    "config_precision",
    "expected_state_bytes",
    "get_preset",
    "load_hf_config",
    "read_trainer_args",
    "trainer_step_options",
]
