"""Backward formulas recorded with CUDA's in-place branch, not meta's out-of-place one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oomkit.prediction.tracing import EmulationRegistry, TraceRecording, trace_step
from oomkit.prediction.tracing.emulations import INPLACE_BRANCHES, NOT_EMULATED_BRANCHES

F32 = 4
META_ONLY = EmulationRegistry()  # no hooks: what the meta device records by itself


def _backward_allocs(recording: TraceRecording) -> list[tuple[str | None, int]]:
    return [
        (dict(e.tags).get("op"), e.size)
        for e in recording.events
        if e.action == "alloc" and dict(e.tags)["phase"] == "backward"
    ]


def _param(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="meta", requires_grad=True)


def _long(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.long, device="meta")


def test_gather_backward_scatters_into_its_zeros():
    """gather [8, 100] fp32: one 3200 B grad buffer (meta adds a second); peak hand-counted."""
    x, idx = _param(8, 100), _long(8, 1)

    def step(x, i):
        x.gather(1, i).sum().backward()

    cuda = trace_step(step, x, idx)
    assert _backward_allocs(cuda) == [("aten.new_zeros.default", 8 * 100 * F32)]
    # x 3200 + idx 64 + loss 4 + grad seed 4 + grad buffer 3200 (gather's [8, 1] output is
    # freed once sum has run: SumBackward0 saves nothing).
    assert cuda.peak_allocated_bytes() == 3200 + 64 + 4 + 4 + 3200
    meta = trace_step(step, x, idx, emulations=META_ONLY)
    assert _backward_allocs(meta) == [
        ("aten.new_zeros.default", 3200),
        ("aten.scatter_add.default", 3200),
    ]
    assert meta.peak_allocated_bytes() - cuda.peak_allocated_bytes() == 3200
    assert cuda.warnings == ()


def test_gather_log_prob_of_logits_saves_one_logits_buffer():
    """log_softmax(logits).gather (an RL loss): the backward holds one [B, V] buffer, not two."""
    logits, labels = _param(4, 1000), _long(4, 1)

    def step(logits, labels):
        logits.log_softmax(-1).gather(-1, labels).mean().backward()

    cuda = _backward_allocs(trace_step(step, logits, labels))
    meta = _backward_allocs(trace_step(step, logits, labels, emulations=META_ONLY))
    assert ("aten.scatter_add.default", 4 * 1000 * F32) in meta
    assert [op for op, _ in cuda].count("aten.scatter_add.default") == 0
    assert sum(size for _, size in meta) - sum(size for _, size in cuda) == 4 * 1000 * F32


@pytest.mark.parametrize(
    ("name", "forward", "zeros_op", "meta_op"),
    [
        ("index", lambda x, i: x[i], "aten.new_zeros.default", "aten.index_put.default"),
        (
            "index_select",
            lambda x, i: x.index_select(0, i),
            "aten.new_zeros.default",
            "aten.index_add.default",
        ),
        ("take", lambda x, i: x.take(i), "aten.zeros_like.default", "aten.put.default"),
    ],
)
def test_indexing_backwards_accumulate_in_place(name, forward, zeros_op, meta_op):
    """x[idx], index_select, take on [4, 10] fp32: one 160 B zeros buffer, written in place."""
    x, idx = _param(4, 10), _long(3)

    def step(x, i):
        forward(x, i).sum().backward()

    assert _backward_allocs(trace_step(step, x, idx)) == [(zeros_op, 160)]
    assert _backward_allocs(trace_step(step, x, idx, emulations=META_ONLY)) == [
        (zeros_op, 160),
        (meta_op, 160),
    ]


def test_clamp_with_tensor_bounds_ands_in_place():
    """clamp(x, lo, hi) [4, 10]: ge/le bool masks (40 B each) and the where; no third mask."""
    x = _param(4, 10)
    lo, hi = torch.zeros(4, 10, device="meta"), torch.ones(4, 10, device="meta")

    def step(x, lo, hi):
        x.clamp(lo, hi).sum().backward()

    assert _backward_allocs(trace_step(step, x, lo, hi)) == [
        ("aten.scalar_tensor.default", 4),
        ("aten.ge.Tensor", 40),
        ("aten.le.Tensor", 40),
        ("aten.where.self", 160),
    ]
    meta = _backward_allocs(trace_step(step, x, lo, hi, emulations=META_ONLY))
    assert ("aten.logical_and.default", 40) in meta


def test_clamp_bound_gradients_and_or_in_place():
    """With lo and hi requiring grad, clamp_backward_min_max's and/or masks are not allocated."""
    x, lo, hi = _param(4, 10), _param(4, 10), _param(4, 10)

    def step(x, lo, hi):
        x.clamp(lo, hi).sum().backward()

    ops = [op for op, _ in _backward_allocs(trace_step(step, x, lo, hi))]
    assert "aten.logical_and.default" not in ops
    assert "aten.logical_or.default" not in ops
    meta_ops = [op for op, _ in _backward_allocs(trace_step(step, x, lo, hi, emulations=META_ONLY))]
    assert meta_ops.count("aten.logical_and.default") == 2
    assert meta_ops.count("aten.logical_or.default") == 1


