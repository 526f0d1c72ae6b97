"""LoRA adapters through peft: what to inject (LoraOptions) and injecting them on the meta device.

peft's LoRA layers are plain modules: ``peft.get_peft_model`` replaces each targeted
``nn.Linear`` (or transformers ``Conv1D``) by a ``lora.Linear`` that keeps the base layer, adds
``lora_A`` (in -> r) and ``lora_B`` (r -> out) and, when ``lora_dropout > 0``, an ``nn.Dropout``
on the adapter's input; it freezes every other parameter (``requires_grad=False``). Built on meta
and recorded as usual, the frozen base weights get no gradient and no optimizer state, and the
forward records what the adapters add (the dropout output and mask, ``lora_A``'s output saved
for backward, the sum with the base output).

peft is optional (``pip install oomkit[lora]``), imported when LoRA is asked for.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from oomkit._logs import TORCHAO_IMPORT_LOGGERS, quiet_loggers
from oomkit.errors import OomkitError, TorchRequiredError
from oomkit.prediction.models.bert import Bert
from oomkit.prediction.models.gpt2 import GPT2
from oomkit.prediction.models.int8 import Linear8bitLtStorage, lora_8bit_layer_class
from oomkit.prediction.models.llama import Llama
from oomkit.prediction.models.lora_options import LoraOptions
from oomkit.prediction.models.optimizers import paged_state_bytes
from oomkit.prediction.models.options import StepOptions
from oomkit.prediction.models.quantized import Linear4bitStorage, lora_layer_class, quantize_linears
from oomkit.units import format_bytes

__all__ = ["apply_lora", "prepare_finetune"]

# The presets whose module names match their Hugging Face counterpart's, so that peft's default
# targets for that model type (peft/utils/constants.py
# TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING) apply: gpt2 -> c_attn, llama -> q_proj,
# v_proj, bert -> query, value. ViT and ResNet presets need explicit targets.
_PRESET_MODEL_TYPES: dict[type, str] = {GPT2: "gpt2", Llama: "llama", Bert: "bert"}


def _peft() -> Any:
    try:
        # peft imports torchao where it is installed: its import-time log lines are not ours.
        with quiet_loggers(*TORCHAO_IMPORT_LOGGERS):
            import peft
    except ImportError as exc:
        raise TorchRequiredError(
            "LoRA is built with peft; install it with `pip install oomkit[lora]` (or `pip "
            "install peft`), or drop --lora / StepOptions(lora=...)"
        ) from exc
    return peft


def _model_type(model: torch.nn.Module) -> str | None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str):
        return model_type
    return _PRESET_MODEL_TYPES.get(type(model))


def apply_lora(model: torch.nn.Module, lora: LoraOptions) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` in place with ``peft.get_peft_model``.

    The adapters are created on the base layers' device (meta) and, as peft does by default
    (``autocast_adapter_dtype=True``), in fp32 even when the base is bf16 or fp16. Calling
    ``model`` afterwards runs the adapters: peft replaced its layers, and ``PeftModel.forward``
    only forwards to it.

    Args:
        model: the built model (a preset or a transformers model), in its final dtype.
        lora: what to inject.

    Returns:
        The ``PeftModel`` that wraps ``model``.

    Raises:
        TorchRequiredError: peft is not installed.
        OomkitError: no targets given for a model peft has no defaults for, or targets that
            match no module.
    """
    peft = _peft()
    targets: list[str] | None = list(lora.targets) if lora.targets else None
    model_type = _model_type(model)
    if targets is None:
        mapping = peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
        if model_type not in mapping:
            raise OomkitError(
                f"peft has no default LoRA targets for {type(model).__name__}; name the layers "
                "to adapt, e.g. StepOptions(lora=LoraOptions(targets=('q_proj', 'v_proj'))) "
                "(CLI: --lora-targets q_proj,v_proj)"
            )
        targets = list(mapping[model_type])
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        target_modules=targets,
        lora_dropout=float(lora.dropout),
        modules_to_save=list(lora.modules_to_save) or None,
        use_dora=lora.dora,
    )
    # peft/tuners/lora/model.py: custom modules are dispatched first; peft/tuners/lora/bnb.py
    # has one LoRA layer per bitsandbytes layer.
    custom: dict[type, Any] = {}
    if any(isinstance(m, Linear4bitStorage) for m in model.modules()):
        custom[Linear4bitStorage] = lora_layer_class()
    if any(isinstance(m, Linear8bitLtStorage) for m in model.modules()):
        custom[Linear8bitLtStorage] = lora_8bit_layer_class()
    if custom:
        config._register_custom_module(custom)
    try:
        with warnings.catch_warnings():
            # peft/tuners/lora/model.py _create_new_module: a transformers Conv1D (GPT-2) is
            # adapted with fan_in_fan_out=True, which it sets itself after warning.
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
            # peft asks transformers 5 for the deprecated is_gradient_checkpointing.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            # The adapters are made on meta (peft makes each nn.Linear on the default device,
            # initialises it, then moves it to the base layer's): no host memory or time for
            # weights that the recording never reads (a 1e9-wide layer's lora_A was 32 GB).
            with torch.device("meta"):
                peft_model: torch.nn.Module = peft.get_peft_model(model, config)
    except ValueError as exc:
        raise OomkitError(
            f"peft could not add LoRA adapters to {type(model).__name__}: "
            f"{str(exc).splitlines()[0]}. Name layers the model has, e.g. "
            "StepOptions(lora=LoraOptions(targets=('q_proj', 'v_proj'))) (CLI: --lora-targets)"
        ) from exc
    return peft_model


_COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def prepare_finetune(model: torch.nn.Module, options: StepOptions, title: str) -> str:
    """Quantize (``options.quantize``), then add LoRA (``options.lora``), in place.

    Returns:
        ``title`` with what was done, e.g. ``"Llama 3.1 8B + nf4 + LoRA r16"``; with
        ``paged-adamw8bit`` also how many bytes of its states will live in unified memory,
        which the prediction does not count on the device.
    """
    if options.quantize is not None:
        dtype = next(model.parameters()).dtype
        compute = _COMPUTE_DTYPES[options.compute_dtype] if options.compute_dtype else dtype
        quantize_linears(
            model,
            quant_type=options.quantize,
            double_quant=options.double_quant,
            compute_dtype=compute,
        )
        title = f"{title} + {options.quantize}{' double-quant' if options.double_quant else ''}"
    if options.lora is not None:  # peft replaces the targeted layers in place
        apply_lora(model, options.lora)
        title = f"{title} + {options.lora.describe()}"
    if options.optimizer == "paged-adamw8bit" and options.mode == "train":
        paged = paged_state_bytes(p for p in model.parameters() if p.requires_grad)
        title = f"{title} ({format_bytes(paged)} of paged optimizer states off the device)"
    return title
