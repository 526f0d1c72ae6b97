"""Which kernel ``scaled_dot_product_attention`` runs on a CUDA device: PyTorch's choice, replayed.

Mirrors ``sdp::select_sdp_backend`` in aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and
the shared checks in aten/src/ATen/native/transformers/sdp_utils_cpp.h, for dense (not nested)
inputs on NVIDIA GPUs, as of the torch 2.13 release:

- priority order: ``flash, efficient, math, cudnn`` (``at::Context`` default ``sDPPriorityOrder``),
  so cuDNN attention is never reached while math is enabled; except that
  ``check_prefer_cudnn_attention`` puts cuDNN first on sm90 / sm100 / sm103 when the runtime cuDNN
  is newer than 9.15.0 (CUDA 13 wheels) and ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is unset. The
  cuDNN version is not visible from a GPU name, so it is a setting (``SdpaSettings``) whose
  default is the cuDNN this torch install runs (``cudnn_builds.installed_cudnn_build``).
- every backend is tried in that order; the first whose ``can_use_*`` checks all pass wins.

Not modelled: nested tensors, ROCm, FlashAttention-3 opt-in dtypes, user-set priority orders.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

from oomkit.errors import ConfigError
from oomkit.prediction.tracing.emulations.cudnn_builds import installed_cudnn_build

__all__ = [
    "SdpBackend",
    "SdpaCall",
    "SdpaSettings",
    "cudnn_version_decides",
    "current_sdpa_settings",
    "default_sdpa_settings",
    "select_sdp_backend",
    "use_sdpa_settings",
]

SdpBackend = Literal["cudnn_attention", "flash_attention", "efficient_attention", "math"]

# sdp_utils.cpp check_prefer_cudnn_attention: cuDNN SDPA is preferred from cuDNN 9.15.1 on
# (``cudnn_version > 91500``), on compute capability 9.0, 10.0 and 10.3 only.
_PREFER_CUDNN_AFTER_VERSION = 91500
_DEFAULT_ORDER: tuple[SdpBackend, ...] = (
    "flash_attention",
    "efficient_attention",
    "math",
    "cudnn_attention",
)
_CUDNN_FIRST_ORDER: tuple[SdpBackend, ...] = (
    "cudnn_attention",
    "flash_attention",
    "efficient_attention",
    "math",
)
_HALF_DTYPES = frozenset({"float16", "bfloat16"})


@dataclass(frozen=True)
class SdpaSettings:
    """The process-wide switches that steer the backend choice.

    Attributes:
        cudnn_version: ``torch.backends.cudnn.version()`` on the target (e.g. ``92000`` for
            9.20.0); ``None`` for no cuDNN or an unknown one, where cuDNN attention is never
            preferred. ``default_sdpa_settings()`` fills in this install's.
        cudnn_deprioritized: ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` is set.
        flash_enabled / mem_efficient_enabled / math_enabled / cudnn_enabled: the
            ``torch.backends.cuda.enable_*_sdp`` switches (all on by default).
        deterministic: ``torch.use_deterministic_algorithms(True)`` (not warn-only).
    """

    cudnn_version: int | None = None
    cudnn_deprioritized: bool = False
    flash_enabled: bool = True
    mem_efficient_enabled: bool = True
    math_enabled: bool = True
    cudnn_enabled: bool = True
    deterministic: bool = False


# The settings a hook registered without its own uses: what ``use_sdpa_settings`` set in this
# context, else the defaults (as torch.backends.cuda's sdp switches are process state). A user
# switch only: oomkit's own callers pass a Target's cuDNN version explicitly (register_sdpa).
_CURRENT: ContextVar[SdpaSettings | None] = ContextVar("oomkit_sdpa_settings", default=None)


def default_sdpa_settings() -> SdpaSettings:
    """PyTorch's defaults, with the cuDNN this torch install runs (its own, or the one its
    version's default PyPI Linux wheel pins; ``cudnn_builds.installed_cudnn_build``)."""
    return SdpaSettings(cudnn_version=installed_cudnn_build().version)


def current_sdpa_settings() -> SdpaSettings:
    """The SDPA settings in effect here (``use_sdpa_settings``, else ``default_sdpa_settings()``)."""
    return _CURRENT.get() or default_sdpa_settings()


def cudnn_version_decides(compute_capability: tuple[int, int]) -> bool:
    """Whether the cuDNN version can move cuDNN attention first on this GPU (sm90, sm100,
    sm103: sdp_utils.cpp check_prefer_cudnn_attention)."""
    major, minor = compute_capability
    return major in (9, 10) and minor in (0, 3)


@contextlib.contextmanager
def use_sdpa_settings(settings: SdpaSettings) -> Iterator[SdpaSettings]:
    """Trace with ``settings`` inside the block, e.g. the target's cuDNN version::

    with use_sdpa_settings(SdpaSettings(cudnn_version=91501)):
        oomkit.predict(step, model, gpu="h100")   # cuDNN attention, as on that machine
    """
    token = _CURRENT.set(settings)
    try:
        yield settings
    finally:
        _CURRENT.reset(token)


@dataclass(frozen=True)
class SdpaCall:
    """What the checks read from one ``scaled_dot_product_attention`` call.

    Attributes:
        query_shape / key_shape / value_shape: tensor sizes, ``(B, H, L, E)`` when dense 4-D.
        dtype: the query dtype name, ``"float16"``, ``"bfloat16"``, ``"float32"``...
        has_attn_mask: an ``attn_mask`` was passed.
        dropout_p: dropout probability.
        is_causal: ``is_causal=True``.
        enable_gqa: ``enable_gqa=True``.
        requires_grad: grad mode is on and q, k or v requires grad (``input_requires_grad``).
        last_dim_contiguous: q, k and v all have stride 1 in their last dimension.
    """

    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    dtype: str
    has_attn_mask: bool = False
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = False
    last_dim_contiguous: bool = True


def select_sdp_backend(
    call: SdpaCall, compute_capability: tuple[int, int], settings: SdpaSettings | None = None
) -> SdpBackend:
    """The backend CUDA runs for ``call`` on a device of ``compute_capability``.

    Args:
        call: the call's shapes, dtype and flags.
        compute_capability: ``(major, minor)`` of the target GPU, e.g. ``(9, 0)`` for H100.
        settings: process switches; default ``SdpaSettings()`` (no cuDNN version, so cuDNN
            attention is not preferred; the tracer passes ``current_sdpa_settings()``).

    Returns:
        ``"cudnn_attention"``, ``"flash_attention"``, ``"efficient_attention"`` or ``"math"``.

    Raises:
        ValueError: every backend is disabled or fails its checks (PyTorch raises
            "No available kernel. Aborting execution." there).
    """
    settings = settings or SdpaSettings()
    for backend in _priority_order(compute_capability, settings):
        if backend == "cudnn_attention" and _can_use_cudnn(call, compute_capability, settings):
            return backend
        if backend == "flash_attention" and _can_use_flash(call, compute_capability, settings):
            return backend
        if backend == "efficient_attention" and _can_use_efficient(
            call, compute_capability, settings
        ):
            return backend
        if backend == "math" and settings.math_enabled:
            return backend
    raise ConfigError(
        "no scaled_dot_product_attention backend can run this call on compute capability "
        f"{compute_capability[0]}.{compute_capability[1]} with the enabled backends; enable the "
        "math backend (SdpaSettings(math_enabled=True)) or change the inputs"
    )


def _priority_order(cc: tuple[int, int], settings: SdpaSettings) -> tuple[SdpBackend, ...]:
    # sdp_utils.cpp check_prefer_cudnn_attention / priority_order.
    prefer_cudnn = (
        not settings.cudnn_deprioritized
        and settings.cudnn_version is not None
        and settings.cudnn_version > _PREFER_CUDNN_AFTER_VERSION
        and cudnn_version_decides(cc)
    )
    return _CUDNN_FIRST_ORDER if prefer_cudnn else _DEFAULT_ORDER


def _in_sm_range(cc: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    # sdp_utils.cpp check_sm_version: inclusive on both ends.
    return low <= cc <= high


def _dense_4d(call: SdpaCall) -> bool:
    # sdp_utils_cpp.h check_tensor_shapes: query, key and value must all be 4-D.
    return len(call.query_shape) == len(call.key_shape) == len(call.value_shape) == 4


def _nonzero_seq_lens(call: SdpaCall) -> bool:
    # sdp_utils_cpp.h check_nonzero_sequence_lengths_dense.
    return call.query_shape[-2] > 0 and call.key_shape[-2] > 0


def _batch_and_heads_ok(call: SdpaCall, *, supports_gqa: bool, same_heads: bool) -> bool:
    # sdp_utils_cpp.h check_batch_size_and_num_heads_dense and check_grouped_query_attention.
    (qb, qh), (kb, kh), (vb, vh) = call.query_shape[:2], call.key_shape[:2], call.value_shape[:2]
    if not qb == kb == vb:
        return False
    if call.enable_gqa and supports_gqa:
        return kh == vh and kh > 0 and qh % kh == 0
    if same_heads:
        return qh == kh == vh
    return True


def _can_use_flash(call: SdpaCall, cc: tuple[int, int], settings: SdpaSettings) -> bool:
    # sdp_utils.cpp can_use_flash_attention, checks in PyTorch's order.
    if not settings.flash_enabled or not _dense_4d(call) or call.has_attn_mask:
        return False
    head_q, head_k, head_v = call.query_shape[-1], call.key_shape[-1], call.value_shape[-1]
    # check_head_dim_size_flash: equal head dims, at most 256.
    if not (head_q == head_k == head_v and head_q <= 256):
        return False
    # check_flash_attention_hardware_support: sm80 to sm121.
    if not _in_sm_range(cc, (8, 0), (12, 1)):
        return False
    # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120.
    small_smem = _in_sm_range(cc, (8, 6), (8, 9)) or _in_sm_range(cc, (12, 0), (12, 1))
    too_big = (192 < head_q <= 224) or (head_q > 224 and call.dropout_p > 0.0)
    if call.requires_grad and small_smem and too_big:
        return False
    # check_flash_causal_non_square_seqlens.
    if call.is_causal and call.query_shape[-2] != call.key_shape[-2]:
        return False
    # check_dtypes_flash_attention (FA3's float8 opt-in not modelled): fp16/bf16 on sm80+.
    if call.dtype not in _HALF_DTYPES:
        return False
    return (
        _batch_and_heads_ok(call, supports_gqa=True, same_heads=True)
        and _nonzero_seq_lens(call)
        and call.last_dim_contiguous
    )


def _mem_efficient_alignment(call: SdpaCall, cc: tuple[int, int]) -> int:
    # sdp_utils.cpp minimum_gemm_alignment with use_tensor_cores.
    is_half = call.dtype in _HALF_DTYPES
    use_tensor_cores = cc[0] >= 8 or (cc[0] >= 7 and is_half)
    alignment = 4 if cc[0] >= 8 else 1
    if use_tensor_cores:
        alignment = max(alignment, 128 // (16 if is_half else 32))
    return alignment


def _can_use_efficient(call: SdpaCall, cc: tuple[int, int], settings: SdpaSettings) -> bool:
    # sdp_utils.cpp can_use_mem_efficient_attention.
    if not settings.mem_efficient_enabled:
        return False
    # check_mem_efficient_hardware_support: sm50 to sm121.
    if not _in_sm_range(cc, (5, 0), (12, 1)) or not _dense_4d(call):
        return False
    # check_head_dim_size_mem_efficient.
    align = _mem_efficient_alignment(call, cc)
    head_q, head_k, head_v = call.query_shape[-1], call.key_shape[-1], call.value_shape[-1]
    if not (head_q == head_k and head_q % align == 0 and head_q > 0):
        return False
    if not (head_v % align == 0 and head_v > 0):
        return False
    # Dense constraints; no grouped-query support (q, k, v need the same number of heads).
    if not (
        _nonzero_seq_lens(call)
        and call.last_dim_contiguous
        and _batch_and_heads_ok(call, supports_gqa=False, same_heads=True)
    ):
        return False
    dtypes = {"float16", "float32", "bfloat16"} if cc[0] >= 8 else {"float16", "float32"}
    return call.dtype in dtypes


def _can_use_cudnn(call: SdpaCall, cc: tuple[int, int], settings: SdpaSettings) -> bool:
    # sdp_utils.cpp can_use_cudnn_attention; needs a known cuDNN version.
    version = settings.cudnn_version
    if version is None or version < 90000 or not settings.cudnn_enabled:
        return False
    if call.dropout_p > 0.0 and 91100 < version < 91400:
        return False
    if settings.deterministic or not _dense_4d(call):
        return False
    # check_dtypes_low_precision and check_cudnn_hardware_support.
    if call.dtype not in _HALF_DTYPES or not _in_sm_range(cc, (8, 0), (12, 1)):
        return False
    if not (
        _nonzero_seq_lens(call)
        and call.last_dim_contiguous
        and _batch_and_heads_ok(call, supports_gqa=True, same_heads=False)
    ):
        return False
    # check_cudnn_tensor_shapes.
    s_q, s_k = call.query_shape[2], call.key_shape[2]
    d_qk, d_v = call.query_shape[3], call.value_shape[3]
    limit = 256 if (version >= 91000 and cc == (9, 0)) else 128
    if version >= 91100 and cc[0] == 10 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    return s_k != 1 and not (s_q == 1 and call.dropout_p > 0.0)
