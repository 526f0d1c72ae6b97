"""Where an emulated CUDA kernel picks its code path by a size: the site a recording notes.

Some kernels allocate temporaries on one path and nothing on another, and pick the path by a
size that grows with the batch: ``embedding_dense_backward`` sorts its indices above 3,072 of
them (aten/src/ATen/native/cuda/Embedding.cu). A recording made on one side of that size has
other events than one made on the other, so a batch search that learns from two sizes on one
side could not synthesize the other (``plan/trace_interpolation.py``). The emulation therefore
notes an ``EmulationSite`` at each call, on either path: its kind, the integers its choice and
its temporaries depend on, and the op output they sit around (``anchor``). ``SITE_PLANS`` gives,
for every kind, the temporaries of any such integers: the emulation allocates them through
it, and an interpolator that strips them from two recordings finds one structure on both sides
of the size, and puts them back at any batch.

It needs no torch itself, but importing it imports ``oomkit.prediction.tracing``, which does:
``plan/trace_interpolation.py`` imports it only where a recording has sites.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "EMBEDDING_BACKWARD_SITE",
    "EMBEDDING_SMALL_PATH_MAX_INDICES",
    "SITE_PLANS",
    "EmulationSite",
    "SitePlan",
    "embedding_backward_temporaries",
]

EMBEDDING_BACKWARD_SITE = "embedding_dense_backward"
# Embedding.cu embedding_dense_backward_cuda: the direct (unsorted) kernel's limit.
EMBEDDING_SMALL_PATH_MAX_INDICES = 3072
# The `emulated` tags of the sort path's temporaries (one place: the plan's names are these).
_SORTED_INDICES, _ORIG_INDICES, _COUNT = (
    "embedding_sorted_indices",
    "embedding_orig_indices",
    "embedding_count",
)


@dataclass(frozen=True)
class EmulationSite:
    """One call of an emulated kernel whose temporaries depend on a size.

    Attributes:
        kind: which plan (``SITE_PLANS``) gives its temporaries: ``"embedding_dense_backward"``.
        anchor: the index, in the recording's events, of the alloc of the op's output: the
            temporaries are allocated just before it and freed just after it, last first.
        params: the integers the temporaries depend on, in the plan's order.
    """

    kind: str
    anchor: int
    params: tuple[int, ...]


@dataclass(frozen=True)
class SitePlan:
    """The temporaries of one kind of site.

    Attributes:
        op: the aten overload (the ``op`` tag of the anchor and of the temporaries).
        category: the category of the temporaries.
        names: every ``emulated`` tag its temporaries may carry.
        temporaries: params -> (``emulated`` tag, bytes) of each temporary, in allocation
            order; empty on the path that allocates none.
    """

    op: str
    category: str
    names: frozenset[str]
    temporaries: Callable[[tuple[int, ...]], tuple[tuple[str, int], ...]]


def embedding_backward_temporaries(params: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
    """The sort path's temporaries of ``embedding_dense_backward_cuda`` (Embedding.cu).

    ``params``: (number of indices, bytes per index, 1 with ``scale_grad_by_freq`` else 0).
    ``num_indices <= 3072`` without ``scale_grad_by_freq``: one kernel accumulates straight into
    ``grad_weight``, nothing else. Otherwise ``sorted_indices`` and ``orig_indices``
    (``empty_like(indices)`` each, filled by a cub radix sort) and, with
    ``scale_grad_by_freq``, ``count`` (``empty_like(indices)``).
    """
    num_indices, index_bytes, scale_grad_by_freq = params
    if num_indices <= EMBEDDING_SMALL_PATH_MAX_INDICES and not scale_grad_by_freq:
        return ()
    nbytes = num_indices * index_bytes
    out = [(_SORTED_INDICES, nbytes), (_ORIG_INDICES, nbytes)]
    if scale_grad_by_freq:
        out.append((_COUNT, nbytes))
    return tuple(out)


SITE_PLANS: Mapping[str, SitePlan] = {
    EMBEDDING_BACKWARD_SITE: SitePlan(
        op="aten.embedding_dense_backward.default",
        category="temporary",
        names=frozenset({_SORTED_INDICES, _ORIG_INDICES, _COUNT}),
        temporaries=embedding_backward_temporaries,
    ),
}
