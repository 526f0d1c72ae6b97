"""TensorIterator's reduction geometry and Reduce.cuh's setReduceConfig (reduce_config.py), in
exact bytes: the staging buffers the H200 asked for, the rules' corners, and invariants."""

from __future__ import annotations

import gzip
import json
from math import prod
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.prediction.tracing.emulation_sites import ReductionSite, reduction_temporaries
from oomkit.prediction.tracing.reduce_config import (
    ReduceIteration,
    reduce_iteration,
    reduce_staging,
    split_for_32bit_indexing,
)

ROOT = Path(__file__).resolve().parents[3]
H200 = {"multiprocessor_count": 132, "max_threads_per_multiprocessor": 2048}
RTX_4090 = {"multiprocessor_count": 128, "max_threads_per_multiprocessor": 1536}


def _contiguous(sizes):
    return [prod(sizes[i + 1:]) for i in range(len(sizes))]


def _staging(sizes, reduced, *, element=4, arg=4, gpu=H200, strides=None, offset=0):
    it = reduce_iteration(sizes, strides or _contiguous(sizes), element, element, reduced, offset)
    staging = reduce_staging(it, arg, element, **gpu)
    return staging.global_memory_bytes, staging.semaphore_bytes


def test_the_geometry_puts_the_reduced_dimensions_first_and_merges_neighbours():
    # [4, 512, 768] summed over tokens: the batch and sequence merge into one reduced dimension.
    it = reduce_iteration([4, 512, 768], _contiguous([4, 512, 768]), 4, 4, [0, 1])
    assert it == ReduceIteration((2048, 768), (3072, 4), (0, 4), 0)
    # over the last dimension: the reduced dimension is also the fastest
    it = reduce_iteration([512, 2048], [2048, 1], 2, 2, [1])
    assert it == ReduceIteration((2048, 512), (2, 4096), (0, 2), 0)
    assert (it.num_reduce_dims, it.num_output_elements, it.numel) == (1, 512, 2048 * 512)
    # a transposed input: reduced dimension first still, strides as the memory has them
    it = reduce_iteration([768, 2048], [1, 768], 4, 4, [1])
    assert it == ReduceIteration((2048, 768), (3072, 4), (0, 4), 0)
    # everything reduced (sum.default): one dimension
    assert reduce_iteration([8, 128], [128, 1], 8, 8, []).shape == (1024,)


def test_the_h200_bias_gradients_staging_is_what_it_asked_for():
    """validation/h200-torch2.11.0-requests.json.gz: GPT-2's c_proj and c_fc bias gradients
    ([2048, 768] and [2048, 3072] fp32 summed over 2,048 tokens), BERT's MLM bias ([1024,
    768]), each asked for after the gradient's own allocation; a Llama's [512, 2048] norm
    weight gradient asked for nothing."""
    assert _staging([2048, 768], [0]) == (12_582_912, 24)
    assert _staging([2048, 3072], [0]) == (50_331_648, 96)
    assert _staging([1024, 768], [0]) == (6_291_456, 24)
    assert _staging([512, 2048], [0]) == (0, 0)
    # bf16 in, float accumulator: the same 4-byte arg_t, so the same staging
    assert _staging([2048, 768], [0], element=2) == (12_582_912, 24)
    requests = json.loads(gzip.decompress(
        (ROOT / "validation" / "h200-torch2.11.0-requests.json.gz").read_bytes()
    ))["runs"]
    gpt2 = requests["gpt2-124m-b4-seq512-fp32-adamw-train"]
    for staging, semaphores, output in ((12_582_912, 24, 3072), (50_331_648, 96, 12_288)):
        at = next(i for i in range(len(gpt2) - 2) if gpt2[i:i + 3] == [output, staging, semaphores])
        assert gpt2[at + 3:at + 5] in ([-semaphores, -staging], [-staging, -semaphores])


def test_a_full_reduction_stages_one_value_per_block():
    """The fidelity probe's final sum: 262,144 floats into one, 32 blocks of 512 threads, 128
    bytes of staging and one semaphore (validation/fidelity-nvidia-h200-torch2.11.0.json)."""
    assert _staging([64, 4096], []) == (128, 4)
    assert _staging([1_000_000], []) == (492, 4)
    assert _staging([1024], []) == (0, 0)  # 2 values per thread: one block


