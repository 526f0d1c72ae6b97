"""A CUDA reduction's launch: TensorIterator's geometry and Reduce.cuh's ``setReduceConfig``.

Pure arithmetic (no torch), ported from PyTorch so that the recorder knows what
``gpu_reduce_kernel`` (aten/src/ATen/native/cuda/Reduce.cuh) asks the caching allocator for:

- ``reduce_iteration``: the iteration ``TensorIterator::reduce_op(review_reduce_result(out),
  input)`` builds (aten/src/ATen/TensorIterator.cpp): the output viewed with its reduced
  dimensions at stride 0, the dimensions ordered fastest first with the reduced ones in front
  (``reorder_dimensions``), neighbours merged where every operand's strides continue
  (``coalesce_dimensions``);
- ``split_for_32bit_indexing``: ``with_32bit_indexing``'s sub-iterations, in the kernel's order;
- ``reduce_staging``: ``setReduceConfig`` and, when it splits each output across blocks
  (``ctas_per_output > 1``), ``ReduceConfig::global_memory_size`` (the staging buffer) and
  ``semaphore_size`` (one ``int`` per column of blocks).

And ``non_overlapping_and_dense``, c10's layout test that a reduction's cast copy (and the
autograd engine's in-place accumulation, ``emulations/input_buffer.py``) depends on.

The emulation that allocates them is ``emulations/reductions.py``; the batch search's sites
(``emulation_sites.py``) use the same functions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

__all__ = [
    "ReduceIteration",
    "ReduceStaging",
    "non_overlapping_and_dense",
    "reduce_iteration",
    "reduce_staging",
    "split_for_32bit_indexing",
]

_INT32_MAX = 2**31 - 1
# Reduce.cuh: mnt_wrapper<T>::MAX_NUM_THREADS (256 for complex<double> only), the warp size.
_MAX_NUM_THREADS = 512
_WARP_SIZE = 32
# setReduceConfig's bounds on the values one thread reduces (the CUDA build's, not ROCm's).
_MIN_VALUES_PER_THREAD = 16
_MAX_VALUES_PER_THREAD = 256


@dataclass(frozen=True)
class ReduceIteration:
    """A reduction's TensorIterator after ``build()``: dimensions fastest first.

    Attributes:
        shape: each dimension's size, the reduced ones first.
        input_strides: the input's stride in bytes per dimension.
        output_strides: the output's stride in bytes per dimension (0 where reduced).
        input_offset_bytes: the input's first element's offset from its allocation (the
            kernel's vector width depends on its alignment).
    """

    shape: tuple[int, ...]
    input_strides: tuple[int, ...]
    output_strides: tuple[int, ...]
    input_offset_bytes: int = 0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def num_reduce_dims(self) -> int:
        return sum(1 for stride in self.output_strides if stride == 0)

    @property
    def num_output_elements(self) -> int:
        n = 1
        for size, stride in zip(self.shape, self.output_strides, strict=True):
            if stride != 0:
                n *= size
        return n

    def can_use_32bit_indexing(self) -> bool:
        """TensorIteratorBase::can_use_32bit_indexing: every offset fits an int32."""
        if self.numel > _INT32_MAX:
            return False
        for strides in (self.output_strides, self.input_strides):
            offset = 1 + sum((size - 1) * s for size, s in zip(self.shape, strides, strict=True))
            if offset > _INT32_MAX:
                return False
        return True


def reduce_iteration(
    sizes: Sequence[int],
    strides: Sequence[int],
    element_size: int,
    output_element_size: int,
    reduced: Sequence[int],
    offset_bytes: int = 0,
) -> ReduceIteration:
    """The iteration ``TensorIterator::reduce_op(review_reduce_result(out), input)`` builds.

    Args:
        sizes, strides: the input's (strides in elements).
        element_size, output_element_size: bytes per element of the input and the output.
        reduced: the dimensions reduced (none: all of them).
        offset_bytes: the input's first element's offset from its allocation.
    """
    ndim = len(sizes)
    dims = {d % ndim for d in reduced} if reduced and ndim else set(range(ndim))
    # The output is allocated contiguous in the kept dimensions; review_reduce_result views it
    # with every reduced dimension at stride 0 (and TensorIterator's compute_strides gives a
    # broadcast dimension stride 0 too).
    out_strides = [0] * ndim
    step = output_element_size
    for d in reversed(range(ndim)):
        if d not in dims:
            out_strides[d] = step
            step *= sizes[d]
    in_strides = [s * element_size for s in strides]
    # reorder_dimensions: start from n-1, ..., 0 (fastest first for a contiguous tensor), then
    # an insertion sort that tolerates ambiguous comparisons.
    operands = (out_strides, in_strides)

    def should_swap(d0: int, d1: int) -> int:
        for arg, stride in enumerate(operands):
            s0, s1 = stride[d0], stride[d1]
            if arg == 0 and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1  # reduced dimensions to the front
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if sizes[d0] > sizes[d1]:  # equal strides: the smaller dimension first
                return 1
        return 0

    perm = list(reversed(range(ndim)))
    for i in range(1, ndim):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[d0], perm[d1])
            if comparison > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif comparison < 0:
                break
    shape = [sizes[p] for p in perm]
    ops = [[s[p] for p in perm] for s in operands]
    # coalesce_dimensions: merge neighbours when either has size 1 or every operand's strides
    # continue (shape[n] * stride[n] == stride[n + 1]).
    if ndim > 1:
        prev = 0
        for dim in range(1, ndim):
            if shape[prev] == 1 or shape[dim] == 1 or all(
                shape[prev] * s[prev] == s[dim] for s in ops
            ):
                if shape[prev] == 1:
                    for s in ops:
                        s[prev] = s[dim]
                shape[prev] *= shape[dim]
            else:
                prev += 1
                if prev != dim:
                    for s in ops:
                        s[prev] = s[dim]
                    shape[prev] = shape[dim]
        shape = shape[: prev + 1]
        ops = [s[: prev + 1] for s in ops]
    return ReduceIteration(
        tuple(shape), tuple(ops[1]), tuple(ops[0]), offset_bytes
    )


def split_for_32bit_indexing(iteration: ReduceIteration) -> Iterator[ReduceIteration]:
    """``TensorIteratorBase::with_32bit_indexing``: the sub-iterations, in the kernel's order.

    Each split halves the dimension of largest extent (``get_dim_to_split``); the first half
    runs first (``SplitUntil32Bit::iterator``)."""
    pending = [iteration]
    while pending:
        it = pending.pop()
        if it.can_use_32bit_indexing():
            yield it
            continue
        dim = _dim_to_split(it)
        first = it.shape[dim] // 2
        shape = list(it.shape)
        shape[dim] = first
        head = replace(it, shape=tuple(shape))
        shape[dim] = it.shape[dim] - first
        # TensorIteratorBase::split: the first half (narrowed to [0, first)) runs first, the
        # rest starts ``first`` elements of that dimension further into the input.
        offset = it.input_offset_bytes + first * it.input_strides[dim]
        tail = replace(it, shape=tuple(shape), input_offset_bytes=offset)
        pending.extend((tail, head))


def _dim_to_split(it: ReduceIteration) -> int:
    max_extent, dim_to_split = -1, -1
    for dim in range(it.ndim - 1, -1, -1):
        size = it.shape[dim]
        if size == 0:
            continue
        for strides in (it.output_strides, it.input_strides):
            extent = (size - 1) * abs(strides[dim])
            if extent > max_extent:
                max_extent, dim_to_split = extent, dim
    return dim_to_split


@dataclass(frozen=True)
class ReduceStaging:
    """What one ``gpu_reduce_kernel`` launch asks the caching allocator for, in bytes."""

    global_memory_bytes: int
    semaphore_bytes: int


def _last_pow2(n: int) -> int:
    # Reduce.cuh last_pow2: floor(log2(n)) as a power of two, at least 1.
    for shift in (1, 2, 4, 8, 16):
        n |= n >> shift
    return max(1, n - (n >> 1))


def _div_up(a: int, b: int) -> int:
    return (a + b - 1) // b


def _output_vec_size(it: ReduceIteration, scalar_bytes: int) -> int:
    # Reduce.cuh get_output_vec_size: 4, halved until it divides the input's address (in
    # elements), the first kept dimension's size and every other input stride (in elements).
    vec = 4

    def update(n: int) -> None:
        nonlocal vec
        while n % vec != 0:
            vec //= 2

    update(it.input_offset_bytes // scalar_bytes)
    output_index = it.num_reduce_dims
    update(it.shape[output_index])
    for j, stride in enumerate(it.input_strides):
        if j != output_index:
            update(stride // scalar_bytes)
    return vec


def reduce_staging(
    it: ReduceIteration,
    arg_bytes: int,
    scalar_bytes: int,
    *,
    multiprocessor_count: int,
    max_threads_per_multiprocessor: int,
    input_vec_size: int = 4,
) -> ReduceStaging:
    """``setReduceConfig`` for ``it``, then ``global_memory_size`` and ``semaphore_size``.

    Args:
        it: one 32-bit-indexable iteration.
        arg_bytes: ``sizeof(arg_t)``, the accumulator.
        scalar_bytes: ``sizeof(scalar_t)``, the input element.
        multiprocessor_count, max_threads_per_multiprocessor: the target's SMs and resident
            threads per SM (``cudaDeviceProp``), which size the grid.
        input_vec_size: the kernel's vector width along the input (4 for sum and mean).
    """
    num_outputs = it.num_output_elements
    num_inputs = it.numel // num_outputs
    r = it.num_reduce_dims
    if it.ndim > 0:
        on_fastest = r == it.ndim or it.input_strides[0] < it.input_strides[r]
        if on_fastest:
            dim0, dim1, fastest = num_inputs, num_outputs, it.input_strides[0]
        else:
            dim0, dim1, fastest = num_outputs, num_inputs, it.input_strides[r]
    else:
        on_fastest, fastest, dim0, dim1 = True, scalar_bytes, 1, 1
    output_vec = 1
    if fastest == scalar_bytes:
        if on_fastest and dim0 >= 128 and r == 1:
            dim0 //= input_vec_size  # "vectorize along input"
        elif not on_fastest:
            output_vec = _output_vec_size(it, scalar_bytes)  # "vectorize along output"
            dim0 //= output_vec
    # ReduceConfig::set_block_dimension
    max_threads = _MAX_NUM_THREADS // output_vec
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, _WARP_SIZE)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height

    step_input = step_output = 1
    block_x_reduce = it.ndim == 0 or on_fastest
    if block_x_reduce:
        step_input *= block_width  # input_mult[0] = split_input(block_width)
    else:
        step_output *= block_width  # output_mult[0] = split_output(block_width)
    warp_split_threshold = min(block_height * 16, _MAX_VALUES_PER_THREAD)
    split_across_warps = _div_up(num_inputs, step_input) >= warp_split_threshold
    if split_across_warps:
        step_input *= block_height
    else:
        step_output *= block_height
    blocks_per_sm = max_threads_per_multiprocessor // num_threads
    target_grid_size = multiprocessor_count * blocks_per_sm
    grid_x = _div_up(num_outputs // output_vec, step_output)
    values_per_thread = _div_up(num_inputs, step_input)
    ctas_per_output = 1
    if (
        split_across_warps
        and values_per_thread >= _MAX_VALUES_PER_THREAD
        and grid_x <= target_grid_size
    ):
        ctas_per_output = max(
            min(
                _div_up(target_grid_size, grid_x),
                _div_up(values_per_thread, _MIN_VALUES_PER_THREAD),
            ),
            _div_up(values_per_thread, _MAX_VALUES_PER_THREAD),
        )
    if ctas_per_output <= 1:
        return ReduceStaging(0, 0)
    size = arg_bytes * num_outputs * ctas_per_output
    if not block_x_reduce:
        size *= block_width * output_vec
    return ReduceStaging(size, 4 * grid_x)


def non_overlapping_and_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """c10 ``TensorImpl::compute_non_overlapping_and_dense``: the dimensions of more than one
    element, sorted by stride, tile memory exactly (strides in elements)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(sizes, strides, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True
