"""Training-mode batch norm as CUDA runs it: ``cudnn_batch_norm`` and its backward.

aten/src/ATen/native/Normalization.cpp ``_batch_norm_impl_index`` sends a CUDA batch norm to
cuDNN when ``_select_batch_norm_backend`` returns ``Cudnn`` (:func:`uses_cudnn`); meta runs
``native_batch_norm``. aten/src/ATen/native/cudnn/BatchNorm.cpp ``cudnn_batch_norm`` (training)
allocates, in this order: ``output`` (``empty_like(input, suggest_memory_format)``),
``save_mean`` and ``save_var`` (``[C]`` in the weight's dtype, fp32 for an fp16 input), a
forward ``workspace`` (freed on return) and the ``reserve`` space that autograd saves for
``cudnn_batch_norm_backward``. Meta's ``native_batch_norm`` records the same output and the same
two ``[C]`` fp32 statistics (checked in tests/tracing/test_emulation_batch_norm.py), so only the
workspace and the reserve space are missing.

Their sizes come from cuDNN (``cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize``,
``cudnnGetBatchNormalizationTrainingExReserveSpaceSize``, ``...BackwardExWorkspaceSize``), which
publishes no formula. Assumption, documented and not yet measured here: with
``CUDNN_BATCHNORM_OPS_BN`` and no activation descriptor, ``CUDNN_BATCHNORM_SPATIAL`` (every
contiguous NCHW/NCDHW input, ``getCudnnBatchNormMode``) needs no workspace and no reserve space:
the reserve space carries the ReLU bitmask of the ``BN_ACTIVATION`` / ``BN_ADD_ACTIVATION`` ops,
which PyTorch never requests, so both are recorded as 0 bytes (``at::empty(0)`` allocates
nothing). ``CUDNN_BATCHNORM_SPATIAL_PERSISTENT`` (channels-last inputs in training) may use both
for its persistent kernels; those calls stay a warning. ``scripts/validate_on_gpu.py resnet50``
measures the truth.

Also emulated: ``cudnn_batch_norm_backward`` makes ``grad_output.contiguous(input's memory
format)``, a full-size copy when the incoming gradient is not laid out like the input (e.g. the
expanded gradient of ``.sum()``), live while the kernel runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

# torch's port of TensorImpl::suggest_memory_format (is_channels_last_strides_2d/3d, c10's
# MemoryFormat.h): channels last where the strides are channels-last-like, else contiguous.
from torch._prims_common import suggest_memory_format

from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = [
    "BATCH_NORM_BACKWARD_OP",
    "BATCH_NORM_OP",
    "CUDNN_MAX_TRAINING_BATCH",
    "register_batch_norm",
    "uses_cudnn",
]

BATCH_NORM_OP = "aten.native_batch_norm.default"
BATCH_NORM_BACKWARD_OP = "aten.native_batch_norm_backward.default"
# Normalization.cpp _select_batch_norm_backend: spatial batch norm in training goes to cuDNN up
# to this batch size (65535 in eval).
CUDNN_MAX_TRAINING_BATCH = 880801
_CUDNN_MAX_EVAL_BATCH = 65535
_INT32_MAX = 2**31 - 1
_PERSISTENT_FORMATS = (torch.channels_last, torch.channels_last_3d)
_PERSISTENT_WHAT = (
    "the cuDNN persistent (channels-last) batch-norm reserve space and workspace, sized by cuDNN"
)


def register_batch_norm(registry: EmulationRegistry) -> None:
    """Add the ``native_batch_norm`` forward and backward hooks to ``registry``."""
    registry.register(BATCH_NORM_OP)(_batch_norm)
    registry.register(BATCH_NORM_BACKWARD_OP)(_batch_norm_backward)


def uses_cudnn(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
) -> bool:
    """Whether CUDA would run this batch norm with cuDNN (``_select_batch_norm_backend``).

    Mirrors the CUDA checks of Normalization.cpp ``_select_batch_norm_backend`` for a build with
    cuDNN (every CUDA wheel) and ``torch.backends.cudnn.enabled``; ``eps >=
    CUDNN_BN_MIN_EPSILON`` is taken as met (0.0 since cuDNN 7.x, so any eps passes).
    """
    if weight is None or bias is None:
        return False
    if torch.bfloat16 in (input.dtype, weight.dtype):
        return False
    if input.dtype == torch.float16 and weight.dtype != torch.float32:
        return False
    stats = (running_mean is not None, running_var is not None)
    if not (stats == (True, True) or (stats == (False, False) and training)):
        return False
    if input.dim() < 3:
        return False
    limit = CUDNN_MAX_TRAINING_BATCH if training else _CUDNN_MAX_EVAL_BATCH
    return input.shape[0] <= limit and input.numel() < _INT32_MAX


def _batch_norm(ctx: EmulationContext) -> Any:
    # Schema: (input, weight, bias, running_mean, running_var, training, momentum, eps).
    input, weight, bias, running_mean, running_var, training = ctx.args[:6]
    if not stands_for_cuda(input) or not training or input.numel() == 0:
        return ctx.run()
    if not uses_cudnn(input, weight, bias, running_mean, running_var, training):
        # Normalization.cu batch_norm_cuda: output and two [C] accumulate-type statistics, as
        # meta records them.
        return ctx.run()
    if suggest_memory_format(input) in _PERSISTENT_FORMATS:
        ctx.not_emulated(_PERSISTENT_WHAT)
    # cudnn_batch_norm in CUDNN_BATCHNORM_SPATIAL mode: output, save_mean, save_var as meta
    # records them; workspace and reserve space 0 bytes (module docstring).
    return ctx.run()


def _batch_norm_backward(ctx: EmulationContext) -> Any:
    # Schema: (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
    #          train, eps, output_mask).
    grad_out, input, weight, running_mean, running_var = ctx.args[:5]
    train = bool(ctx.args[7])
    if (
        not stands_for_cuda(input)
        or not train
        or input.numel() == 0
        or not uses_cudnn(input, weight, weight, running_mean, running_var, train)
    ):
        return ctx.run()
    memory_format = suggest_memory_format(input)
    if memory_format in _PERSISTENT_FORMATS:
        ctx.not_emulated(_PERSISTENT_WHAT)
    copy_id = None
    if not grad_out.is_contiguous(memory_format=memory_format):
        # cudnn_batch_norm_backward: grad_output_t.contiguous(input.suggest_memory_format()),
        # made before grad_input / grad_weight / grad_bias and freed when the op returns.
        copy_id = ctx.allocate(
            grad_out.numel() * grad_out.element_size(), "temporary", "cudnn_bn_grad_output"
        )
    out = ctx.run()
    ctx.record_outputs(out)
    if copy_id is not None:
        ctx.free(copy_id)
    return out
