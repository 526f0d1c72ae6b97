"""Backward formulas that run in place on CUDA but out of place on meta (and under any mode).

ATen's ``isTensorSubclassLike`` (aten/src/ATen/TensorSubclassLikeUtils.h) is true for every meta
tensor (``MetaBit`` is in ``kTensorSubclassLike``) and for every tensor while a dispatch mode is
active (``c10::impl::dispatch_mode_enabled()``), so the tracer always sees the out-of-place
("composite compliant") branch of the formulas guarded by it. CUDA with plain tensors takes the
other branch, which writes into a temporary the formula has just made instead of allocating a new
output. Each hook below runs inside the named autograd node (``torch._C._current_autograd_node``)
and does what the CUDA branch does: the in-place op on its first argument, returned as the result,
so no new buffer is recorded. The full audit (every branch, whether it differs, what is emulated)
is docs/explanations/meta-vs-cuda.md. Sources: torch/csrc/autograd/FunctionsManual.cpp and
aten/src/ATen/native/TensorAdvancedIndexing.cpp (read at pytorch/pytorch 002ca67, functions named),
and the node's formula in tools/autograd/derivatives.yaml (torch 2.13's packaged copy,
torchgen/packaged/autograd/derivatives.yaml, line given per branch).

A hook applies only when

- grad mode is off (``create_graph=False``): the double-backward formulas and the
  ``GradMode::is_enabled()`` guards of ``binary_cross_entropy_with_logits_backward`` take the
  out-of-place branch on CUDA too, and a checkpoint recomputation (which runs with grad enabled
  inside a backward node) is never rewritten;
- the first argument was allocated during backward (a temporary of the formula, never a tensor
  the formula was given, such as ``pos_weight``), and writing the result into it needs no
  broadcast of it and no dtype it cannot hold, as the CUDA in-place op requires.

Not emulated, with a warning: branches whose CUDA path depends on the data (``prod_backward``:
``(input == 0).nonzero()``; ``masked_fill_backward``: ``masked_select``) or that rebuild a whole
buffer differently (``linalg_matrix_exp_differential``, ``householder_product_backward``); the
target gradient of ``binary_cross_entropy_with_logits``. For these, meta's recording stands.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import (
        EmulationContext,
        EmulationRegistry,
        OpEmulation,
    )

__all__ = [
    "INPLACE_BRANCHES",
    "NOT_EMULATED_BRANCHES",
    "InPlaceBranch",
    "register_inplace_backward",
]

_aten = torch.ops.aten


@dataclass(frozen=True)
class InPlaceBranch:
    """One out-of-place call that CUDA makes in place inside one autograd node.

    Attributes:
        node: the autograd node's class name (``"GatherBackward0"``).
        op: the out-of-place aten overload meta runs (``"aten.scatter_add.default"``).
        inplace: runs CUDA's in-place op on ``(args, kwargs)`` and returns ``args[0]``.
        elementwise: a binary elementwise op: the result must keep ``args[0]``'s shape and
            dtype for CUDA's in-place op to apply.
        source: the formula it mirrors, for reports and the audit.
    """

    node: str
    op: str
    inplace: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    elementwise: bool
    source: str


def _same(inplace_op: Any) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    # The in-place overload takes the same arguments as the out-of-place one.
    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return inplace_op(*args, **kwargs)

    return run


def _index_put_impl(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # FunctionsManual.cpp index_backward: at::_index_put_impl_(zeros_like_self, indices, grad,
    # /*accumulate=*/true, /*unsafe=*/true).
    bound = dict(zip(("self", "indices", "values", "accumulate"), args, strict=False))
    bound.update(kwargs)
    return _aten._index_put_impl_.default(
        bound["self"], bound["indices"], bound["values"], bool(bound.get("accumulate")), True
    )


def _diagonal_copy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # FunctionsManual.cpp linalg_eig_backward: ret.diagonal(0, -2, -1).copy_(gL).
    bound = dict(zip(("self", "src", "offset", "dim1", "dim2"), args, strict=False))
    bound.update(kwargs)
    ret = bound["self"]
    ret.diagonal(bound.get("offset", 0), bound.get("dim1", 0), bound.get("dim2", 1)).copy_(
        bound["src"]
    )
    return ret


_DY = "derivatives.yaml"
_FM = "FunctionsManual.cpp"
_TAI = "TensorAdvancedIndexing.cpp"

# Every branch that differs and is emulated (docs/explanations/meta-vs-cuda.md has the rest).
INPLACE_BRANCHES: tuple[InPlaceBranch, ...] = (
    InPlaceBranch(
        "GatherBackward0", "aten.scatter_add.default", _same(_aten.scatter_add_.default), False,
        f"{_TAI} gather_backward ({_DY}:731): result.scatter_add_(dim, index, grad)",
    ),
    InPlaceBranch(
        "IndexBackward0", "aten.index_put.default", _index_put_impl, False,
        f"{_FM} index_backward ({_DY}:844): at::_index_put_impl_(zeros, indices, grad, true, true)",
    ),
    InPlaceBranch(
        "IndexSelectBackward0", "aten.index_add.default", _same(_aten.index_add_.default), False,
        f"{_TAI} index_select_backward_symint ({_DY}:911): new_zeros(...).index_add_(...)",
    ),
    InPlaceBranch(
        "TakeBackward0", "aten.put.default", _same(_aten.put_.default), False,
        f"{_FM} take_backward ({_DY}:1767): grad_self.put_(indices, grad, true)",
    ),
    InPlaceBranch(
        "ClampBackward0", "aten.logical_and.default", _same(_aten.logical_and_.default), True,
        f"{_FM} clamp_backward / clamp_backward_min_max ({_DY}:424-425): logical_and_",
    ),
    InPlaceBranch(
        "ClampBackward0", "aten.logical_or.default", _same(_aten.logical_or_.default), True,
        f"{_FM} clamp_backward_min_max ({_DY}:425): self_gt_max.logical_or_(max_lt_min)",
    ),
    *(
        InPlaceBranch(
            node, "aten.logical_and.default", _same(_aten.logical_and_.default), True,
            f"{_FM} evenly_distribute_backward ({_DY}:{line}): input_isnan.logical_and_(...)",
        )
        for node, line in (
            ("MaxBackward1", 1130),
            ("MedianBackward0", 1158),
            ("NanmedianBackward0", 1162),
            ("MinBackward1", 1192),
        )
    ),
    InPlaceBranch(
        "BinaryCrossEntropyBackward0", "aten.mul.Tensor", _same(_aten.mul_.Tensor), True,
        f"{_FM} binary_cross_entropy_target_backward ({_DY}:2023): grad_target.mul_(...)",
    ),
    InPlaceBranch(
        "BinaryCrossEntropyWithLogitsBackward0", "aten.sub.Tensor", _same(_aten.sub_.Tensor),
        True,
        f"{_FM} binary_cross_entropy_with_logits_backward ({_DY}:2038): sub_ / mul_ chain",
    ),
    InPlaceBranch(
        "BinaryCrossEntropyWithLogitsBackward0", "aten.mul.Tensor", _same(_aten.mul_.Tensor),
        True,
        f"{_FM} binary_cross_entropy_with_logits_backward ({_DY}:2038): sub_ / mul_ chain",
    ),
    *(
        InPlaceBranch(
            node, "aten.diagonal_scatter.default", _diagonal_copy, False,
            f"{_FM} linalg_eig_backward ({_DY}:{line}): ret.diagonal(0, -2, -1).copy_(gL)",
        )
        for node, line in (("LinalgEighBackward0", 1736), ("LinalgEigBackward0", 1740))
    ),
)

# Branches that differ but are not emulated: (node, an op every call of the branch runs on meta)
# -> what stays as meta records it. A call adds a warning to the recording.
NOT_EMULATED_BRANCHES: dict[tuple[str, str], str] = {
    # FunctionsManual.cpp prod_backward: CUDA picks its path from (input == 0).nonzero().
    ("ProdBackward0", "aten.cumprod.default"): (
        "prod backward's CUDA branch, chosen by whether the input holds zeros (meta records the "
        "zero-safe cumprod path, at most a few input-sized temporaries more)"
    ),
    ("ProdBackward1", "aten.cumprod.default"): (
        "prod backward's CUDA branch, chosen by whether the input holds zeros (meta records the "
        "zero-safe cumprod path, at most a few input-sized temporaries more)"
    ),
    # FunctionsManual.cpp masked_fill_backward: CUDA runs grad.masked_select(mask).sum().
    ("MaskedFillBackward1", "aten.where.self"): (
        "masked_fill's value gradient: CUDA's masked_select, sized by the mask's contents (meta "
        "records one grad-sized where buffer)"
    ),
    # FunctionsManual.cpp differential_analytic_matrix_function: zeros [2n, 2n] + copy_ on CUDA.
    ("LinalgMatrixExpBackward0", "aten.cat.default"): (
        "matrix_exp backward's zeros-and-copy buffer (meta's cats add two [n, 2n] temporaries)"
    ),
    # FunctionsManual.cpp householder_product_backward: zeros_like + copy_ per column on CUDA.
    ("LinalgHouseholderProductBackward0", "aten.cat.default"): (
        "householder_product backward's in-place gradient buffers (meta concatenates per-column "
        "gradients)"
    ),
}

_TARGET_GRAD_WHAT = (
    "binary_cross_entropy_with_logits' target gradient in place (FunctionsManual.cpp "
    "binary_cross_entropy_with_logits_target_backward)"
)


def _current_node() -> Any:
    current = getattr(torch._C, "_current_autograd_node", None)
    return None if current is None else current()


def register_inplace_backward(registry: EmulationRegistry) -> None:
    """Add a hook for every op in ``INPLACE_BRANCHES`` and ``NOT_EMULATED_BRANCHES``."""
    by_op: dict[str, dict[str, InPlaceBranch]] = {}
    for branch in INPLACE_BRANCHES:
        by_op.setdefault(branch.op, {})[branch.node] = branch
    warned_by_op: dict[str, dict[str, str]] = {}
    for (node, op), what in NOT_EMULATED_BRANCHES.items():
        warned_by_op.setdefault(op, {})[node] = what

    for op in sorted({*by_op, *warned_by_op}):
        registry.register(op)(_make_hook(by_op.get(op, {}), warned_by_op.get(op, {})))


def _make_hook(branches: dict[str, InPlaceBranch], warned: dict[str, str]) -> OpEmulation:
    def hook(ctx: EmulationContext) -> Any:
        node = _current_node()
        if node is None:
            return ctx.run()
        name = type(node).__name__
        what = warned.get(name)
        if what is not None:
            ctx.not_emulated(what)
            return ctx.run()
        branch = branches.get(name)
        if branch is None or torch.is_grad_enabled() or not _applies(ctx, branch, node):
            return ctx.run()
        return branch.inplace(ctx.args, ctx.kwargs)

    return hook


def _applies(ctx: EmulationContext, branch: InPlaceBranch, node: Any) -> bool:
    self = ctx.args[0] if ctx.args else ctx.kwargs.get("self")
    if not isinstance(self, torch.Tensor) or ctx.allocation_phase(self) != "backward":
        return False
    if branch.node == "BinaryCrossEntropyWithLogitsBackward0":
        # The target's gradient (next_functions[1]) has its own branches; left as meta runs it.
        edges = node.next_functions
        if len(edges) > 1 and edges[1][0] is not None:
            ctx.not_emulated(_TARGET_GRAD_WHAT)
            return False
    if not branch.elementwise:
        return True
    if branch.op.startswith("aten.logical_") and self.dtype != torch.bool:
        return False  # the out-of-place result is bool; in place it would keep self's dtype
    other = ctx.args[1] if len(ctx.args) > 1 else ctx.kwargs.get("other")
    if isinstance(other, torch.Tensor):
        if torch.broadcast_shapes(self.shape, other.shape) != self.shape:
            return False
        result_dtype = torch.result_type(self, other)
    else:
        result_dtype = torch.result_type(self, other) if other is not None else self.dtype
    return torch.can_cast(result_dtype, self.dtype)
