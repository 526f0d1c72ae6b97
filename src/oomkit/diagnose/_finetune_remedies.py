"""Fine-tuning remedies (LoRA, QLoRA, 8-bit AdamW) as StepOptions changes to re-predict.

Each is measured, never estimated: ``_model_remedies.measured_model_remedies`` rebuilds the
saved step with the change and predicts it again. Which apply (``finetune_changes``):

- LoRA (peft ``LoraConfig`` at its defaults: r 8, alpha 8, the architecture's default targets)
  where the run trains the whole model (no ``lora``);
- QLoRA (nf4 base weights, as bitsandbytes ``Linear4bit`` stores them) where the base weights
  are not 4-bit yet: with the run's own adapters, or with LoRA added to a full fine-tune (4-bit
  weights cannot be trained themselves);
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


def _qlora_code(precision: str | None, add_lora: bool) -> str:
    # The re-prediction computes in the model's parameter dtype (StepOptions.compute_dtype None).
    compute = _TORCH_DTYPES.get(precision or "", "torch.float32")
    lines = [
        "from transformers import AutoModelForCausalLM, BitsAndBytesConfig",
        "bnb = BitsAndBytesConfig(",
        '    load_in_4bit=True, bnb_4bit_quant_type="nf4",',
        f"    bnb_4bit_compute_dtype={compute},",
        ")",
        "model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb)",
    ]
    if add_lora:
        lines += [
            "from peft import LoraConfig, get_peft_model",
            "model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8))",
        ]
    return "\n".join(lines)


def finetune_changes(base: Any) -> list[FinetuneChange]:
    """The fine-tuning changes that apply to a training step's ``StepOptions`` ``base``."""
    from oomkit.prediction.models.lora_options import LoraOptions

    if base.mode != "train":
        return []
    out: list[FinetuneChange] = []
    if base.lora is None:
        out.append(
            (
                "LoRA adapters (peft, r8) instead of full fine-tuning",
                {"lora": LoraOptions()},
                _LORA_CODE,
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
        out.append((title, change, _qlora_code(base.precision, add_lora)))
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
