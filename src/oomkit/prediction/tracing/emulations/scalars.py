"""Python numbers turned into tensors: on the GPU where CUDA puts them there, on the host where not.

Two places where CUDA and the meta device disagree about a Python number's tensor:

- ``tensor ** x`` with a number as the base (``aten.pow.Scalar``): CUDA's kernel
  (aten/src/ATen/native/Pow.cpp ``TORCH_IMPL_FUNC(pow_Scalar_out)``) wraps the base in a 0-dim
  tensor on the exponent's device (``wrapped_scalar_tensor(base, exp.device())``) unless it is 1,
  after the output is allocated, and drops it when the kernel returns. A structured kernel on
  meta runs only its meta function, so meta allocates the output alone. Measured on an H200
  (torch 2.11): Llama's rotary ``theta ** (arange / dim)`` asked for its output, then 8 bytes,
  freed at once.
- ``tensor[index] = number``: torch/csrc/autograd/python_variable_indexing.cpp
  ``THPVariable_setitem`` makes the number a tensor on the CPU when ``tensor`` is on CUDA
  (``valueToTensor(self.options(), value, at::Device(kCPU))``), but on the tensor's own device
  otherwise, so on meta it allocated 8 bytes CUDA never does (the H200's trace of GPT-2's
  ``labels[:, -1] = -100`` has no such request). With basic indexing (integers, slices,
  ``None``, ``...``) the slice is filled from the host number; the number is made on the host
  here too. With tensor indices ``_index_put_impl_`` either turns a boolean mask into
  ``masked_fill_`` or copies the number to the device (``value.to(self.device())``): those calls
  keep the number on the tensor's device, as before, which allocates the device copy's 8 bytes
  (the mask case is then 8 bytes over, for as long as the assignment runs).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

import torch

from oomkit.prediction.tracing.fake_storages import host_tensor, stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = ["POW_SCALAR_OP", "SETITEM_FUNCTION", "register_scalars"]

POW_SCALAR_OP = "aten.pow.Scalar"
SETITEM_FUNCTION = "torch.Tensor.__setitem__"
_NUMBERS = (bool, int, float, complex)
_BASIC_INDEX = (int, slice, types.NoneType, types.EllipsisType)


def register_scalars(registry: EmulationRegistry) -> None:
    """Add the ``pow.Scalar`` and ``Tensor.__setitem__`` hooks to ``registry``."""
    registry.register(POW_SCALAR_OP)(_pow_scalar_base)
    registry.register(SETITEM_FUNCTION)(_setitem_number)


def _wrapped_scalar_bytes(number: Any) -> int:
    # c10::scalar_to_tensor: a bool Scalar is kBool, an integral one kLong, a floating one kDouble,
    # a complex one kComplexDouble.
    if isinstance(number, bool):
        return 1
    if isinstance(number, complex):
        return 16
    return 8


def _pow_scalar_base(ctx: EmulationContext) -> Any:
    """``pow(Scalar self, Tensor exponent)``: the output, then the base on the device."""
    base, exponent = ctx.args[0], ctx.args[1]
    if not isinstance(exponent, torch.Tensor) or not stands_for_cuda(exponent):
        return ctx.run()
    out = ctx.run()
    # pow_Scalar_out: a base equal to 1 fills the output and wraps nothing.
    if isinstance(base, _NUMBERS) and base != 1:
        ctx.record_outputs(out)
        ctx.free(ctx.allocate(_wrapped_scalar_bytes(base), "temporary", "pow_scalar_base"))
    return out


def _basic(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return all(isinstance(part, _BASIC_INDEX) for part in parts)


def _setitem_number(ctx: EmulationContext) -> Any:
    """``tensor[index] = number`` with basic indexing: the number as a host tensor, as CUDA has it."""
    if len(ctx.args) != 3 or ctx.kwargs:
        return ctx.run()
    target, index, value = ctx.args
    if not (
        isinstance(value, _NUMBERS)
        and isinstance(target, torch.Tensor)
        and stands_for_cuda(target)
        and not target.is_quantized
        and _basic(index)
    ):
        return ctx.run()
    host = host_tensor(lambda: torch.scalar_tensor(value, dtype=target.dtype, device="cpu"))
    return ctx.func(target, index, host)