def test_the_grid_follows_the_gpu():
    """ctas_per_output = max(min(target grid / grid, values / 16), values / 256): on an RTX 4090
    (128 SMs, 1,536 threads each: 12 blocks of 128 per SM) GPT-2's c_fc bias gradient at 8,192
    tokens takes 64 blocks per column, on an H200 (132 x 16) 88: 96 and 132 MiB."""
    assert _staging([8192, 3072], [0], gpu=RTX_4090) == (4 * 3072 * 64 * 32 * 4, 96)
    assert _staging([8192, 3072], [0]) == (4 * 3072 * 88 * 32 * 4, 96)
    # few tokens per output: the values-per-thread bound decides, whatever the GPU
    assert _staging([2048, 768], [0], gpu=RTX_4090) == _staging([2048, 768], [0])


def test_the_output_vector_width_follows_the_inputs_alignment():
    """get_output_vec_size: an input starting 2 floats into its allocation reads 2 outputs per
    thread, not 4. Blocks of 32 x 8 threads (512 / 2 at most) instead of 32 x 4: twice the block
    columns (twice the semaphores), 256 values per thread so 16 blocks per column instead of 32,
    and a per-column factor of 32 x 2 instead of 32 x 4: a quarter of the staging."""
    aligned = _staging([2048, 768], [0])
    shifted = _staging([2048, 768], [0], offset=8)
    assert aligned == (4 * 768 * 32 * (32 * 4), 24)
    assert shifted == (4 * 768 * 16 * (32 * 2), 48)


def test_an_input_past_32_bit_indexing_runs_in_halves():
    """[65536, 65536] fp32 (16 GiB) summed over rows: split on the reduced dimension (the
    largest extent) until each half indexes in 32 bits: 8 launches, each its own staging."""
    it = reduce_iteration([65536, 65536], [65536, 1], 4, 4, [0])
    assert not it.can_use_32bit_indexing()
    subs = list(split_for_32bit_indexing(it))
    assert [s.shape for s in subs] == [(8192, 65536)] * 8
    assert [s.input_offset_bytes for s in subs] == [k * 8192 * 65536 * 4 for k in range(8)]
    assert all(s.can_use_32bit_indexing() for s in subs)


def test_a_bf16_sum_past_32_bit_indexing_accumulates_in_a_float_buffer():
    """bf16 in and out cannot accumulate in the output: the launches share an
    AccumulationBuffer of the output in float (Reduce.cuh), allocated before the first."""
    site = ReductionSite(
        multiprocessor_count=132, max_threads_per_multiprocessor=2048, arg_bytes=4,
        scalar_bytes=2, output_bytes=2, cast_bytes=0, accumulates_in_output=0, offset_bytes=0,
        reduced_mask=1, sizes=(65536, 65536), strides=(65536, 1),
    )
    assert site.held_temporaries() == (("reduction_accumulator", 65536 * 4),)
    assert len(site.launches()) == 4
    assert reduction_temporaries(site.params())[0] == ("reduction_accumulator", 65536 * 4)
    assert ReductionSite.from_params(site.params()) == site


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(1, 64), min_size=1, max_size=3),
    channels=st.lists(st.integers(1, 96), min_size=1, max_size=2),
    element=st.sampled_from([2, 4]),
)
def test_splitting_a_contiguous_dimension_changes_nothing(tokens, channels, element):
    """A contiguous [*tokens, *channels] summed over the tokens is, to TensorIterator, the same
    iteration as [prod(tokens), prod(channels)] summed over the first: same geometry, same
    staging; its reduced and kept dimensions account for every element."""
    sizes = tokens + channels
    reduced = list(range(len(tokens)))
    flat = [prod(tokens), prod(channels)]
    it = reduce_iteration(sizes, _contiguous(sizes), element, element, reduced)
    flat_it = reduce_iteration(flat, _contiguous(flat), element, element, [0])
    assert it.numel == prod(sizes)
    assert it.num_output_elements == prod(channels)
    assert _staging(sizes, reduced, element=element) == _staging(flat, [0], element=element)
    if flat[0] > 1 and flat[1] > 1:
        assert it == flat_it


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 1 << 16),
    columns=st.integers(1, 1 << 12),
    gpu=st.sampled_from([H200, RTX_4090, {"multiprocessor_count": 40, "max_threads_per_multiprocessor": 1024}]),
)
def test_staging_comes_with_semaphores_and_at_least_two_blocks_per_output(rows, columns, gpu):
    """Either nothing, or a staging buffer holding at least two partial results per output and
    one 4-byte semaphore per block column (at most one column per 4 outputs' worth)."""
    staging, semaphores = _staging([rows, columns], [0], gpu=gpu)
    if staging == 0:
        assert semaphores == 0
        return
    assert semaphores > 0 and semaphores % 4 == 0
    assert staging >= 2 * 4 * columns
    assert semaphores // 4 <= columns
