"""Embedding's flattened indices and backward's sort temporaries; cross-entropy as meta records
it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oomkit.prediction.tracing import TraceRecording, trace_step

EMB_BWD = "aten.embedding_dense_backward.default"


def _allocs(recording: TraceRecording, op: str) -> list[tuple[int, str | None]]:
    return [
        (e.size, dict(e.tags).get("emulated"))
        for e in recording.events
        if e.action == "alloc" and dict(e.tags).get("op") == op
    ]


def _embedding_step(embedding: torch.nn.Embedding, indices: torch.Tensor) -> None:
    embedding(indices).sum().backward()


def _embedding(**kwargs) -> torch.nn.Embedding:
    with torch.device("meta"):
        return torch.nn.Embedding(100, 16, **kwargs)


EMB = "aten.embedding.default"


def _forward_events(indices: torch.Tensor) -> list[tuple[str, int, str | None]]:
    """The forward lookup's requests: allocations (with what made them) and completed frees."""

    def step(embedding, indices):
        with torch.no_grad():
            embedding(indices)

    recording = trace_step(step, _embedding(), indices)
    return [(e.action, e.size, dict(e.tags).get("emulated") or dict(e.tags).get("op"))
            if e.action == "alloc" else (e.action, e.size, None)
            for e in recording.events[recording.step_starts[0]:]
            if e.action in ("alloc", "free_completed")]


def test_expanded_indices_are_copied_flat_before_the_lookup():
    """Embedding.cpp: index_select(0, indices.reshape(-1)); an expanded [8, 128] index tensor
    (BERT's token types) is copied (8 x 128 int64), the output allocated, then the copy freed,
    as the H200 recorded."""
    indices = torch.zeros(128, dtype=torch.long, device="meta").expand(8, 128)
    assert _forward_events(indices) == [
        ("alloc", 8 * 128 * 8, "embedding_indices"),
        ("alloc", 8 * 128 * 16 * 4, EMB),
        ("free_completed", 8 * 128 * 8, None),
        ("free_completed", 8 * 128 * 16 * 4, None),
    ]


def test_indices_that_view_flat_are_not_copied():
    """A contiguous [8, 128] index tensor, a 1-D one, and a transposed [128, 1] one (its size-1
    dimension does not count) reshape to a view: the output alone."""
    for indices in (
        torch.zeros(8, 128, dtype=torch.long, device="meta"),
        torch.zeros(1024, dtype=torch.long, device="meta"),
        torch.zeros(1, 128, dtype=torch.long, device="meta").t(),
    ):
        allocs = [event for event in _forward_events(indices) if event[0] == "alloc"]
        assert allocs == [("alloc", indices.numel() * 16 * 4, EMB)]


def test_embedding_backward_small_batch_has_no_sort():
    """3072 indices or fewer: grad_weight (100 x 16 fp32), after ``grad_.contiguous()``'s copy
    of the gradient, which ``sum().backward()`` hands over expanded (stride 0)."""
    indices = torch.zeros(3072, dtype=torch.long, device="meta")
    recording = trace_step(_embedding_step, _embedding(), indices)
    assert _allocs(recording, EMB_BWD) == [
        (3072 * 16 * 4, "embedding_grad_copy"),
        (100 * 16 * 4, None),
    ]


def test_embedding_backward_copies_indices_that_are_not_contiguous():
    """Embedding.cu ``indices_.contiguous()``: expanded token-type ids (BERT's) are copied, 8
    bytes each, before the gradient's copy; both freed after grad_weight, last first."""
    indices = torch.zeros(1, 256, dtype=torch.long, device="meta").expand(4, 256)
    recording = trace_step(_embedding_step, _embedding(), indices)
    assert _allocs(recording, EMB_BWD) == [
        (1024 * 8, "embedding_indices_copy"),
        (1024 * 16 * 4, "embedding_grad_copy"),
        (100 * 16 * 4, None),
    ]
    copies = {e.address for e in recording.events
              if e.action == "alloc" and dict(e.tags).get("emulated", "").endswith("_copy")
              and dict(e.tags).get("op") == EMB_BWD}
    freed = [e.size for e in recording.events
             if e.action == "free_requested" and e.address in copies]
    assert freed == [1024 * 16 * 4, 1024 * 8]


def test_embedding_backward_sort_path_temporaries():
    """3073 indices: sorted and original int64 indices live while grad_weight is allocated."""
    indices = torch.zeros(3073, dtype=torch.long, device="meta")
    recording = trace_step(_embedding_step, _embedding(), indices)
    assert _allocs(recording, EMB_BWD) == [
        (3073 * 16 * 4, "embedding_grad_copy"),
        (3073 * 8, "embedding_sorted_indices"),
        (3073 * 8, "embedding_orig_indices"),
        (100 * 16 * 4, None),
    ]
    freed = [
        e.size
        for e in recording.events
        if e.action == "free_requested" and dict(e.tags)["category"] == "temporary"
    ][:2]
    assert freed == [3073 * 8, 3073 * 8]


def test_embedding_backward_scale_grad_by_freq_adds_count():
    """scale_grad_by_freq always sorts and adds a count array, even for few indices."""
    indices = torch.zeros(10, dtype=torch.long, device="meta")
    recording = trace_step(_embedding_step, _embedding(scale_grad_by_freq=True), indices)
    assert [what for _, what in _allocs(recording, EMB_BWD)] == [
        "embedding_grad_copy",
        "embedding_sorted_indices",
        "embedding_orig_indices",
        "embedding_count",
        None,
    ]


def test_cross_entropy_saves_log_softmax_exactly():
    """Meta already matches CUDA: log_softmax [N, C] is saved; nll_loss makes two scalars."""
    logits = torch.randn(6, 10, device="meta", requires_grad=True)
    target = torch.zeros(6, dtype=torch.long, device="meta")

    def step(logits, target):
        F.cross_entropy(logits, target).backward()

    recording = trace_step(step, logits, target)
    log_softmax = [
        e
        for e in recording.events
        if e.action == "alloc" and dict(e.tags).get("op") == "aten._log_softmax.default"
    ]
    assert [(e.size, dict(e.tags).get("saved_for_backward")) for e in log_softmax] == [
        (6 * 10 * 4, "true")
    ]
    assert _allocs(recording, "aten.nll_loss_forward.default") == [(4, None), (4, None)]
    assert _allocs(recording, "aten.nll_loss_backward.default") == [(6 * 10 * 4, None)]
