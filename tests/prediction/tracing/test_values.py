"""KnownValues follows the values of meta tensors that what the user passed determines."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from oomkit.prediction.tracing.value_reads import value_tracking  # noqa: E402
from oomkit.prediction.tracing.values import (  # noqa: E402
    MAX_KNOWN_BYTES,
    MAX_TOTAL_KNOWN_BYTES,
    KnownValues,
    known_bytes,
    known_value,
)


def _values(tensor):
    known = known_value(tensor)
    return None if known is None else known.tensor.tolist()


def test_factories_and_ops_on_them_are_known_with_their_origins():
    """torch.ones and what is computed from it hold the values CUDA would; origins are named."""
    with KnownValues(), torch.device("meta"):
        mask = torch.ones(2, 3, dtype=torch.long)
        all_ones = mask.sum() == mask.numel()  # transformers' fast_all
        positions = torch.arange(4).unsqueeze(0).expand(2, -1)
    assert _values(mask) == [[1, 1, 1], [1, 1, 1]]
    assert _values(all_ones) is True
    assert _values(positions) == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert known_value(all_ones).origins == frozenset({"torch.ones"})


def test_random_and_uninitialised_values_and_what_follows_are_unknown():
    """randn, empty and anything computed from them stay unknown (weights, activations, loss)."""
    with KnownValues(), torch.device("meta"):
        noise = torch.randn(3)
        blank = torch.empty(3)
        mixed = noise + torch.ones(3)
    assert (known_value(noise), known_value(blank), known_value(mixed)) == (None, None, None)


def test_like_factories_of_an_unknown_tensor_take_only_its_layout():
    """ones_like / zeros_like / full_like of random ids are known (the ids' values do not
    matter, only their shape and dtype), named by the factory; empty_like is not."""
    with KnownValues(), torch.device("meta"):
        ids = torch.randint(0, 100, (2, 3))
        ones, zeros, sevens = torch.ones_like(ids), torch.zeros_like(ids), torch.full_like(ids, 7)
        blank = torch.empty_like(ids)
    assert (_values(ones), _values(zeros), _values(sevens)) == ([[1] * 3] * 2, [[0] * 3] * 2, [[7] * 3] * 2)
    assert known_value(ones).origins == frozenset({"torch.ones_like"})
    assert (known_value(ids), known_value(blank)) == (None, None)


def test_a_causal_mask_is_recognised_by_torch_equal_and_all():
    """triu(full(-inf), 1) equals torch's own causal mask: equal() and all() answer True."""
    with KnownValues(), torch.device("meta"):
        mask = torch.triu(torch.full((4, 4), float("-inf")), diagonal=1)
        reference = torch.nn.Transformer.generate_square_subsequent_mask(4)
        same = bool((mask == reference).all())
        equal = torch.equal(mask, reference)
        shifted = torch.equal(mask, torch.triu(torch.full((4, 4), float("-inf")), diagonal=2))
    assert (same, equal, shifted) == (True, True, False)


def test_data_dependent_shapes_of_known_tensors_are_answered():
    """torch.tensor(data) is known; nonzero of it has the size CUDA would give: 3 ones, 3 rows."""
    with value_tracking(), torch.device("meta"):
        flags = torch.tensor([1, 0, 1, 1])
        where = flags.nonzero()
    assert where.is_meta
    assert tuple(where.shape) == (3, 1)
    assert _values(where) == [[0], [2], [3]]


def test_views_share_values_and_in_place_ops_update_them():
    """An in-place op on a view changes the base's values, as it changes its memory."""
    with KnownValues(), torch.device("meta"):
        base = torch.zeros(4)
        view = base[1:3]
        view.add_(5)
    assert _values(base) == [0.0, 5.0, 5.0, 0.0]


def test_an_in_place_op_with_an_unknown_input_forgets_every_view():
    """base += randn makes base and its views unknown: no stale value is ever answered."""
    with KnownValues(), torch.device("meta"):
        base = torch.zeros(4)
        view = base[1:3]
        base.add_(torch.randn(4))
    assert (known_value(base), known_value(view)) == (None, None)


def test_fill_of_a_whole_uninitialised_storage_makes_it_known_but_not_a_slice():
    """empty().fill_(2) is known; filling a slice of an empty tensor leaves it unknown."""
    with KnownValues(), torch.device("meta"):
        whole = torch.empty(3).fill_(2.0)
        part = torch.empty(6)
        part[2:].fill_(1.0)
    assert _values(whole) == [2.0, 2.0, 2.0]
    assert known_value(part) is None


def test_copies_above_the_size_limit_are_not_kept():
    """A known tensor larger than MAX_KNOWN_BYTES is not copied (memory stays bounded)."""
    with KnownValues(), torch.device("meta"):
        big = torch.ones(MAX_KNOWN_BYTES + 1, dtype=torch.uint8)
        small = torch.ones(MAX_KNOWN_BYTES, dtype=torch.uint8)
    assert known_value(big) is None
    assert known_value(small) is not None


