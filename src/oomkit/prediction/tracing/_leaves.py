"""pytree's leaves of an op's arguments, without pytree's per-node dispatch for plain containers.

Every aten op's arguments and outputs are plain tuples, lists and dicts of tensors and scalars;
``torch.utils._pytree.tree_leaves`` looks each node's type up in its registry (namedtuple and
structseq checks included), which was a sixth of the recorder's time per op (issue 19 item 6).
These walk plain tuples, lists and dicts directly, in the order pytree's ``_tuple_flatten``,
``_list_flatten`` and ``_dict_flatten`` give (torch/utils/_pytree.py: items in order, a dict's
values in insertion order), and hand any other type to pytree itself: a registered one (a
namedtuple, ``torch.return_types``, an OrderedDict, a user's registered class) is flattened by
pytree, an unregistered one is a leaf, as there. The result is ``tree_leaves(tree)``'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_leaves

__all__ = ["leaves", "tensor_leaves"]

# Never pytree containers (unregistered, so leaves) and never tensors.
_SCALAR_TYPES = frozenset(
    {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
     torch.memory_format}
)
_PLAIN_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})


def leaves(tree: Any) -> list[Any]:
    """``tree_leaves(tree)``: every leaf, in pytree's order."""
    found: list[Any] = []
    _collect(tree, found, tensors_only=False)
    return found


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors among ``tree_leaves(tree)``, in the same order."""
    found: list[Any] = []
    _collect(tree, found, tensors_only=True)
    return found


def _collect(tree: Any, found: list[Any], *, tensors_only: bool) -> None:
    kind = type(tree)
    if kind is tuple or kind is list:
        for item in tree:
            _collect(item, found, tensors_only=tensors_only)
    elif kind is dict:
        for item in tree.values():
            _collect(item, found, tensors_only=tensors_only)
    elif kind in _PLAIN_TENSOR_TYPES:
        found.append(tree)
    elif kind in _SCALAR_TYPES:
        if not tensors_only:
            found.append(tree)
    elif kind not in SUPPORTED_NODES and isinstance(tree, torch.Tensor):
        found.append(tree)  # a tensor subclass (FakeTensor, DTensor): a leaf, as in pytree
    elif tensors_only:
        found.extend(leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor))
    else:
        found.extend(tree_leaves(tree))
