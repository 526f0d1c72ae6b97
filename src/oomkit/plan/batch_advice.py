"""What to try when not even the smallest batch fits: computed from the step, not a fixed list.

A suggestion the step already follows is never made (``--precision bf16-mixed`` for a step
already in bf16-mixed, checkpointing when it is on), and the command to find a larger GPU is
the user's own ``oomkit fit`` with ``--smallest-gpu``, not a placeholder.
"""

from __future__ import annotations

from oomkit.core.gpus import GpuSpec
from oomkit.errors import NoFeasibleBatchSizeError
from oomkit.plan.batch_probe import BatchProbe
from oomkit.prediction.workload import workload_from_description
from oomkit.units import format_bytes

__all__ = ["advice_in_code", "infeasible_advice", "infeasible_error"]

# StepOptions.precision values as a description names them (models/steps.py _describe).
_PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16", "fp16")


def _has_bf16(compute_capability: tuple[int, int] | None) -> bool:
    """Native bf16: compute capability 8.0 and up (torch/cuda/__init__.py is_bf16_supported);
    an unknown device is taken to have it."""
    return compute_capability is None or tuple(compute_capability) >= (8, 0)


# What to try when not even the smallest batch fits, by what the step already does (read from
# its description, "GPT-2 124M, batch 1, seq 1024, bf16-mixed, adamw, train": the workload
# record of oomkit.prediction.workload). Each names the oomkit option that applies it.
def infeasible_advice(description: str, compute_capability: tuple[int, int] | None) -> list[str]:
    """The changes that apply to a step that does not fit at its smallest batch.

    Only changes the step does not make already: mixed precision only for an fp32 step (fp16
    where the GPU has no native bf16, compute capability below 8.0: torch/cuda/__init__.py
    is_bf16_supported), pure bf16 where the weights are not bf16/fp16 yet, checkpointing when
    off, a lighter optimizer for Adam/AdamW, LoRA for a full fine-tune.
    """
    items = [item.split(" (")[0].strip() for item in description.lower().split(", ")]
    workload = workload_from_description(description) if description else None
    precision = next((p for p in _PRECISIONS if p in items), None)
    checkpointing = any(item.endswith("checkpointing") for item in items)
    bf16 = _has_bf16(compute_capability)
    out = []
    if precision in (None, "fp32"):
        out.append("mixed precision (--precision " + ("bf16-mixed)" if bf16 else "fp16-mixed)"))
    if precision not in ("bf16", "fp16") and bf16:
        out.append("bf16 weights, gradients and optimizer states (--precision bf16)")
    training = not any(item in ("inference", "generate") for item in items)
    if training and not checkpointing:
        out.append("activation checkpointing (--checkpointing full)")
    if training and (workload is None or workload.optimizer in (None, "adamw", "adam")):
        out.append("8-bit AdamW states (--optimizer adamw8bit)")
        out.append("SGD with momentum, one state instead of two (--optimizer sgd)")
    if training and "lora" not in description.lower():
        out.append("LoRA adapters instead of full fine-tuning (--lora 8)")
    out.append("a shorter sequence or smaller images")
    return out


def infeasible_error(probe: BatchProbe, spec: GpuSpec, margin: int) -> NoFeasibleBatchSizeError:
    """Why not even the smallest batch fits, and what to try, computed from the step."""
    advice = infeasible_advice(probe.train.description, spec.compute_capability)
    reason = (
        f"not even batch {probe.batch_size} fits on {spec.name}: {probe.limiting_step} needs "
        f"{format_bytes(probe.peak_reserved_bytes)} reserved, and of the "
        f"{format_bytes(probe.usable_bytes)} usable a margin of {format_bytes(margin)} must "
        "stay free."
    )
    return _error(reason, advice, probe.batch_size, probe.usable_bytes, margin,
                  probe.peak_reserved_bytes)


def advice_in_code(
    exc: NoFeasibleBatchSizeError, compute_capability: tuple[int, int] | None
) -> NoFeasibleBatchSizeError:
    """``exc`` for code run as written (a script, a ``file.py:function``): the preset options
    (``--precision``, ``--checkpointing``, ``--optimizer``, ``--lora``) are refused there, so
    the changes are said as code, each the PyTorch call that makes it."""
    dtype = "bfloat16" if _has_bf16(compute_capability) else "float16"
    advice = [
        f'mixed precision where your code has none (torch.autocast("cuda", dtype=torch.{dtype}) '
        "around the forward and loss)",
        "activation checkpointing (torch.utils.checkpoint.checkpoint around each block)",
        "an optimizer with less state (SGD, or bitsandbytes' AdamW8bit)",
        "LoRA adapters instead of full fine-tuning (peft)",
        "a shorter sequence or smaller images",
    ]
    if exc.batch_size is None or exc.usable_bytes is None or exc.margin_bytes is None:
        return exc
    return _error(exc.reason, advice, exc.batch_size, exc.usable_bytes, exc.margin_bytes,
                  exc.needed_reserved_bytes)


def _error(reason: str, advice: list[str], batch_size: int, usable_bytes: int, margin: int,
           needed_reserved_bytes: int | None) -> NoFeasibleBatchSizeError:
    return NoFeasibleBatchSizeError(
        f"{reason} Try {', '.join(advice)}, a smaller margin (--margin), or a GPU with more "
        f"memory (this same `oomkit fit` command with --batch {batch_size} "
        "--smallest-gpu names the smallest).",
        needed_reserved_bytes=needed_reserved_bytes,
        usable_bytes=usable_bytes,
        margin_bytes=margin,
        reason=reason,
        advice=tuple(advice),
        batch_size=batch_size,
    )
