"""``F.dropout`` as CUDA runs it: the fused kernel's 1-byte mask, not a dtype-sized noise tensor.

aten/src/ATen/native/Dropout.cpp ``dropout``: in training, when ``is_fused_kernel_acceptable``
(a CUDA input, ``0 < p < 1``, ``numel > 0``), CUDA runs ``native_dropout``, which returns the
output and a ``bool`` mask (1 byte per element) that autograd saves for
``native_dropout_backward``. On meta the same composite takes ``_dropout<false>``:
``empty_like(input).bernoulli_(1 - p)``, a noise tensor of the input's dtype (2 or 4 bytes per
element) that is saved instead. This hook, run by the tracer's TorchFunctionMode in place of
``torch.nn.functional.dropout`` (so ``nn.Dropout`` and Hugging Face models are covered), calls
``native_dropout`` when the fused path applies.

In-place dropout (``inplace=True``, ``dropout_``) is not fused on CUDA either (``_dropout<true>``)
and is recorded as meta runs it; so are the other dropout variants (``alpha_dropout``,
``feature_dropout``), which never take the fused kernel.

``native_dropout`` itself allocates its mask before its output on CUDA (Dropout.cu
``dropout_cuda``: ``mask = at::empty_like(self, ...bool)``, then ``ret = at::empty_like(self)``),
while meta's kernel returns them the other way round; a second hook records them in CUDA's order
(measured on an H200: GPT-2's dropouts asked for the 1-byte mask, then the output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["DROPOUT_FUNCTION", "NATIVE_DROPOUT_OP", "register_dropout"]

DROPOUT_FUNCTION = "torch.nn.functional.dropout"
NATIVE_DROPOUT_OP = "aten.native_dropout.default"
_PARAMS = ("input", "p", "training", "inplace")


def register_dropout(registry: EmulationRegistry) -> None:
    """Add the ``F.dropout`` and ``native_dropout`` hooks to ``registry``."""
    registry.register(DROPOUT_FUNCTION)(_dropout)
    registry.register(NATIVE_DROPOUT_OP)(_native_dropout)


def _native_dropout(ctx: EmulationContext) -> Any:
    """``native_dropout(input, p, train)``: the mask's storage, then the output's."""
    out = ctx.run()
    x = ctx.args[0] if ctx.args else None
    if isinstance(x, torch.Tensor) and stands_for_cuda(x) and isinstance(out, tuple):
        ctx.record_outputs(out[1])
        ctx.record_outputs(out[0])
    return out


def _dropout(ctx: EmulationContext) -> Any:
    bound: dict[str, Any] = {"p": 0.5, "training": True, "inplace": False}
    bound.update(zip(_PARAMS, ctx.args, strict=False))
    bound.update(ctx.kwargs)
    x, p = bound["input"], float(bound["p"])
    if (
        not isinstance(x, torch.Tensor)
        or not stands_for_cuda(x)
        or not bound["training"]
        or bound["inplace"]
        # Dropout.cpp is_fused_kernel_acceptable: 0 < p < 1 and a non-empty input; F.dropout
        # raises for p outside [0, 1], and p == 0 or 1 takes the unfused path.
        or not 0.0 < p < 1.0
        or x.numel() == 0
    ):
        return ctx.run()
    return torch.native_dropout(x, p, True)[0]
