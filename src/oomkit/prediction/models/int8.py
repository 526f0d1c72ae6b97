"""8-bit base weights as bitsandbytes ``Linear8bitLt`` (LLM.int8()) stores and runs them, emulated.

bitsandbytes has no meta kernels, and oomkit does not need it: each ``nn.Linear`` or transformers
``Conv1D`` (but the output layer, as transformers' ``get_keys_to_not_convert`` leaves ``lm_head``
alone) becomes
:class:`Linear8bitLtStorage`, which holds the tensors ``Int8Params._quantize`` leaves on the
device and whose forward and backward allocate what bitsandbytes 0.50's CUDA path allocates
(transformers' ``load_in_8bit``: ``has_fp16_weights=False``, ``threshold=llm_int8_threshold``,
6.0 by default):

- storage (bitsandbytes/nn/modules.py ``Int8Params._quantize`` ->
  ``functional.int8_vectorwise_quant`` of the fp16 weight): ``CB``, the ``[out, in]`` int8 weight
  (``numel`` bytes; it is the parameter's data), and ``SCB``, one fp32 absmax per output row
  (``out * 4`` bytes).
- forward (bitsandbytes/autograd/_functions.py ``MatMul8bitLt.forward``; ``bnb.matmul`` takes it
  on CUDA in train and eval mode alike): ``A.to(float16)`` (a copy unless the input is fp16),
  quantized by ``int8_vectorwise_quant`` (backends/cuda/ops.py): fp32 row stats ``[rows]``, the
  int8 ``[rows, in]`` activation and, with a threshold, ``A.abs() >= threshold`` (an fp16 and a
  bool ``[rows, in]``) and ``outliers.any()``; then ``int8_mixed_scaled_mm``
  (backends/default/ops.py, the only registration): ``int8_scaled_mm`` = ``int8_linear_matmul``
  (an int32 ``[rows, out]``) + ``int8_mm_dequant`` (an fp16 ``[rows, out]``, then ``.to(A.dtype)``
  unless fp16). The input is kept for backward (``ctx.tensors = (CAt, subA, A)``) when it needs a
  gradient; the weight is frozen, so the slow ``int8_double_quant`` path is never taken.
- backward (``MatMul8bitLt.backward``, input gradient only): ``CB.to(A.dtype, copy=True)`` scaled
  in place by ``SCB.unsqueeze(1) * (1 / 127)`` (an fp32 ``[out, 1]``): the dequantized
  ``[out, in]`` weight lives for the gradient's matmul, then is freed.

Outliers depend on the data: this emulation assumes ``outlier_columns`` input columns hold a value
``>= threshold`` in every layer, 0 by default (what a randomly initialised model gives; the
LLM.int8() paper finds such feature dimensions in pretrained models from about 6.7B parameters,
a handful per layer). With ``k`` outlier columns the forward adds ``argwhere``'s ``[k]`` int64
index (kept on the layer as ``state.idx`` until the next forward), ``subA`` (``[rows, k]`` in the
input dtype, kept for backward), the dequantized ``[out, k]`` weight columns (fp32 twice, then the
input dtype) and ``addmm``'s second ``[rows, out]`` output. Known differences: the real count
varies per layer and per batch (each outlier column adds ``rows * k * itemsize`` kept bytes);
``argwhere`` / ``index_put_``'s CUB sort temporaries for ``k > 0`` are not modelled; the
load-time peak (quantizing each fp16 weight on the GPU) is not modelled.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from oomkit.errors import ConfigError

__all__ = ["BNB_INT8_THRESHOLD", "Linear8bitLtStorage", "storage_bytes_int8"]

# transformers/utils/quantization_config.py BitsAndBytesConfig: llm_int8_threshold=6.0.
BNB_INT8_THRESHOLD = 6.0
# bitsandbytes/_ops.py int8_vectorwise_dequant: A * stats * 7.874015718698502e-3 (1 / 127).
_INV_127 = 1.0 / 127.0


def storage_bytes_int8(out_features: int, in_features: int) -> dict[str, int]:
    """Bytes of one ``[out_features, in_features]`` weight as ``Int8Params._quantize`` keeps it.

    Returns:
        ``weight`` (``CB``, one int8 per element) and ``SCB`` (one fp32 absmax per output row).
    """
    return {"weight": out_features * in_features, "SCB": 4 * out_features}


def _vectorwise_quant(
    a16: torch.Tensor, threshold: float, outlier_columns: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """backends/cuda/ops.py ``int8_vectorwise_quant``: int8 rows, fp32 row stats, outlier columns."""
    rows = a16.numel() // a16.shape[-1]
    row_stats = torch.empty(rows, device=a16.device, dtype=torch.float32)
    out_row = torch.empty(a16.shape, device=a16.device, dtype=torch.int8)
    outlier_cols = None
    if threshold > 0.0:
        outliers = a16.abs() >= threshold
        # `if outliers.any():` reads a 0-d bool on the host: the count of outlier columns is
        # data (see the module), taken from `outlier_columns`.
        outliers.any()
        if outlier_columns:
            found = outliers.any(dim=0)  # argwhere(outliers.any(dim=0)).view(-1)
            outlier_cols = torch.empty((outlier_columns, 1), dtype=torch.int64, device=a16.device)
            outlier_cols = outlier_cols.view(-1)
            del found
        else:
            outlier_cols = torch.empty(0, device=a16.device, dtype=torch.int64)
        del outliers
    # The kernel cint8_vector_quant writes out_row and row_stats; then outlier columns are zeroed.
    if rows > 1 and outlier_cols is not None:
        out_row[:, outlier_cols] = 0
    return out_row, row_stats, outlier_cols


def _int8_scaled_mm(
    ca: torch.Tensor,
    cb: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """backends/default/ops.py ``int8_scaled_mm``: int32 matmul, then ``int8_mm_dequant``."""
    # backends/cuda/ops.py int8_linear_matmul: the int32 output; csrc/ops.cu igemmlt calls
    # cublasLtMatmul with no workspace (NULL, 0).
    out_i32 = torch.empty((*ca.shape[:-1], cb.shape[0]), device=ca.device, dtype=torch.int32)
    if ca.shape[-1] % 4 != 0:
        # _int8_linear_matmul_impl: cuBLASLt needs inner dimensions divisible by 4; the fallback
        # is an fp32 matmul copied into the output.
        fallback = torch.matmul(ca.float(), cb.float().t()).to(torch.int32)
        out_i32.copy_(fallback)
        del fallback
    # backends/cuda/ops.py int8_mm_dequant: an fp16 output (the kernel writes fp16 only), a bias
    # other than fp16 added in place, then cast to the asked dtype.
    out = torch.empty_like(out_i32, dtype=torch.float16)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    result = out.to(dtype)
    del out  # int8_mm_dequant returns
    del out_i32  # then int8_scaled_mm
    return result


def _dequantize_columns(cb: torch.Tensor, scb: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``int8_vectorwise_dequant(CB[:, outlier_cols].contiguous(), SCB)``: fp32 ``[out, k]``."""
    sub = cb[:, cols].contiguous()
    return sub * scb.view(-1, 1) * _INV_127


