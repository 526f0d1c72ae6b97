"""The recorder's leaf walk gives exactly pytree's leaves, in pytree's order."""

from __future__ import annotations

import collections

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves

from oomkit.prediction.tracing._leaves import leaves, tensor_leaves

Pair = collections.namedtuple("Pair", "first second")
_TENSORS = [torch.zeros(1), torch.nn.Parameter(torch.ones(2)), torch.empty(3, device="meta")]
_SCALARS = [0, 1.5, True, None, "s", torch.float16, torch.device("meta"), torch.Size([2, 3]),
            torch.channels_last, torch.strided]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


_trees = st.recursive(
    st.sampled_from(_TENSORS + _SCALARS),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=4),
        st.tuples(inner, inner).map(lambda t: Pair(*t)),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(_trees)
def test_leaves_equal_pytree_leaves(tree):
    """Every leaf pytree gives, the same objects in the same order; the tensors among them."""
    expected = tree_leaves(tree)
    assert _same(leaves(tree), expected)
    assert _same(tensor_leaves(tree), [x for x in expected if isinstance(x, torch.Tensor)])


def test_return_types_and_sizes_follow_pytree():
    """A ``torch.return_types`` result is flattened as pytree does; ``torch.Size`` stays a leaf
    or is flattened exactly as pytree treats it."""
    values, indices = torch.max(torch.ones(2, 3), 1)
    tree = ((torch.max(torch.ones(2, 3), 1), torch.Size([4])), {"k": [values, indices]})
    expected = tree_leaves(tree)
    assert _same(leaves(tree), expected)
    assert len(tensor_leaves(tree)) == 4
