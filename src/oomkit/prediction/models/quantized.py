"""4-bit base weights as bitsandbytes stores and runs them (QLoRA), emulated on the meta device.

bitsandbytes' ``Linear4bit`` has no meta kernels, and oomkit does not need bitsandbytes: each
``nn.Linear`` or transformers ``Conv1D`` (but the output layer, as transformers'
``get_keys_to_not_convert`` leaves ``lm_head`` alone) is replaced by :class:`Linear4bitStorage`, which holds exactly the tensors
``functional.quantize_4bit`` leaves on the device and whose forward allocates what
``bnb.matmul_4bit`` / ``MatMul4Bit`` allocate on CUDA:

- storage (``quantize_4bit``, blocksize 64, ``quant_storage=torch.uint8``): the packed weight,
  ``((n + 1) // 2, 1)`` uint8 for ``n = out * in``; the 16-entry fp32 code of nf4/fp4
  (``get_4bit_type``); ``absmax``, one fp32 per block of 64. With double quantization
  (``compress_statistics=True``): ``absmax`` becomes uint8 (``quantize_blockwise`` of
  ``absmax - offset`` with blocksize 256), plus ``state2.absmax`` (fp32, one per 256 blocks),
  ``state2.code`` (the 256-entry fp32 dynamic map copied to the device) and ``offset``
  (``absmax.mean()``, a 0-d fp32 tensor).
- forward (``Linear4bit.forward``): ``x.to(compute_dtype)`` (a copy when the dtypes differ);
  ``MatMul4Bit.forward``: ``dequantize_4bit`` (with double quantization first
  ``dequantize_blockwise`` of ``absmax``: fp32 ``[blocks]``, ``+= offset`` in place) into an
  ``[out, in]`` tensor of the dtype the weight was quantized from, ``.to(x.dtype)``, then
  ``F.linear``; the weight temporaries are freed after the matmul. Nothing of ``x`` is saved
  (``ctx.tensors = (None, B)``).
- backward (``MatMul4Bit.backward``): ``grad_output @ dequantize_4bit(B).to(grad.dtype).t()``:
  the same dequantized temporary again.

Not modelled: the load-time peak (transformers quantizes each weight on the GPU from its 16-bit
copy), the single-token inference ``gemv_4bit`` path (it reads the packed weight without a
temporary: generation is refused with 4-bit weights). ``int8`` (``Linear8bitLt``) is in
``oomkit.prediction.models.int8``; :func:`quantize_linears` builds either. peft's LoRA / DoRA
layers over them are in ``oomkit.prediction.models.quantized_lora``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from oomkit.errors import OomkitError
from oomkit.prediction.models.int8 import Linear8bitLtStorage

__all__ = [
    "Linear4bitStorage",
    "QuantType",
    "is_quantizable",
    "linear_features",
    "quantize_linears",
    "storage_bytes_4bit",
    "BNB_4BIT_BLOCKSIZE",
    "BNB_NESTED_BLOCKSIZE",
]

QuantType = Literal["nf4", "fp4"]

# bitsandbytes/nn/modules.py Params4bit: blocksize 64 on CUDA; functional.py quantize_4bit with
# compress_statistics quantizes absmax with quantize_blockwise(..., blocksize=256).
BNB_4BIT_BLOCKSIZE = 64
BNB_NESTED_BLOCKSIZE = 256
# functional.py get_4bit_type: 16 fp32 values (nf4 or fp4); create_dynamic_map: 256 fp32 values.
_CODE_4BIT_ENTRIES = 16
_DYNAMIC_MAP_ENTRIES = 256


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    conv1d: type = Conv1D
    return conv1d


def is_quantizable(module: nn.Module) -> bool:
    """Whether transformers' ``replace_with_bnb_linear`` converts ``module``.

    transformers/integrations/bitsandbytes.py ``replace_with_bnb_linear``: ``type(module) is
    nn.Linear`` (not subclasses) or ``isinstance(module, Conv1D)`` (GPT-2's layers).
    """
    conv1d = _conv1d_class()
    return type(module) is nn.Linear or (conv1d is not None and isinstance(module, conv1d))


def linear_features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a transformers ``Conv1D``.

    transformers/integrations/bitsandbytes.py ``replace_with_bnb_linear``: a ``Conv1D`` keeps its
    weight as ``[in, out]`` (``nx, nf``), so ``in_features, out_features = module.weight.shape``;
    the bitsandbytes layer built from it stores the transposed ``[out, in]`` weight (its
    converter transposes the checkpoint's, ``Bnb4bitQuantize.convert``), as for a Linear.
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    in_features, out_features = cast(torch.Tensor, module.weight).shape
    return int(in_features), int(out_features)


def storage_bytes_4bit(numel: int, *, double_quant: bool) -> dict[str, int]:
    """Bytes of one 4-bit weight of ``numel`` elements as ``quantize_4bit`` stores it.

    Returns:
        ``weight`` (packed, 2 per byte), ``code`` (16 fp32), ``absmax`` (fp32 per 64, or uint8
        with double quantization) and, with double quantization, ``nested_absmax`` (fp32 per 256
        blocks), ``nested_code`` (256 fp32) and ``offset`` (one fp32).
    """
    blocks = _ceil_div(numel, BNB_4BIT_BLOCKSIZE)
    sizes = {"weight": (numel + 1) // 2, "code": 4 * _CODE_4BIT_ENTRIES}
    if not double_quant:
        sizes["absmax"] = 4 * blocks
        return sizes
    sizes["absmax"] = blocks
    sizes["nested_absmax"] = 4 * _ceil_div(blocks, BNB_NESTED_BLOCKSIZE)
    sizes["nested_code"] = 4 * _DYNAMIC_MAP_ENTRIES
    sizes["offset"] = 4
    return sizes


class _MatMul4bit(torch.autograd.Function):
    """bitsandbytes/autograd/_functions.py ``MatMul4Bit``: dequantize, matmul, free."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: Linear4bitStorage, bias: Any) -> torch.Tensor:
        weight = layer.dequantize().to(x.dtype)
        out = F.linear(x, weight, bias)
        del weight
        ctx.layer = layer
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None, None]:
        layer: Linear4bitStorage = ctx.layer
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad, layer.dequantize().to(grad.dtype))
        return grad_x, None, None


