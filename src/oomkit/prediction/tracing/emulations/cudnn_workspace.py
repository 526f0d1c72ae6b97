"""cuDNN convolution and RNN workspaces: what PyTorch lets cuDNN take, and where oomkit cannot know.

**Convolutions** (aten/src/ATen/native/cudnn/Conv_v8.cpp, read at pytorch/pytorch 06ca69c; that
the 2.13 revision keeps this structure is assumed, not checked on a GPU). Every cuDNN convolution
call (``run_single_conv``: one per forward, one each for the input and the weight gradient in
backward) executes an engine plan. Before it runs, the call takes ``plan.getWorkspaceSize()``
bytes from the caching allocator (``run_conv_plan``:
``CUDACachingAllocator::get()->allocate(workspace_size)``) and frees them on return. Which plan
runs:

- ``torch.backends.cudnn.benchmark = False`` (PyTorch's default, "heuristic mode"):
  ``get_configs_from_heuristics`` lists cuDNN's heuristic engine configs, and ``try_configs``
  runs the first one whose plan builds and whose workspace allocation succeeds. If the
  allocation raises ``OutOfMemoryError``, the next config is tried. PyTorch sets no limit of its
  own. The size comes from cuDNN at run time and depends on the engine cuDNN ranks first for
  this GPU, shape and dtype, so no CPU-side rule reproduces it.
- ``benchmark = True``: the first call for each shape runs ``get_plans_from_find``.
  ``generate_and_filter_plans`` keeps the plans whose workspace fits in the largest block the
  allocator could hand out (``get_available_workspace``: ``cacheInfo``, which starts from
  ``cudaMemGetInfo``'s free bytes). It allocates the largest such workspace, halving it on
  OOM, and times at most ``torch.backends.cudnn.benchmark_limit`` plans (default 10; 0 means
  10000). Then ``emptyCache()`` (``_cudnn_get_conv_benchmark_empty_cache``), and the fastest
  plan runs with its own workspace. That first call may transiently take most of the free
  memory; later calls are as in heuristic mode.

So the workspace is determined here only when it is bounded from outside. ``CUDNN_CONV_WSCAP_DBG``
(PyTorch docs, cuda_environment_variables: "the workspace configuration for cuDNN per
allocation") caps the conv workspace cuDNN may use, in MiB. With it set, each cuDNN conv call
records a transient workspace of that many bytes. That is an upper bound, stated in the
recording's assumptions. Without it, no workspace is recorded, and the recording warns, naming the
op and its calls. These workspaces are transient, and an OOM on them falls back to another engine.
So they cannot make a step OOM by themselves, but the segments they leave cached raise peak
*reserved* memory.

Not cuDNN, so no workspace (Convolution.cpp ``_select_conv_backend``, ``use_cudnn_depthwise``):
cuDNN disabled (``torch.backends.cudnn.enabled = False``); and depthwise convolutions
(``groups == C_in > 1``, ``C_out % C_in == 0``, 4-D or 5-D, not transposed) in contiguous
layout and not fp16, which run PyTorch's own ``CudaDepthwise2d`` / ``CudaDepthwise3d`` kernels.
Depthwise fp16 or channels-last convs may take cuDNN, and are warned about like any cuDNN conv.
The non-cuDNN paths that cuDNN-disabled convs take (``slow_conv2d``'s im2col columns) are not
modelled.

Around the workspaces, a convolution's backward on cuDNN (ConvShared.cpp
``cudnn_convolution_backward``) first copies a gradient whose suggested memory format is not the
input's (``grad_output.to(input.suggest_memory_format())``), then each of its input and weight
backwards copies the tensors not in the layout it runs in (``contiguous(layout)``, the layout
from ``cudnn_conv_suggest_memory_format``) before its gradient; the copies are dropped when each
returns. A bias gradient, which cuDNN does not compute, is then ``grad_output.sum`` over all but
the channels (Convolution.cpp ``convolution_backward``), whose multi-block staging
``reductions.py`` records. Measured on an H200: ViT's patch embedding, its gradient laid out
channels last, asked for one copy and the sum's semaphores a step.

**RNNs** (aten/src/ATen/native/cudnn/RNN.cpp ``_cudnn_rnn``). On CUDA, ``nn.LSTM`` / ``nn.GRU``
/ ``nn.RNN`` run one ``_cudnn_rnn`` call. It allocates a transient ``workspace`` and, in
training, a ``reserve`` buffer that autograd saves for ``_cudnn_rnn_backward``. Both are
``at::empty(size, kByte)`` with sizes from ``cudnnGetRNNTempSpaceSizes``, which cuDNN documents
without a formula. Backward allocates its own workspace the same way. The meta device runs the
reference (non-cuDNN) implementation instead. Its per-timestep gate activations, saved for
backward, stand in for the reserve space. The workspaces are not recorded, and each call is
warned about.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

# torch's port of TensorImpl::suggest_memory_format (is_channels_last_strides_2d/3d, c10's
# MemoryFormat.h): channels last where the strides are channels-last-like, else contiguous.
from torch._prims_common import suggest_memory_format

from oomkit.prediction.tracing.emulations.reductions import record_reduction
from oomkit.prediction.tracing.fake_storages import stands_for_cuda

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationContext, EmulationRegistry

__all__ = [
    "CONV_BACKWARD_OP",
    "CONV_OP",
    "RNN_FUNCTIONS",
    "conv_runs_cudnn",
    "conv_workspace_cap_bytes",
    "register_cudnn_workspace",
]

CONV_OP = "aten.convolution.default"
CONV_BACKWARD_OP = "aten.convolution_backward.default"
# nn.LSTM / nn.GRU / nn.RNN call these (torch/nn/modules/rnn.py); each is one _cudnn_rnn on CUDA.
RNN_FUNCTIONS: tuple[str, ...] = (
    "torch._VF.lstm",
    "torch._VF.gru",
    "torch._VF.rnn_tanh",
    "torch._VF.rnn_relu",
)
_MIB = 1 << 20
_CONV_WHAT = (
    "the cuDNN convolution workspace (cuDNN sizes it at run time: Conv_v8.cpp run_conv_plan "
    "allocates plan.getWorkspaceSize(); set CUDNN_CONV_WSCAP_DBG=<MiB> to bound it, and oomkit "
    "records that bound per call)"
)
_BENCHMARK_WHAT = (
    "cuDNN benchmark mode's first call per shape, whose plan search may transiently take most of "
    "the free memory (Conv_v8.cpp generate_and_filter_plans), then empties the cache"
)
_SLOW_WHAT = (
    "the im2col columns of the non-cuDNN convolution CUDA runs with torch.backends.cudnn "
    "disabled (slow_conv2d / slow_conv_dilated2d)"
)
_RNN_WHAT = (
    "the cuDNN RNN workspace (RNN.cpp _cudnn_rnn: sized by cuDNN's cudnnGetRNNTempSpaceSizes at "
    "run time; the reference implementation's saved per-step activations stand in for the "
    "training reserve space, whose size cuDNN also picks)"
)


def conv_workspace_cap_bytes(environ: Mapping[str, str] | None = None) -> int | None:
    """The cuDNN conv workspace bound ``CUDNN_CONV_WSCAP_DBG`` sets, in bytes; None if unset.

    Args:
        environ: environment to read; default ``os.environ``.

    Returns:
        ``int(value) * 2**20`` for a whole number of MiB >= 0; None when unset or unparsable
        (cuDNN then applies no cap).
    """
    env = os.environ if environ is None else environ
    raw = env.get("CUDNN_CONV_WSCAP_DBG")
    if raw is None:
        return None
    try:
        mib = int(raw.strip())
    except ValueError:
        return None
    return mib * _MIB if mib >= 0 else None


def conv_runs_cudnn(
    input: torch.Tensor, weight: torch.Tensor, groups: int, transposed: bool
) -> bool:
    """Whether CUDA would run this convolution with cuDNN (Convolution.cpp
    ``_select_conv_backend``), for a CUDA build with cuDNN on a GPU that supports it.

    False when ``torch.backends.cudnn.enabled`` is off, and for depthwise convolutions in
    contiguous layout with a dtype other than fp16, which run PyTorch's ``CudaDepthwise2d`` /
    ``CudaDepthwise3d`` kernels (``use_cudnn_depthwise``: cuDNN only for channels-last, or fp16
    under further shape rules).
    """
    if not torch.backends.cudnn.enabled:
        return False
    depthwise = (
        not transposed
        and input.dim() in (4, 5)
        and groups > 1
        and input.shape[1] == groups
        and weight.shape[0] % input.shape[1] == 0
    )
    if not depthwise:
        return True
    channels_last = input.dim() == 4 and input.is_contiguous(
        memory_format=torch.channels_last
    ) and not input.is_contiguous()
    return channels_last or input.dtype == torch.float16


def register_cudnn_workspace(
    registry: EmulationRegistry, environ: Mapping[str, str] | None = None
) -> None:
    """Add the convolution (forward, backward) and RNN hooks to ``registry``.

    Args:
        registry: where to register.
        environ: environment read for ``CUDNN_CONV_WSCAP_DBG`` at each call; default
            ``os.environ``.
    """

    def forward(ctx: EmulationContext) -> Any:
        return _convolution(ctx, environ)

    def backward(ctx: EmulationContext) -> Any:
        return _convolution_backward(ctx, environ)

    registry.register(CONV_OP)(forward)
    registry.register(CONV_BACKWARD_OP)(backward)
    for name in RNN_FUNCTIONS:
        registry.register(name)(_rnn)


def _note_mode(ctx: EmulationContext, cap: int | None) -> None:
    mode = "benchmark" if torch.backends.cudnn.benchmark else "heuristic"
    if cap is None:
        value = f"{mode} mode; sized by cuDNN at run time, not recorded"
    else:
        value = f"{mode} mode; at most {cap // _MIB} MiB per call (CUDNN_CONV_WSCAP_DBG), recorded"
    ctx.note_assumption("cuDNN convolution workspace", value)
    if torch.backends.cudnn.benchmark:
        ctx.not_emulated(_BENCHMARK_WHAT)


def _note_not_cudnn(ctx: EmulationContext) -> None:
    # Depthwise convs on PyTorch's own kernels need nothing extra; with cuDNN disabled, CUDA's
    # slow_conv2d / slow_conv_dilated2d allocate im2col columns oomkit does not model.
    if not torch.backends.cudnn.enabled:
        ctx.note_choice("non-cuDNN convolution")
        ctx.not_emulated(_SLOW_WHAT)
    else:
        ctx.note_choice("CUDA depthwise convolution")


def _transient_workspace(ctx: EmulationContext, cap: int | None) -> None:
    # Conv_v8.cpp run_conv_plan: allocate(workspace_size) before cudnnBackendExecute, freed when
    # the DataPtr goes out of scope at return. allocate(0) makes no block.
    ctx.note_choice("cuDNN convolution")
    if cap is not None and cap > 0:
        ctx.free(ctx.allocate(cap, "workspace", "cudnn_conv_workspace"))


def _convolution(ctx: EmulationContext, environ: Mapping[str, str] | None) -> Any:
    # Schema: (input, weight, bias, stride, padding, dilation, transposed, output_padding, groups).
    input, weight = ctx.args[0], ctx.args[1]
    transposed, groups = bool(ctx.args[6]), int(ctx.args[8])
    if not stands_for_cuda(input):
        return ctx.run()
    if not conv_runs_cudnn(input, weight, groups, transposed):
        _note_not_cudnn(ctx)
        return ctx.run()
    out = ctx.run()
    if out.numel() == 0:  # raw_cudnn_convolution_forward_out returns before any plan
        return out
    cap = conv_workspace_cap_bytes(environ)
    _note_mode(ctx, cap)
    # ConvShared.cpp cudnn_convolution: the output is allocated, then the plan runs.
    ctx.record_outputs(out)
    _transient_workspace(ctx, cap)
    if cap is None:
        ctx.not_emulated(_CONV_WHAT)
    return out


def _convolution_backward(ctx: EmulationContext, environ: Mapping[str, str] | None) -> Any:
    # Schema: (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    #          output_padding, groups, output_mask).
    grad_output, input, weight = ctx.args[0], ctx.args[1], ctx.args[2]
    transposed, groups = bool(ctx.args[7]), int(ctx.args[9])
    mask = list(ctx.args[10])
    if not stands_for_cuda(input):
        return ctx.run()
    if not conv_runs_cudnn(input, weight, groups, transposed):
        _note_not_cudnn(ctx)
        out = ctx.run()
        _bias_gradient(ctx, out, grad_output, mask)
        return out
    out = ctx.run()
    cap = conv_workspace_cap_bytes(environ)
    # ConvShared.cpp cudnn_convolution_backward: grad_output.to(input's suggested memory
    # format) first, then the input gradient, then the weight gradient, each after the copies
    # its function makes of tensors not in the layout cuDNN runs in (cudnn_convolution_backward_
    # input / _weight: x.contiguous(cudnn_conv_suggest_memory_format(...))), its tensor and its
    # plan's workspace; the copies are dropped when each function returns. Conv_v8.cpp skips an
    # empty gradient's plan.
    tensors = {"grad_output": grad_output, "input": input, "weight": weight}
    suggested = {name: suggest_memory_format(t) for name, t in tensors.items()}
    # .to(memory_format) aliases when the tensor already suggests that format (to_will_alias).
    copied_to = None
    held = []
    if suggested["grad_output"] != suggested["input"] and grad_output.numel() > 0:
        held.append(_layout_copy(ctx, grad_output))
        copied_to = suggested["grad_output"] = suggested["input"]

    def dense_in(name: str, fmt: torch.memory_format) -> bool:
        if name == "grad_output" and copied_to is not None:
            return fmt == copied_to
        return tensors[name].is_contiguous(memory_format=fmt)

    # (gradient, cudnn_conv_suggest_memory_format's (input, weight) roles, tensors made
    # contiguous in that layout, in order): cudnn_convolution_backward_input, then _weight.
    calls = (
        (0, ("grad_output", "weight"), ("grad_output", "weight")),
        (1, ("input", "grad_output"), ("grad_output", "input")),
    )
    runs = 0
    for index, (a, b), made_contiguous in calls:
        grad = out[index]
        if not mask[index] or grad is None:
            continue
        run_in = _cudnn_layout(tensors[a], tensors[b], suggested[a], suggested[b])
        copies = [
            _layout_copy(ctx, tensors[name])
            for name in made_contiguous
            if not dense_in(name, run_in) and tensors[name].numel() > 0
        ]
        ctx.record_outputs(grad)
        if grad.numel() > 0 and grad_output.numel() > 0:
            _transient_workspace(ctx, cap)
            runs += 1
        for alloc_id in reversed(copies):
            ctx.free(alloc_id)
    for alloc_id in held:
        ctx.free(alloc_id)
    if runs:
        _note_mode(ctx, cap)
        if cap is None:
            ctx.not_emulated(_CONV_WHAT)
    _bias_gradient(ctx, out, grad_output, mask)
    return out


def _cudnn_layout(
    a: Any, b: Any, a_format: torch.memory_format, b_format: torch.memory_format
) -> torch.memory_format:
    # ConvUtils.h cudnn_conv_suggest_memory_format(input=a, weight=b): never for float64;
    # channels last (2-D or 3-D by b's rank) where either suggests it, else contiguous.
    if torch.float64 in (a.dtype, b.dtype):
        return torch.contiguous_format
    if b.dim() == 4 and torch.channels_last in (a_format, b_format):
        return torch.channels_last
    if b.dim() == 5 and torch.channels_last_3d in (a_format, b_format):
        return torch.channels_last_3d
    return torch.contiguous_format


def _layout_copy(ctx: EmulationContext, tensor: Any) -> int:
    return ctx.allocate(tensor.numel() * tensor.element_size(), "temporary", "cudnn_layout_copy")


def _bias_gradient(ctx: EmulationContext, out: Any, grad_output: Any, mask: list[bool]) -> None:
    # Convolution.cpp convolution_backward: a backend that computes no bias gradient (cuDNN's
    # among them) leaves it to grad_output.sum over every dimension but the channels, after
    # the input and weight gradients: a reduction whose multi-block staging the sum's
    # emulation records (reductions.py).
    if len(mask) > 2 and mask[2] and isinstance(out, tuple) and isinstance(out[2], torch.Tensor):
        for index in (0, 1):
            if mask[index] and isinstance(out[index], torch.Tensor):
                ctx.record_outputs(out[index])
        dims = [0, *range(2, grad_output.dim())]
        record_reduction(ctx, grad_output, out[2], dims)


def _rnn(ctx: EmulationContext) -> Any:
    # RNN.cpp (native) lstm / gru / rnn_*: cudnn_is_acceptable(input) sends a CUDA input to
    # _cudnn_rnn when cuDNN is enabled.
    input = ctx.args[0] if ctx.args else None
    if (
        isinstance(input, torch.Tensor)
        and stands_for_cuda(input)
        and torch.backends.cudnn.enabled
    ):
        ctx.note_choice("cuDNN RNN")
        ctx.not_emulated(_RNN_WHAT)
        ctx.note_assumption(
            "cuDNN RNN",
            "workspace not recorded; reserve space stood in for by the reference "
            "implementation's saved per-step activations (sizes are cuDNN's at run time)",
        )
    return ctx.run()