@pytest.mark.parametrize("reduce", [torch.max, torch.min, torch.median, torch.nanmedian])
def test_full_reductions_distribute_evenly_in_place(reduce):
    """max()/min()/median() [4, 10]: isnan masks 40 B + 1 B, eq 40 B, no logical_and buffer;
    the bool mask's sum into int64 reads the mask as int64, a 320-byte copy on CUDA."""
    x = _param(4, 10)

    def step(x):
        reduce(x).backward()

    assert _backward_allocs(trace_step(step, x)) == [
        ("aten.isnan.default", 40),
        ("aten.isnan.default", 1),
        ("aten.eq.Tensor", 40),
        ("aten.sum.default", 8),
        ("aten.sum.default", 320),
        ("aten.div.Tensor", 4),
        ("aten.mul.Tensor", 160),
    ]


def test_binary_cross_entropy_target_gradient_multiplies_in_place():
    """BCE with a target that requires grad: logit() is the only [4, 10] target temporary."""
    p, t = _param(4, 10), _param(4, 10)

    def step(p, t):
        F.binary_cross_entropy(p.sigmoid(), t).backward()

    cuda = _backward_allocs(trace_step(step, p, t))
    assert ("aten.logit.default", 160) in cuda
    assert "aten.mul.Tensor" not in [op for op, _ in cuda]
    meta = _backward_allocs(trace_step(step, p, t, emulations=META_ONLY))
    assert ("aten.mul.Tensor", 160) in meta


def test_bce_with_logits_backward_is_one_buffer():
    """BCEWithLogits [4, 10]: sigmoid's 160 B, then sub_ / mul_ / div_ in place."""
    x, t = _param(4, 10), torch.rand(4, 10, device="meta")

    def step(x, t):
        F.binary_cross_entropy_with_logits(x, t).backward()

    assert _backward_allocs(trace_step(step, x, t)) == [("aten.sigmoid.default", 160)]
    assert _backward_allocs(trace_step(step, x, t, emulations=META_ONLY)) == [
        ("aten.sigmoid.default", 160),
        ("aten.sub.Tensor", 160),
        ("aten.mul.Tensor", 160),
    ]


def test_bce_with_logits_pos_weight_product_stays_out_of_place():
    """pos_weight [4, 10]: t = pos_weight * target is new on CUDA too; the chain after is not."""
    x, t = _param(4, 10), torch.rand(4, 10, device="meta")
    w, pw = torch.rand(10, device="meta"), torch.rand(4, 10, device="meta")

    def step(x, t, w, pw):
        F.binary_cross_entropy_with_logits(x, t, weight=w, pos_weight=pw).backward()

    # FunctionsManual.cpp: t = pos_weight->mul(target); t.add(1).sub_(target)
    # .mul_(input.sigmoid()).sub_(t); then mul_(grad), mul_(weight), div_.
    assert _backward_allocs(trace_step(step, x, t, w, pw)) == [
        ("aten.mul.Tensor", 160),
        ("aten.add.Scalar", 160),
        ("aten.sigmoid.default", 160),
    ]


def test_bce_with_logits_target_gradient_is_left_and_warned():
    """A target that requires grad: the node is recorded as meta runs it, with a warning."""
    x, t = _param(4, 10), _param(4, 10)

    def step(x, t):
        F.binary_cross_entropy_with_logits(x, t).backward()

    recording = trace_step(step, x, t)
    assert ("aten.sub.Tensor", 160) in _backward_allocs(recording)
    assert any("target gradient" in w for w in recording.warnings)


def test_eigh_backward_copies_the_eigenvalue_gradient_into_the_diagonal():
    """eigh with both outputs used: the diagonal copy is in place (no [5, 5] diagonal_scatter)."""
    a = _param(5, 5)

    def step(a):
        values, vectors = torch.linalg.eigh(a)
        (values.sum() + vectors.sum()).backward()

    ops = [op for op, _ in _backward_allocs(trace_step(step, a))]
    assert "aten.diagonal_scatter.default" not in ops
    meta_ops = [op for op, _ in _backward_allocs(trace_step(step, a, emulations=META_ONLY))]
    assert "aten.diagonal_scatter.default" in meta_ops


def test_create_graph_keeps_the_out_of_place_branch():
    """Under create_graph=True grad mode is on in backward: the hook leaves the formula alone."""
    x, idx = _param(8, 100), _long(8, 1)

    def step(x, i):
        (grad,) = torch.autograd.grad(x.gather(1, i).pow(2).sum(), x, create_graph=True)
        grad.sum().backward()

    ops = [op for op, _ in _backward_allocs(trace_step(step, x, idx))]
    assert "aten.scatter_add.default" in ops


