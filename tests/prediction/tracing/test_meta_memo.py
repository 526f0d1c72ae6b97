"""The meta-kernel memo: repeats answered from memory, the same recording as the plain path."""

from __future__ import annotations

import pytest
import torch

from oomkit.prediction.models import StepOptions, build_preset_step
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.meta_memo import SHARED_MEMO, MetaMemo

aten = torch.ops.aten


def _meta(*size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device="meta")


def test_a_repeat_gets_new_tensors_of_the_remembered_layout():
    """The second mm on the same shapes is answered from memory: a new storage, same layout."""
    memo = MetaMemo()
    a, b = _meta(8, 16, dtype=torch.bfloat16), _meta(16, 4, dtype=torch.bfloat16).t().contiguous().t()
    first = memo.run(aten.mm.default, (a, b), {}, lambda: aten.mm.default(a, b))
    second = memo.run(aten.mm.default, (a, b), {}, lambda: pytest.fail("ran the kernel again"))
    assert (memo.hits, memo.misses) == (1, 1)
    assert second.shape == first.shape == (8, 4)
    assert second.stride() == first.stride() == (4, 1)
    assert second.dtype == torch.bfloat16 and second.is_meta
    assert second.untyped_storage().nbytes() == first.untyped_storage().nbytes() == 64
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata


def test_other_strides_or_arguments_are_other_keys():
    """A transposed input or another scalar argument is a miss, not a hit."""
    memo = MetaMemo()
    a = _meta(6, 6)
    memo.run(aten.mm.default, (a, a), {}, lambda: aten.mm.default(a, a))
    memo.run(aten.mm.default, (a.t(), a), {}, lambda: aten.mm.default(a.t(), a))
    memo.run(aten.sum.dim_IntList, (a, [0]), {}, lambda: aten.sum.dim_IntList(a, [0]))
    memo.run(aten.sum.dim_IntList, (a, [1]), {}, lambda: aten.sum.dim_IntList(a, [1]))
    memo.run(aten.sum.dim_IntList, (a, [1]), {"keepdim": True},
             lambda: aten.sum.dim_IntList(a, [1], keepdim=True))
    assert (memo.hits, memo.misses) == (0, 5)


def test_views_out_variants_and_padded_buffers_are_never_remembered():
    """Outputs that alias an input, an ``out=`` argument written and a result larger than its
    extent run every time."""
    memo = MetaMemo()
    a, out = _meta(4, 4), _meta(4, 4)
    for _ in range(2):
        view = memo.run(aten.view.default, (a, [16]), {}, lambda: aten.view.default(a, [16]))
        assert view.untyped_storage()._cdata == a.untyped_storage()._cdata
        written = memo.run(aten.add.out, (a, a), {"out": out}, lambda: aten.add.out(a, a, out=out))
        assert written is out
        # A kernel that returns the front of a bigger buffer: remade, the storage would shrink.
        padded = memo.run(aten.clone.default, (a,), {}, lambda: _meta(32)[:16].view(4, 4))
        assert padded.untyped_storage().nbytes() == 128
    # Only the clone was a candidate: run twice, remembered as not to be remembered.
    assert (memo.hits, memo.misses) == (0, 2)


def test_an_inplace_repeat_returns_its_first_argument_without_the_kernel():
    """``add_`` returns ``self``, ``_foreach_addcdiv_`` nothing: a repeat on the same metadata
    answers the same without running the kernel, for another tensor of that layout too."""
    memo = MetaMemo()
    a, b = _meta(4, 4), _meta(4, 4)
    assert memo.run(aten.add_.Tensor, (a, a), {}, lambda: aten.add_.Tensor(a, a)) is a
    again = memo.run(aten.add_.Tensor, (b, b), {}, lambda: pytest.fail("ran the kernel again"))
    assert again is b
    params, grads = [_meta(3), _meta(2, 5)], [_meta(3), _meta(2, 5)]
    op = aten._foreach_addcdiv_.Scalar
    call = (params, grads, grads, 0.5)
    assert memo.run(op, call, {}, lambda: op(*call)) is None
    assert memo.run(op, call, {}, lambda: pytest.fail("ran the kernel again")) is None
    # Another scalar is another key: it runs.
    other = (params, grads, grads, 0.25)
    memo.run(op, other, {}, lambda: op(*other))
    assert (memo.hits, memo.misses) == (2, 3)


def test_an_inplace_op_that_changes_its_argument_or_raises_is_not_remembered():
    """A kernel that changes the layout of what it writes (here one that resizes it) and an
    in-place broadcast that cannot write its result (it raises) run again every time."""
    memo = MetaMemo()
    ran = []

    def resizing(tensor: torch.Tensor) -> torch.Tensor:
        ran.append("resize")
        return tensor.resize_(8)

    def broadcast(small: torch.Tensor, big: torch.Tensor) -> torch.Tensor:
        ran.append("add_")
        return aten.add_.Tensor(small, big)

    for _ in range(2):
        a = _meta(4)
        assert memo.run(aten.add_.Tensor, (a, a), {}, lambda a=a: resizing(a)).shape == (8,)
        small, big = _meta(4, 1), _meta(4, 4)
        with pytest.raises(RuntimeError):
            memo.run(aten.add_.Tensor, (small, big), {}, lambda s=small, b=big: broadcast(s, b))
    assert ran == ["resize", "add_"] * 2
    assert (memo.hits, memo.misses) == (0, 2)


def _recording(enabled: bool):
    SHARED_MEMO.enabled = enabled
    try:
        built = build_preset_step(
            "gpt2-124m",
            StepOptions(batch_size=1, seq_len=64, precision="bf16-mixed", optimizer="adamw"),
        )
        return trace_step(lambda *_: built.step_fn(), *built.track, steps=2)
    finally:
        SHARED_MEMO.enabled = True


def test_memo_and_plain_path_record_the_same_events():
    """A GPT-2 training step recorded with the memo and without it: every event (action,
    address, size, category, op, frames) and every step boundary is the same."""
    SHARED_MEMO.clear()
    hits = SHARED_MEMO.hits
    memo = _recording(True)
    assert SHARED_MEMO.hits - hits > 1000  # step 2 and layers 2-12 repeat step 1, layer 1
    plain = _recording(False)
    assert len(memo.events) == len(plain.events) > 2000
    assert memo.events == plain.events
    assert memo.step_starts == plain.step_starts
    assert dict(memo.bytes_by_category) == dict(plain.bytes_by_category)
    assert dict(memo.kernel_choices) == dict(plain.kernel_choices)


def test_a_full_memo_runs_new_keys_and_still_answers_old_ones():
    """Past ``max_entries`` a new key runs every time; a remembered one is still answered."""
    memo = MetaMemo(max_entries=1)
    a, b = _meta(2, 3), _meta(3, 5)
    memo.run(aten.mm.default, (a, b), {}, lambda: aten.mm.default(a, b))
    for _ in range(2):
        memo.run(aten.mm.default, (b.t(), a.t()), {}, lambda: aten.mm.default(b.t(), a.t()))
    out = memo.run(aten.mm.default, (a, b), {}, lambda: pytest.fail("ran the kernel again"))
    assert out.shape == (2, 5)
    assert (memo.hits, memo.misses) == (1, 3)
