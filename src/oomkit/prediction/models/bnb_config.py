"""transformers' ``BitsAndBytesConfig`` (``quantization_config``) as oomkit's quantize options.

A model loaded with ``quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)`` (or
whose saved ``config.json`` carries that ``quantization_config``) stores its linear layers as
bitsandbytes does; ``bnb_step_fields`` maps it to the ``StepOptions`` fields that emulate it
(``quantize``, ``double_quant``, ``compute_dtype``; see ``quantized.py``). Defaults are
``BitsAndBytesConfig.__init__``'s (transformers/utils/quantization_config.py):
``bnb_4bit_quant_type="fp4"``, ``bnb_4bit_use_double_quant=False``,
``bnb_4bit_compute_dtype=None`` -> ``torch.float32``, ``bnb_4bit_quant_storage=None`` ->
``torch.uint8``.

Pure logic, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomkit.errors import ConfigError

__all__ = ["bnb_step_fields"]

# BitsAndBytesConfig's compute dtype names (its to_dict() writes `str(dtype).split(".")[1]`).
_COMPUTE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# transformers' get_keys_to_not_convert leaves the output layer alone, as quantize_linears does.
_DEFAULT_SKIPPED: tuple[object, ...] = (None, [], ["lm_head"])


def _as_mapping(config: Any) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        data = to_dict()
        if isinstance(data, Mapping):
            return data
    raise ConfigError(
        f"a quantization config must be a transformers.BitsAndBytesConfig or a dict of its "
        f"keys; got a {type(config).__name__}"
    )


def _flag(data: Mapping[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"quantization_config {key} must be true or false; got {value!r}")
    return value


def _dtype_name(value: Any) -> str:
    """``"bfloat16"`` for ``torch.bfloat16`` or ``"bfloat16"``/``"torch.bfloat16"``."""
    return str(value).removeprefix("torch.")


def bnb_step_fields(config: Any) -> dict[str, Any]:
    """The ``StepOptions`` fields that store a model as ``config`` quantizes it.

    Args:
        config: a ``transformers.BitsAndBytesConfig``, or its dict (a ``config.json``'s
            ``quantization_config``).

    Returns:
        ``{"quantize": "nf4", "double_quant": True, "compute_dtype": "bf16"}`` for 4-bit;
        ``{"quantize": "int8"}`` for ``load_in_8bit``.

    Raises:
        ConfigError: another quantization method (GPTQ, AWQ, ...), neither ``load_in_4bit`` nor
            ``load_in_8bit``, ``load_in_8bit`` with a threshold or fp16 weights not modelled, or a
            setting that changes the storage in a way not modelled (``bnb_4bit_quant_storage``
            other than uint8, ``llm_int8_skip_modules`` beyond the output layer).
    """
    data = _as_mapping(config)
    method = data.get("quant_method", "bitsandbytes")
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method != "bitsandbytes":
        raise ConfigError(
            f"quantization_config quant_method {method!r} is not modelled; oomkit emulates "
            "bitsandbytes (load_in_4bit nf4/fp4). Remove quantization_config to predict the "
            "unquantized model"
        )
    skipped = data.get("llm_int8_skip_modules")
    if skipped not in _DEFAULT_SKIPPED:
        raise ConfigError(
            f"quantization_config llm_int8_skip_modules={skipped!r} is not modelled: oomkit "
            "quantizes every Linear but the output layer (lm_head), as transformers does by "
            "default"
        )
    four, eight = _flag(data, "load_in_4bit"), _flag(data, "load_in_8bit")
    if four and eight:
        raise ConfigError("quantization_config sets both load_in_4bit and load_in_8bit; choose one")
    if eight:
        # oomkit.prediction.models.int8 emulates Linear8bitLt as BitsAndBytesConfig's defaults
        # build it: llm_int8_threshold 6.0, llm_int8_has_fp16_weight False.
        threshold = data.get("llm_int8_threshold", 6.0)
        if threshold != 6.0 or _flag(data, "llm_int8_has_fp16_weight"):
            raise ConfigError(
                f"quantization_config load_in_8bit with llm_int8_threshold={threshold!r} and "
                f"llm_int8_has_fp16_weight={data.get('llm_int8_has_fp16_weight')!r} is not "
                "modelled: oomkit emulates Linear8bitLt with threshold 6.0 and int8 weights "
                "(the defaults); drop those keys"
            )
        return {"quantize": "int8"}
    if not four:
        raise ConfigError(
            "quantization_config sets neither load_in_4bit nor load_in_8bit; set one, or remove "
            "quantization_config"
        )
    quant_type = data.get("bnb_4bit_quant_type", "fp4")
    if quant_type not in ("nf4", "fp4"):
        raise ConfigError(
            f"quantization_config bnb_4bit_quant_type must be nf4 or fp4; got {quant_type!r}"
        )
    storage = data.get("bnb_4bit_quant_storage")
    if storage is not None and _dtype_name(storage) != "uint8":
        raise ConfigError(
            f"quantization_config bnb_4bit_quant_storage {_dtype_name(storage)} is not modelled "
            "(oomkit packs 4-bit weights in uint8, the default); drop it"
        )
    compute = data.get("bnb_4bit_compute_dtype")
    compute_name = "float32" if compute is None else _dtype_name(compute)
    if compute_name not in _COMPUTE_DTYPES:
        raise ConfigError(
            f"quantization_config bnb_4bit_compute_dtype must be one of "
            f"{', '.join(_COMPUTE_DTYPES)}; got {compute!r}"
        )
    return {
        "quantize": quant_type,
        "double_quant": _flag(data, "bnb_4bit_use_double_quant"),
        "compute_dtype": _COMPUTE_DTYPES[compute_name],
    }
