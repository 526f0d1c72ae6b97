"""Exact bytes of a preset's model state by arithmetic from its config: no model is built."""

from __future__ import annotations

from oomkit.errors import OomkitError
from oomkit.prediction.models.options import StepOptions
from oomkit.prediction.models.presets import shaped_preset

__all__ = ["expected_state_bytes"]

# Adam/AdamW keep exp_avg and exp_avg_sq, SGD with momentum one momentum_buffer, each shaped and
# typed like its parameter (torch/optim/adam.py and sgd.py, _init_group: zeros_like / clone).
# Adam's per-parameter `step` is a CPU tensor unless capturable or fused (adam.py _init_group),
# so it takes no GPU memory.
_STATES_PER_PARAMETER = {"adamw": 2, "adam": 2, "sgd": 1}


def expected_state_bytes(name: str, options: StepOptions) -> dict[str, int]:
    """Parameter, buffer, gradient and optimizer-state bytes of a preset step, on the device.

    Parameters (and floating-point buffers) are fp32 except in pure ``bf16`` or ``fp16``, where
    the whole model is cast; mixed precision keeps fp32 master weights. Gradients have their
    parameter's dtype; optimizer states too.

    Args:
        name: a preset name, e.g. ``"gpt2-124m"``.
        options: precision, optimizer and mode matter; ViT's ``image_size`` sets its position
            embedding.

    Returns:
        ``parameter`` (tied weights once), ``buffer`` (BatchNorm running statistics, RoPE
        ``inv_freq``, BERT's position and token-type ids), ``gradient`` (one step's gradients,
        alive from backward to ``zero_grad``; 0 unless ``mode="train"``) and ``optimizer_state``
        (created in the first step and kept; 0 unless ``mode="train"``).

    Raises:
        UnknownPresetError: ``name`` is not a preset.
        OomkitError: LoRA, quantized weights or an optimizer other than adamw/adam/sgd, whose
            bytes this arithmetic does not cover.
    """
    if (
        options.lora is not None
        or options.quantize is not None
        or options.optimizer not in _STATES_PER_PARAMETER
    ):
        raise OomkitError(
            "expected_state_bytes covers full training with adamw, adam or sgd; for LoRA, 4-bit "
            "weights or the adamw8bit/paged-adamw8bit/adafactor states, trace the step and read "
            "recording.allocated_bytes('optimizer_state') (tests/prediction/models/"
            "test_optimizers.py counts them by hand)"
        )
    preset = shaped_preset(name, options)
    itemsize = 2 if options.precision in ("bf16", "fp16") else 4
    parameter_bytes = preset.parameter_count() * itemsize
    float_buffers, int64_buffers = preset.buffer_count()
    train = options.mode == "train"
    return {
        "parameter": parameter_bytes,
        "buffer": float_buffers * itemsize + int64_buffers * 8,
        "gradient": parameter_bytes if train else 0,
        "optimizer_state": (
            _STATES_PER_PARAMETER[options.optimizer] * parameter_bytes if train else 0
        ),
    }