class Linear4bitStorage(nn.Linear):
    """A frozen ``nn.Linear`` (or ``Conv1D``) stored as bitsandbytes ``Linear4bit`` stores it.

    An ``nn.Linear`` subclass, so that peft adapts it; its LoRA layer then runs peft's 4-bit
    forward (peft/tuners/lora/bnb.py ``Linear4bit.forward``), see :func:`quantize_linears`.
    """

    def __init__(
        self,
        linear: nn.Module,
        *,
        quant_type: QuantType,
        double_quant: bool,
        compute_dtype: torch.dtype,
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear_features(linear)
        source_weight = cast(torch.Tensor, linear.weight)
        self.quant_type = quant_type
        self.double_quant = double_quant
        self.compute_dtype = compute_dtype
        self.quant_dtype = source_weight.dtype  # QuantState.dtype: the weight's before quantizing
        device = source_weight.device
        numel = self.in_features * self.out_features
        blocks = _ceil_div(numel, BNB_4BIT_BLOCKSIZE)
        self.weight = nn.Parameter(
            torch.empty(((numel + 1) // 2, 1), dtype=torch.uint8, device=device),
            requires_grad=False,
        )
        self.bias = cast(nn.Parameter, linear.bias)  # None when the layer has none
        if self.bias is not None:
            self.bias.requires_grad_(False)

        def buffer(name: str, size: tuple[int, ...], dtype: torch.dtype) -> None:
            self.register_buffer(name, torch.empty(size, dtype=dtype, device=device))

        buffer("code", (_CODE_4BIT_ENTRIES,), torch.float32)
        if double_quant:
            buffer("absmax", (blocks,), torch.uint8)
            buffer("nested_absmax", (_ceil_div(blocks, BNB_NESTED_BLOCKSIZE),), torch.float32)
            buffer("nested_code", (_DYNAMIC_MAP_ENTRIES,), torch.float32)
            buffer("offset", (), torch.float32)
        else:
            buffer("absmax", (blocks,), torch.float32)

    def dequantize(self) -> torch.Tensor:
        """``functional.dequantize_4bit``: the ``[out, in]`` weight in the quantized dtype."""
        if self.double_quant:
            # dequantize_blockwise(quant_state.absmax, quant_state.state2) + offset, in place.
            stored = cast(torch.Tensor, self.absmax)
            offset = cast(torch.Tensor, self.offset)
            absmax = torch.empty(stored.shape, dtype=torch.float32, device=stored.device)
            absmax += offset
        out = torch.empty(
            (self.out_features, self.in_features), dtype=self.quant_dtype, device=self.weight.device
        )
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        # bitsandbytes/nn/modules.py Linear4bit.forward.
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        out: torch.Tensor = _MatMul4bit.apply(x, self, bias)
        return out.to(inp_dtype)

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"quant_type={self.quant_type}, double_quant={self.double_quant}"
        )


def _output_layer(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        found = get()
        if isinstance(found, nn.Module):
            return found
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Module) else None


def quantize_linears(
    model: nn.Module,
    *,
    quant_type: QuantType | Literal["int8"] = "nf4",
    double_quant: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> int:
    """Replace each ``nn.Linear`` / ``Conv1D`` of ``model`` but its output layer by quantized storage.

    In place, as transformers' ``replace_with_bnb_linear`` converts them (see
    :func:`is_quantizable`; a ``Conv1D`` becomes an ``[out, in]`` layer, :func:`linear_features`).

    Args:
        model: a built model (on meta), in the dtype its weights are quantized from.
        quant_type: ``nf4`` or ``fp4`` (4-bit; the same storage, the code's values differ), or
            ``int8`` (``Linear8bitLt`` with transformers' default threshold 6.0, see
            ``oomkit.prediction.models.int8``).
        double_quant: ``bnb_4bit_use_double_quant`` (4-bit only).
        compute_dtype: ``bnb_4bit_compute_dtype``: inputs are cast to it for the matmul (4-bit
            only).

    Returns:
        How many layers were replaced.

    Raises:
        OomkitError: the model has no ``nn.Linear`` to quantize.
    """
    skip = _output_layer(model)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_quantizable(child) and child is not skip:
                storage: nn.Linear
                if quant_type == "int8":
                    storage = Linear8bitLtStorage(child)
                else:
                    storage = Linear4bitStorage(
                        child, quant_type=quant_type, double_quant=double_quant,
                        compute_dtype=compute_dtype,
                    )
                setattr(parent, name, storage)
                replaced += 1
    if replaced == 0:
        raise OomkitError(
            f"{type(model).__name__} has no nn.Linear (or transformers Conv1D) layers besides its "
            "output layer to quantize; drop quantize"
        )
    return replaced


def lora_layer_class() -> Callable[..., nn.Module]:
    """peft's LoRA ``Linear`` with the forward of peft's bitsandbytes ``Linear4bit`` layer.

    peft/tuners/lora/bnb.py ``Linear4bit.forward`` clones the base output; LoRA and DoRA as
    ``oomkit.prediction.models.quantized_lora.quantized_lora_class`` describes.
    """
    from oomkit.prediction.models.quantized_lora import quantized_lora_class

    layer_class: Callable[..., nn.Module] = quantized_lora_class(clone_base_output=True)
    return layer_class