class _MatMul8bitLt(torch.autograd.Function):
    """bitsandbytes/autograd/_functions.py ``MatMul8bitLt`` with a frozen int8 weight."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, layer: Linear8bitLtStorage, bias: torch.Tensor | None
    ) -> torch.Tensor:
        input_shape = x.shape
        a = x.reshape(-1, x.shape[-1]) if x.dim() == 3 else x
        # "Fast path" (the weight needs no gradient): int8_vectorwise_quant(A.to(float16)).
        ca, sca, outlier_cols = _vectorwise_quant(
            a.to(torch.float16), layer.threshold, layer.outlier_columns
        )
        cb = layer.weight
        scb = cast(torch.Tensor, layer.SCB)
        sub_a: torch.Tensor | None = None
        if layer.threshold > 0.0:
            layer.idx = outlier_cols  # state.idx: kept until the layer's next forward
            # backends/default/ops.py int8_mixed_scaled_mm.
            sub_b = None
            if outlier_cols is not None and outlier_cols.numel():
                sub_a = a[:, outlier_cols].contiguous()
                sub_b = _dequantize_columns(cb, scb, outlier_cols).to(a.dtype).t()
            else:
                sub_a = torch.empty(0, device=a.device, dtype=a.dtype)
            output = _int8_scaled_mm(ca, cb, bias, a.dtype)
            if sub_b is not None:
                output = output.addmm(sub_a, sub_b)
            del sub_b
        else:
            output = _int8_scaled_mm(ca, cb, bias, a.dtype)
        del ca, sca
        ctx.layer = layer
        ctx.grad_shape = input_shape
        ctx.dtype_a = a.dtype
        if ctx.needs_input_grad[0]:
            # ctx.tensors = (CAt, subA, A): plain references, kept until backward.
            ctx.tensors = (None, sub_a, a)
        else:
            ctx.tensors = (None, None, None)
        if len(input_shape) == 3:
            return output.reshape((*input_shape[:-1], cb.shape[0]))
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, None, None]:
        layer: Linear8bitLtStorage = ctx.layer
        if grad_output.dim() == 3:
            grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        grad_a = None
        if ctx.needs_input_grad[0]:
            scb = cast(torch.Tensor, layer.SCB)
            cb = layer.weight.to(ctx.dtype_a, copy=True)
            cb.mul_(scb.unsqueeze(1).mul(_INV_127))
            grad_a = torch.matmul(grad_output.to(ctx.dtype_a), cb).view(ctx.grad_shape)
            del cb
        # ctx.tensors is not released here (it is no saved tensor): bnb's kept input lives as
        # long as the autograd graph does.
        return grad_a, None, None


class Linear8bitLtStorage(nn.Linear):
    """A frozen ``nn.Linear`` stored and run as bitsandbytes ``Linear8bitLt`` (see the module).

    An ``nn.Linear`` subclass, so that peft adapts it; its LoRA layer then runs peft's 8-bit
    forward (peft/tuners/lora/bnb.py ``Linear8bitLt.forward``).

    Attributes:
        threshold: ``llm_int8_threshold``; 0 turns the outlier decomposition off.
        outlier_columns: input columns assumed to hold an outlier in each forward (data in
            reality; see the module).
    """

    def __init__(
        self,
        linear: nn.Module,
        *,
        threshold: float = BNB_INT8_THRESHOLD,
        outlier_columns: int = 0,
    ) -> None:
        nn.Module.__init__(self)
        # An nn.Linear, or a transformers Conv1D (weight [in, out], replace_with_bnb_linear).
        source_weight = cast(torch.Tensor, linear.weight)
        if isinstance(linear, nn.Linear):
            in_features, out_features = linear.in_features, linear.out_features
        else:
            in_features, out_features = (int(n) for n in source_weight.shape)
        if threshold < 0.0 or outlier_columns < 0 or outlier_columns > in_features:
            raise ConfigError(
                f"Linear8bitLtStorage needs threshold >= 0 and 0 <= outlier_columns <= "
                f"{in_features}; got {threshold!r} and {outlier_columns!r}. "
                "Example: Linear8bitLtStorage(linear, threshold=6.0, outlier_columns=0)"
            )
        self.in_features, self.out_features = in_features, out_features
        self.threshold = float(threshold)
        self.outlier_columns = outlier_columns if threshold > 0.0 else 0
        self.idx: torch.Tensor | None = None
        device = source_weight.device
        # Int8Params(requires_grad=has_fp16_weights=False): the data is CB.
        self.weight = nn.Parameter(
            torch.empty((self.out_features, self.in_features), dtype=torch.int8, device=device),
            requires_grad=False,
        )
        self.bias = cast(nn.Parameter, linear.bias)  # None when the layer has none
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.register_buffer(
            "SCB", torch.empty((self.out_features,), dtype=torch.float32, device=device)
        )

    def dequantize(self) -> torch.Tensor:
        """``functional.int8_vectorwise_dequant(CB, SCB)``: the fp32 ``[out, in]`` weight.

        What peft's ``dequantize_bnb_weight`` returns for DoRA (bitsandbytes/_ops.py default
        kernel ``A * stats.view(-1, 1) * 7.874015718698502e-3``: two fp32 ``[out, in]``
        products, the first freed as the second is made).
        """
        scb = cast(torch.Tensor, self.SCB)
        return self.weight * scb.view(-1, 1) * _INV_127

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        # bitsandbytes/nn/modules.py Linear8bitLt.forward: the bias is cast to the input's dtype
        # in place of the old one ("weights are cast automatically ... the bias manually").
        if self.bias is not None and self.bias.dtype != x.dtype:
            self.bias.data = self.bias.data.to(x.dtype)
        out: torch.Tensor = _MatMul8bitLt.apply(x, self, self.bias)
        return out

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"threshold={self.threshold}, outlier_columns={self.outlier_columns}"
        )


def lora_8bit_layer_class() -> Any:
    """peft's LoRA ``Linear`` with the forward of peft's bitsandbytes ``Linear8bitLt`` layer.

    peft/tuners/lora/bnb.py ``Linear8bitLt.forward``: the base output is not cloned (unlike the
    4-bit layer's); LoRA and DoRA as ``oomkit.prediction.models.quantized_lora`` describes.
    """
    from oomkit.prediction.models.quantized_lora import quantized_lora_class

    return quantized_lora_class(clone_base_output=False)