def test_forward_scatter_add_is_untouched():
    """An out-of-place scatter_add in the user's forward allocates its output as usual."""
    x, idx = torch.zeros(4, 10, device="meta"), _long(4, 1)

    def step(x, i):
        x.scatter_add(1, i, torch.ones(4, 1, device="meta"))

    recording = trace_step(step, x, idx)
    sizes = [
        e.size
        for e in recording.events
        if e.action == "alloc" and dict(e.tags).get("op") == "aten.scatter_add.default"
    ]
    assert sizes == [160]


def test_prod_backward_warns_that_its_branch_depends_on_the_data():
    """prod's CUDA branch hinges on (input == 0).nonzero(): recorded as meta, and warned."""
    x = _param(4, 10)
    recording = trace_step(lambda x: x.prod(1).sum().backward(), x)
    assert any("prod backward" in w for w in recording.warnings)


class _PhaseSink:
    """An allocation sink that, like SimulatedCudaDevice's, says "backward" on autograd's thread."""

    def __init__(self) -> None:
        self.next_id = 0
        self.ops: list[str | None] = []

    def allocate(self, size_bytes, op, *, first_seen):
        from oomkit.prediction.tracing.storages import Allocation

        self.next_id += 1
        self.ops.append(op)
        return Allocation(self.next_id, size_bytes, self.phase(), None, op, ())

    def free(self, alloc):
        pass

    def storage_released(self, alloc):
        pass

    def refused(self, error):
        return error

    def op_failed(self, op, error):
        pass

    def phase(self):
        return "backward" if torch._C._current_graph_task_id() != -1 else "user"


def _grads_with_engine(loss_fn, *tensors):
    from oomkit.core.gpus import get_gpu
    from oomkit.prediction.tracing.emulation import DEFAULT_EMULATIONS
    from oomkit.prediction.tracing.engine import CudaEmulationEngine

    sink = _PhaseSink()
    engine = CudaEmulationEngine(
        sink,
        gpu=get_gpu("h100-sxm"),
        device_type="cpu",
        emulations=DEFAULT_EMULATIONS,
        divergent_ops={},
    )
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    with engine.intercept():
        loss_fn(*leaves).backward()
    return [t.grad for t in leaves if t.requires_grad], sink.ops


_IDX = torch.tensor([4, 0, 4])
_GEN = torch.Generator().manual_seed(1)
_TARGET, _WEIGHT = torch.rand(5, 5, generator=_GEN), torch.rand(5, generator=_GEN)
_POS_WEIGHT = torch.full((5, 5), 2.0)  # full shape: only its phase keeps it from being written
# name -> (loss, the out-of-place op the in-place branch replaces)
_REAL_CASES = {
    "gather": (
        lambda x: (x.gather(1, torch.tensor([[4], [0], [4], [1], [2]])) * 2.0).sum(),
        "aten.scatter_add.default",
    ),
    "index": (lambda x: (x[_IDX] * torch.arange(5.0)).sum(), "aten.index_put.default"),
    "index_select": (lambda x: (x.index_select(0, _IDX) ** 2).sum(), "aten.index_add.default"),
    "take": (lambda x: (x.take(_IDX) * 3.0).sum(), "aten.put.default"),
    "clamp": (
        lambda x: x.clamp(torch.full_like(x, -0.5), torch.full_like(x, 0.5)).sum(),
        "aten.logical_and.default",
    ),
    "max": (lambda x: x.max() * 2.0, "aten.logical_and.default"),
    "bce_logits_pos_weight": (
        lambda x: F.binary_cross_entropy_with_logits(
            x, _TARGET, weight=_WEIGHT, pos_weight=_POS_WEIGHT
        ),
        "aten.sub.Tensor",
    ),
}


@pytest.mark.parametrize("name", sorted(_REAL_CASES))
def test_inplace_branch_gives_correct_gradients_on_real_tensors(name):
    """On CPU tensors under the engine (SimulatedCudaDevice's path) CUDA's in-place branch
    computes the same gradient as plain autograd (a pos_weight made before backward is never
    written)."""
    loss_fn, replaced_op = _REAL_CASES[name]
    x = torch.randn(5, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    (expected,) = torch.autograd.grad(loss_fn(x), x)
    (got,), ops = _grads_with_engine(loss_fn, x)
    torch.testing.assert_close(got, expected)
    assert replaced_op not in ops
    assert torch.equal(_POS_WEIGHT, torch.full((5, 5), 2.0))


def test_every_branch_names_its_source():
    """Each emulated branch cites a formula and a derivatives.yaml line; not-emulated ones say
    what stays as meta records it."""
    assert len(INPLACE_BRANCHES) == 15
    assert all("derivatives.yaml:" in b.source for b in INPLACE_BRANCHES)
    assert all(what for what in NOT_EMULATED_BRANCHES.values())
