"""CUDA autocast's cast policy: which aten overloads it wraps, and how.

The lists mirror the ``AT_FORALL_*`` macros of ``aten/src/ATen/autocast_mode.h`` in torch 2.13
(read from the header the installed wheel ships, ``torch/include/ATen/autocast_mode.h``) and the
CUDA registrations of ``aten/src/ATen/autocast_mode.cpp`` (``TORCH_LIBRARY_IMPL(aten, Autocast,
m)``), which apply every list to CUDA plus ``cudnn_convolution``/``cudnn_convolution_transpose``
and ban ``binary_cross_entropy``. Names are aten overload names as the dispatcher registers them:
``"linear"`` is the default overload, ``"softmax.int"`` a named one. Only out-of-place overloads
are wrapped; in-place variants (``exp_``) and unlisted overloads (``softmax.Dimname``) run
uncast, as on CUDA. Other releases listed other ops (``ADDED_IN``, ``REMOVED_IN``);
``cuda_autocast_policy`` gives the table of a given torch version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

from oomkit.prediction.tracing._torch_version import torch_minor

__all__ = [
    "CastPolicy",
    "CAST_POLICIES",
    "ADDED_IN",
    "REMOVED_IN",
    "CUDA_AUTOCAST_POLICY",
    "cuda_autocast_policy",
    "FP32_APPEND_DTYPE_REDISPATCH",
    "BINARY_CROSS_ENTROPY_BANNED_MESSAGE",
    "cuda_cast_policy",
]

# autocast_mode.h enum class CastPolicy, plus "banned" for the ops autocast_mode.cpp refuses.
CastPolicy = Literal[
    "lower_precision_fp", "fp32", "fp32_set_opt_dtype", "fp32_append_dtype", "promote", "banned"
]
CAST_POLICIES: tuple[CastPolicy, ...] = get_args(CastPolicy)

# autocast_mode.h AT_FORALL_LOWER_PRECISION_FP, plus autocast_mode.cpp's CUDA-only
# KERNEL_CUDA(cudnn_convolution / cudnn_convolution_transpose, lower_precision_fp).
_LOWER_PRECISION_FP = (
    "_convolution.deprecated",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d.input",
    "conv_transpose3d.input",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
)

# autocast_mode.h AT_FORALL_FP32.
_FP32 = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "pow.Scalar",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm.dim",
    "nuclear_norm",
    "nuclear_norm.dim",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
)

# autocast_mode.h AT_FORALL_FP32_SET_OPT_DTYPE: run in fp32 by setting the op's own optional
# ``dtype`` argument (no input copy), unless the caller set it.
_FP32_SET_OPT_DTYPE = (
    "prod",
    "prod.dim_int",
    "softmax.int",
    "log_softmax.int",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord",
    "sum",
    "sum.dim_IntList",
)

# autocast_mode.h AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE: the norm overloads without a dtype
# redispatch to the dtype-taking overload with dtype=float32 (fp32_append_dtype).
FP32_APPEND_DTYPE_REDISPATCH: Mapping[str, str] = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    # Listed up to torch 2.12 only (REMOVED_IN).
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}

# autocast_mode.h AT_FORALL_PROMOTE: run in the widest floating dtype among the arguments.
_PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
)

# autocast_mode.cpp binary_cross_entropy_banned: the text PyTorch raises, word for word in meaning.
BINARY_CROSS_ENTROPY_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def _build() -> dict[str, CastPolicy]:
    table: dict[str, CastPolicy] = {}
    groups: tuple[tuple[tuple[str, ...], CastPolicy], ...] = (
        (_LOWER_PRECISION_FP, "lower_precision_fp"),
        (_FP32, "fp32"),
        (_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
        (("norm.Scalar", "norm.ScalarOpt_dim"), "fp32_append_dtype"),
        (_PROMOTE, "promote"),
        (("binary_cross_entropy",), "banned"),
    )
    for names, policy in groups:
        for name in names:
            assert name not in table, f"{name} is listed twice"
            table[name] = policy
    return table


# Registered overload name -> policy, for the CUDA autocast key.
CUDA_AUTOCAST_POLICY: Mapping[str, CastPolicy] = _build()


# How the lists differ in the releases since torch 2.5 (the oldest the recorder supports), read
# from each release's torch/include/ATen/autocast_mode.h (PyPI wheels 2.5.1, 2.6.0, 2.8.0,
# 2.10.0, 2.11.0, 2.12.0, 2.13.0). Overloads added after 2.5, with the release that added them:
# rms_norm joined AT_FORALL_FP32 in 2.12.
ADDED_IN: Mapping[str, tuple[int, int]] = {"rms_norm": (2, 12)}
# Overloads listed up to a release, with their policy and the release that dropped them: 2.13
# removed the named-tensor (Dimname) overloads from AT_FORALL_FP32_SET_OPT_DTYPE and
# AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE.
REMOVED_IN: Mapping[str, tuple[CastPolicy, tuple[int, int]]] = {
    "prod.dim_Dimname": ("fp32_set_opt_dtype", (2, 13)),
    "softmax.Dimname": ("fp32_set_opt_dtype", (2, 13)),
    "log_softmax.Dimname": ("fp32_set_opt_dtype", (2, 13)),
    "cumprod.dimname": ("fp32_set_opt_dtype", (2, 13)),
    "cumsum.dimname": ("fp32_set_opt_dtype", (2, 13)),
    "sum.dim_DimnameList": ("fp32_set_opt_dtype", (2, 13)),
    "norm.names_ScalarOpt_dim": ("fp32_append_dtype", (2, 13)),
}


def cuda_autocast_policy(torch_version: str) -> Mapping[str, CastPolicy]:
    """``CUDA_AUTOCAST_POLICY`` (torch 2.13's lists) as torch ``torch_version`` has it: without
    the overloads added after that release (``ADDED_IN``), with those it still listed
    (``REMOVED_IN``). A version that does not parse gets 2.13's table."""
    version = torch_minor(torch_version)
    if version is None:
        return CUDA_AUTOCAST_POLICY
    table = {
        name: policy
        for name, policy in CUDA_AUTOCAST_POLICY.items()
        if ADDED_IN.get(name, (0, 0)) <= version
    }
    for name, (policy, removed) in REMOVED_IN.items():
        if version < removed:
            table[name] = policy
    return table


def cuda_cast_policy(op_name: str) -> CastPolicy | None:
    """The CUDA autocast policy of one aten overload, or None when autocast lets it through.

    Args:
        op_name: ``"aten::softmax.int"``, ``"aten.softmax.int"``, ``"softmax.int"`` or, for a
            default overload, ``"linear"`` / ``"aten.linear.default"``.
    """
    name = op_name.removeprefix("aten::").removeprefix("aten.").removesuffix(".default")
    return CUDA_AUTOCAST_POLICY.get(name)
