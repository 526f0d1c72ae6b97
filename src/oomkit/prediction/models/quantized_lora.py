"""peft's LoRA and DoRA layers over quantized base weights, as peft/tuners/lora/bnb.py runs them.

peft's ``DoraLinearLayer`` (peft/tuners/lora/dora.py) reads its base weight through
``peft.utils.integrations.dequantize_module_weight``, which for a bitsandbytes ``Params4bit`` /
``Int8Params`` calls ``dequantize_bnb_weight``: ``functional.dequantize_4bit`` (an ``[out, in]``
tensor in the dtype the weight was quantized from; with double quantization the fp32 absmax
first) or ``functional.int8_vectorwise_dequant`` (bitsandbytes/_ops.py default kernel:
``A * stats.view(-1, 1) * (1 / 127)``, two fp32 ``[out, in]`` tensors, the first freed at once).
oomkit's emulated storages (``Linear4bitStorage``, ``Linear8bitLtStorage``) are not bitsandbytes
parameters, so peft's helper would return the packed bytes; :class:`QuantizedDoraLinearLayer`
runs the same code as peft's layer with the storage's own ``dequantize()`` in its place. Every
other step (``torch.eye`` through the adapters for the LoRA weight, ``weight.to(x.dtype)``,
``weight + scaling * lora_weight``, the row norm, the magnitude scale, the extra products) is
peft's, so its temporaries are those of the unquantized DoRA layer; the dequantized weight and
its cast are what the quantization adds.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["quantized_dora_variant", "quantized_lora_class"]


@functools.cache
def quantized_dora_variant() -> Any:
    """peft's ``DoraLinearVariant`` whose DoRA layer dequantizes an emulated storage (stateless).

    Returned by the quantized LoRA layers' ``resolve_lora_variant`` when ``use_dora`` is set
    (peft/tuners/lora/bnb.py ``Linear4bit`` / ``Linear8bitLt.resolve_lora_variant`` return
    ``DoraLinearVariant()`` there).
    """
    from peft.tuners.lora.dora import DoraLinearLayer
    from peft.tuners.lora.variants import DoraLinearVariant
    from peft.utils.other import transpose

    def dequantized(base_layer: nn.Module) -> torch.Tensor:
        # peft/utils/integrations.py dequantize_module_weight -> dequantize_bnb_weight.
        weight: torch.Tensor = base_layer.dequantize()  # type: ignore[operator]
        return weight

    class QuantizedDoraLinearLayer(DoraLinearLayer):
        """peft/tuners/lora/dora.py ``DoraLinearLayer`` over an emulated quantized storage."""

        def update_layer(
            self, *, base_layer: Any, lora_A: Any, lora_B: Any, scaling: Any,
            place_on_cpu: bool = False,
        ) -> None:
            # DoraLinearLayer.update_layer (at get_peft_model, before any step): the magnitude
            # is the row norm of W + scaling * B @ A, W dequantized; fp16 adapters go via fp32.
            if lora_A.dtype == torch.float16:
                lora_A, lora_B = lora_A.float(), lora_B.float()
                lora_weight = (lora_B @ lora_A).half()
            else:
                lora_weight = lora_B @ lora_A
            weight = dequantized(base_layer).to(lora_A.device)
            weight_norm = self.get_weight_norm(weight=weight, lora_weight=lora_weight,
                                               scaling=scaling)
            self.weight = nn.Parameter(weight_norm, requires_grad=True)

        def forward(
            self, x: torch.Tensor, *, lora_A: Any, lora_B: Any, scaling: Any, base_layer: Any,
            base_result: torch.Tensor | None = None, adapter_name: str = "default",
        ) -> torch.Tensor:
            # DoraLinearLayer.forward, step for step.
            lora_weight = self.get_lora_weight(lora_A=lora_A, lora_B=lora_B,
                                               adapter_name=adapter_name)
            lora_weight = lora_weight.to(x.dtype)
            magnitude = self.weight
            weight = dequantized(base_layer).to(x.dtype)
            weight_norm = self.get_weight_norm(
                weight=weight, lora_weight=lora_weight.detach(), scaling=scaling,
                adapter_name=adapter_name,
            ).detach()
            mag_norm_scale = (magnitude / weight_norm).view(1, -1)
            lora_result = lora_B(lora_A(x))
            if base_result is not None:
                bias = base_layer.bias
                if bias is not None:
                    base_result = base_result - bias
            else:  # dropout active in training: the base matmul again, on the dequantized W
                base_result = F.linear(x, transpose(weight, self.fan_in_fan_out))
            result: torch.Tensor = (mag_norm_scale - 1) * base_result + (
                mag_norm_scale * lora_result * scaling
            )
            return result

    class QuantizedDoraLinearVariant(DoraLinearVariant):
        """peft/tuners/lora/variants.py ``DoraLinearVariant`` building the layer above."""

        @staticmethod
        def init(module: Any, adapter_name: str, **kwargs: Any) -> None:
            # DoraLinearVariant.init without ephemeral GPU offload (off by default).
            if not module.lora_magnitude_vector:
                module.adapter_layer_names = (
                    *module.adapter_layer_names, "lora_magnitude_vector"
                )
            layer = QuantizedDoraLinearLayer(fan_in_fan_out=getattr(module, "fan_in_fan_out", False))
            layer.update_layer(
                base_layer=module.get_base_layer(),
                lora_A=module.lora_A[adapter_name].weight,
                lora_B=module.lora_B[adapter_name].weight,
                scaling=module.scaling[adapter_name],
            )
            module.lora_magnitude_vector[adapter_name] = layer

    return QuantizedDoraLinearVariant()


@functools.cache
def quantized_lora_class(*, clone_base_output: bool) -> Any:
    """peft's LoRA ``Linear`` with the forward of peft's bitsandbytes layer (LoRA or DoRA).

    peft dispatches a real ``bnb.nn.Linear4bit`` / ``Linear8bitLt`` to peft/tuners/lora/bnb.py
    ``Linear4bit`` / ``Linear8bitLt``, whose forward differs from the plain layer's: the 4-bit one
    clones the base output ("defensively", per Tim Dettmers; ``clone_base_output``); outside
    autocast the input is cast to the adapter's dtype and the adapter's output (LoRA) or the
    whole result (DoRA, after ``DoraLinearVariant.forward``) back to the base output's dtype.
    Those classes only exist when bitsandbytes is installed, so this one mirrors them; with
    ``use_dora`` its variant is :func:`quantized_dora_variant`.
    """
    from peft.tuners.lora.layer import Linear as LoraLinear

    class QuantizedLoraLinear(LoraLinear):
        def resolve_lora_variant(self, *, config: Any, **kwargs: Any) -> Any:
            # bnb.py Linear4bit / Linear8bitLt.resolve_lora_variant: DoRA (without aLoRA) is
            # DoraLinearVariant; the rest as the plain layer resolves it.
            if config.use_dora and getattr(config, "alora_invocation_tokens", None) is None:
                return quantized_dora_variant()
            return super().resolve_lora_variant(config=config, **kwargs)

        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            result = self.base_layer(x, *args, **kwargs)
            if clone_base_output:
                result = result.clone()
            for active_adapter in self.active_adapters:
                if active_adapter not in self.lora_A:
                    continue
                lora_a: Any = self.lora_A[active_adapter]
                lora_b: Any = self.lora_B[active_adapter]
                dropout, scaling = self.lora_dropout[active_adapter], self.scaling[active_adapter]
                convert = not torch.is_autocast_enabled()
                expected_dtype = result.dtype
                if convert:
                    x = self._cast_input_dtype(x, lora_a.weight.dtype)
                if active_adapter not in self.lora_variant:  # vanilla LoRA
                    output = lora_b(lora_a(dropout(x))) * scaling
                    if convert:
                        output = output.to(expected_dtype)
                    result = result + output
                else:
                    result = self.lora_variant[active_adapter].forward(
                        self, active_adapter=active_adapter, x=x, result=result
                    )
                    if convert:
                        result = result.to(expected_dtype)
            return result

    return QuantizedLoraLinear
