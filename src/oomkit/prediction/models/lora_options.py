"""What LoRA adapters a step adds (LoraOptions, a ``peft.LoraConfig`` as data); torch-free."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from oomkit.errors import ConfigError

__all__ = ["LoraOptions", "lora_options_from"]


@dataclass(frozen=True)
class LoraOptions:
    """A ``peft.LoraConfig``: which layers get adapters, and how large.

    Attributes:
        r: the adapters' rank (``LoraConfig.r``).
        alpha: ``lora_alpha`` (scales the adapter's output; no memory of its own). peft's
            default is 8.
        targets: module names (or name suffixes) to adapt (``target_modules``); ``None``: peft's
            defaults for the architecture (``q_proj``, ``v_proj`` for Llama; ``c_attn`` for
            GPT-2; ``query``, ``value`` for BERT).
        dropout: ``lora_dropout``; above 0 each adapter drops its input (an output and a 1-byte
            mask per element, both kept for backward).
        modules_to_save: modules trained in full besides the adapters (``modules_to_save``,
            e.g. ``("lm_head",)``): peft keeps a trainable copy beside the frozen original.
        dora: weight-decomposed LoRA (``use_dora``): a magnitude vector per adapted layer and
            the weight norm computed in each forward.
    """

    r: int = 8
    alpha: int = 8
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0
    modules_to_save: tuple[str, ...] = ()
    dora: bool = False

    def __post_init__(self) -> None:
        for name in ("r", "alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"LoraOptions.{name} must be a positive integer; got {value!r}. "
                    f"Example: LoraOptions({name}=16)"
                )
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not (
            0.0 <= dropout < 1.0
        ):
            raise ConfigError(
                f"LoraOptions.dropout must be a probability in [0, 1); got {dropout!r}. "
                "Example: LoraOptions(dropout=0.05)"
            )
        if self.targets is not None:
            object.__setattr__(self, "targets", _names("targets", self.targets))
        object.__setattr__(self, "modules_to_save", _names("modules_to_save", self.modules_to_save))

    def describe(self) -> str:
        """A short label, e.g. ``"LoRA r8 (q_proj, v_proj)"``."""
        kind = "DoRA" if self.dora else "LoRA"
        targets = f" ({', '.join(self.targets)})" if self.targets else ""
        return f"{kind} r{self.r}{targets}"


def _names(field_name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split(",")
    names = tuple(str(name).strip() for name in value)
    if not isinstance(value, list | tuple) or not all(names) or (field_name == "targets" and not names):
        raise ConfigError(
            f"LoraOptions.{field_name} must be module names; got {value!r}. "
            f"Example: LoraOptions({field_name}=('q_proj', 'v_proj'))"
        )
    return names


def lora_options_from(value: LoraOptions | Mapping[str, Any] | None) -> LoraOptions | None:
    """``value`` as ``LoraOptions``: a saved workload keeps them as a mapping of its fields.

    Raises:
        ValueError: a mapping with unknown fields or bad values.
    """
    if value is None or isinstance(value, LoraOptions):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"StepOptions.lora must be LoraOptions or None; got {value!r}. "
            "Example: StepOptions(lora=LoraOptions(r=16))"
        )
    known = {f.name for f in fields(LoraOptions)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(
            f"unknown LoRA option(s) {', '.join(unknown)}; the fields are {', '.join(sorted(known))}"
        )
    return LoraOptions(**dict(value))
