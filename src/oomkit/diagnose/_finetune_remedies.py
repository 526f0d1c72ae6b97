"""Fine-tuning remedies (LoRA, QLoRA, 8-bit AdamW) as StepOptions changes to re-predict.

Each is measured, never estimated: ``_model_remedies.measured_model_remedies`` rebuilds the
saved step with the change and predicts it again. Which apply (``finetune_changes``):

- LoRA (peft ``LoraConfig`` at its defaults: r 8, alpha 8, the architecture's default targets)
  where the run trains the whole model (no ``lora``), on base weights in bf16 (fp16 on a GPU
  without bf16) where the run kept fp32 weights (``fp32``, ``bf16-mixed``, ``fp16-mixed``), as
  peft users load a base (``from_pretrained(torch_dtype=torch.bfloat16)``) and as ``oomkit
  predict --lora`` defaults (``scenario/options.py``);
- QLoRA (nf4 base weights, as bitsandbytes ``Linear4bit`` stores them) where the base weights
  are not 4-bit yet: with the run's own adapters, or with LoRA added to a full fine-tune (4-bit
  weights cannot be trained themselves), the rest of the base in bf16 as for LoRA;
- 8-bit AdamW (bitsandbytes ``AdamW8bit``: uint8 states plus a per-block absmax) where the run
  uses torch's Adam or AdamW.

A change the model cannot take (peft has no default targets for it, it has no ``nn.Linear`` to
quantize) raises ``OomkitError`` when rebuilt and is then left out.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FinetuneChange", "finetune_changes"]

# (title, StepOptions fields to replace, code)
FinetuneChange = tuple[str, dict[str, Any], str]

# StepOptions precisions whose weights are fp32 (the autocast ones keep fp32 weights).
_FP32_WEIGHTS = ("fp32", "bf16-mixed", "fp16-mixed")
_LORA_CODE = (
    "from peft import LoraConfig, get_peft_model\n"
    "# base weights frozen: no gradients, no optimizer state; r=8 adapters on peft's default\n"
    "# target modules (q_proj, v_proj for Llama; c_attn for GPT-2)\n"
    "model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8))\n"
    "optimizer = torch.optim.AdamW(\n"
    "    (p for p in model.parameters() if p.requires_grad), lr=2e-4\n"
    ")"
)

_EIGHT_BIT_CODE = (
    "import bitsandbytes as bnb\n"
    "optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-4)\n"
    '# Hugging Face Trainer: TrainingArguments(..., optim="adamw_bnb_8bit")'
)
_TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}


def _lora_code(precision: str | None) -> str:
    """peft's LoRA, the base loaded in ``precision``'s dtype where it is bf16 or fp16."""
    dtype = _TORCH_DTYPES.get(precision or "")
    if dtype is None:
        return _LORA_CODE
    load = f"model = AutoModelForCausalLM.from_pretrained(name, torch_dtype={dtype})\n"
    return load + _LORA_CODE


def _qlora_code(precision: str | None, add_lora: bool) -> str:
    # The re-prediction computes in the model's parameter dtype (StepOptions.compute_dtype None).
    compute = _TORCH_DTYPES.get(precision or "", "torch.float32")
    lines = [
        "from transformers import AutoModelForCausalLM, BitsAndBytesConfig",
        "bnb = BitsAndBytesConfig(",
        '    load_in_4bit=True, bnb_4bit_quant_type="nf4",',
        f"    bnb_4bit_compute_dtype={compute},",
        ")",
        "model = AutoModelForCausalLM.from_pretrained(",
        f"    name, quantization_config=bnb, torch_dtype={compute}",
        ")",
    ]
    if add_lora:
        lines += [
            "from peft import LoraConfig, get_peft_model",
            "model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8))",
        ]
    return "\n".join(lines)


def finetune_changes(base: Any, low_precision: str = "bf16") -> list[FinetuneChange]:
    """The fine-tuning changes that apply to a training step's ``StepOptions`` ``base``.

    Args:
        base: the step's ``StepOptions``.
        low_precision: the base weights' precision where the step kept fp32 weights: ``bf16``,
            or ``fp16`` on a GPU without bf16 (compute capability below 8.0).
    """
    from oomkit.prediction.models.lora_options import LoraOptions

    if base.mode != "train":
        return []
    # A Trainer's own loop keeps the weights its arguments give (trainer_mixed_precision).
    lowered: dict[str, Any] = (
        {"precision": low_precision}
        if base.precision in _FP32_WEIGHTS and base.trainer_mixed_precision is None
        else {}
    )
    precision = lowered.get("precision", base.precision)
    out: list[FinetuneChange] = []
    if base.lora is None:
        out.append(
            (
                "LoRA adapters (peft, r8) instead of full fine-tuning",
                {"lora": LoraOptions()} | lowered,
                _lora_code(precision),
            )
        )
    if base.quantize not in ("nf4", "fp4"):
        add_lora = base.lora is None
        change: dict[str, Any] = {"quantize": "nf4", "double_quant": False, "compute_dtype": None}
        if add_lora:
            change["lora"] = LoraOptions()
        was = " instead of int8" if base.quantize == "int8" else ""
        title = (
            "QLoRA: 4-bit nf4 base weights + LoRA adapters (peft, r8)"
            if add_lora
            else f"QLoRA: 4-bit nf4 base weights{was} under the LoRA adapters"
        )
        out.append((title, change | lowered, _qlora_code(precision, add_lora)))
    if base.optimizer in ("adamw", "adam"):
        out.append(
            (
                "8-bit AdamW (bitsandbytes AdamW8bit)",
                # fused / for-loop are torch's own implementations: AdamW8bit has its kernel.
                {"optimizer": "adamw8bit", "optimizer_impl": "foreach"},
                _EIGHT_BIT_CODE,
            )
        )
    return out