def test_all_copies_together_stay_under_the_total_limit():
    """zeros_like of many 32 MiB tensors (optimizer state): copies stop at the total, and a
    storage's bytes are given back when it dies."""
    before = known_bytes()
    chunk = 32 << 20
    with KnownValues(), torch.device("meta"):
        states = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(12)]
        kept = sum(known_value(t) is not None for t in states)
        assert kept == (MAX_TOTAL_KNOWN_BYTES - before) // chunk
        assert known_bytes() <= MAX_TOTAL_KNOWN_BYTES
        del states
    assert known_bytes() == before


def test_finiteness_of_unknown_tensors_is_assumed_and_counted():
    """isnan/isfinite of an unknown tensor answer as for finite values, counted by op."""
    with value_tracking() as (_, reads), torch.device("meta"):
        loss = torch.randn(())
        nan = bool(torch.isnan(loss))
        finite = bool(loss.isfinite())
    assert (nan, finite) == (False, True)
    assert dict(reads.assumed_finite) == {"torch.isnan": 1, "torch.isfinite": 1}


def test_grad_scaler_inf_check_of_unknown_gradients_finds_none():
    """_amp_foreach_non_finite_check_and_unscale_ on unknown grads leaves found_inf at 0."""
    with KnownValues() as known, torch.device("meta"):
        grads = [torch.randn(8), torch.randn(3)]
        found_inf = torch.full((), 0.0)
        inv_scale = torch.full((), 0.5)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    assert _values(found_inf) == 0.0
    assert dict(known.assumed_finite) == {"torch._amp_foreach_non_finite_check_and_unscale_": 1}


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=6),
    op=st.sampled_from(["or", "and", "or_", "and_", "logical_or", "logical_and"]),
    known_first=st.booleans(),
)
def test_a_known_operand_that_decides_a_logical_op_alone_makes_it_known(flags, op, known_first):
    """x | all-True is all True and x & all-False all False whatever the unknown x holds
    (transformers' stop at its length limit); any other known operand leaves it unknown."""
    with value_tracking(), torch.device("meta"):
        known = torch.tensor(flags)  # from Python data: known (ValueReads)
        assert _values(known) == flags
        unknown = torch.empty(len(flags), dtype=torch.bool)
        left, right = (known, unknown) if known_first else (unknown, known)
        if op == "or":
            out = left | right
        elif op == "and":
            out = left & right
        elif op == "or_":
            out = left.clone().bitwise_or_(right)
        elif op == "and_":
            out = left.clone().bitwise_and_(right)
        else:
            out = getattr(torch, op)(left, right)
    decided = all(flags) if "or" in op else not any(flags)
    expected = [all(flags)] * len(flags) if "or" in op else [False] * len(flags)
    assert _values(out) == (expected if decided else None)


def test_a_long_and_with_a_known_all_false_mask_is_zero():
    """transformers: unfinished_sequences (long, unknown) & ~is_done (bool, all True) is 0."""
    with KnownValues(), torch.device("meta"):
        unfinished = torch.empty(3, dtype=torch.long)
        is_done = torch.full((3,), True)
        left = unfinished & ~is_done
        finished = left.max() == 0
    assert _values(left) == [0, 0, 0]
    assert _values(finished) is True


@pytest.mark.parametrize(("padded_from", "qualifies"), [(10, True), (None, False)])
def test_a_transformer_encoder_s_padding_mask_check_reads_only_the_mask(padded_from, qualifies):
    """nn.TransformerEncoder in inference checks its padding mask for the nested-tensor fast
    path (_nested_tensor_from_mask_left_aligned(src, mask)): src's values do not matter, so a
    known mask answers it (it had stopped the step: no meta kernel, src unknown). The meta
    device never takes the fast path, and a qualifying mask is said to make the prediction an
    upper bound; a mask padded in the middle does not qualify."""
    from oomkit.core.target import Target
    from oomkit.prediction.tracing.step_runner import trace_step

    with torch.device("meta"):
        encoder = torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2
        ).eval()

    def step():
        x = torch.randn(4, 16, 64, device="meta")
        mask = torch.zeros(4, 16, dtype=torch.bool, device="meta")
        if padded_from is None:
            mask[:, 3] = True  # a gap: not left-aligned
        else:
            mask[:, padded_from:] = True
        with torch.inference_mode():
            encoder(x, src_key_padding_mask=mask)

    recording = trace_step(step, steps=1, target=Target.resolve("h100"))
    said = recording.assumptions.get("TransformerEncoder fast path")
    assert (said is not None) == qualifies
    if qualifies:
        assert said.startswith("nn.TransformerEncoder was called 1 time(s) in inference")
