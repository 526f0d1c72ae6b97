"""What changed in vLLM's start-up memory accounting between the releases oomkit models.

One ``VllmRules`` record a modelled release, every field explicit. Read from vllm-project/vllm:

- ``0.8``: ``vllm/v1/worker/gpu_worker.py`` at commit 0012cf69 (the V1 worker of the 0.8
  series; a v0.8.1 start-up log, kserve/kserve#4368, shows the same engine). There
  ``Worker.determine_available_memory`` resets the peak after loading, runs ``profile_run``,
  then takes ``allocated_bytes.all.peak`` (weights included) plus everything the device holds
  outside torch's allocator (``mem_get_info`` used minus ``allocated_bytes.all.current``: the
  CUDA context counts) and returns ``total * gpu_memory_utilization`` less that peak. No check
  of the free memory at start, no ``--kv-cache-memory``.
- ``0.13``: ``vllm/v1/worker/gpu_worker.py`` at commit 35d5cda1 (main after v0.12: model runner
  V2 switch, workspace manager, compile ranges; the release is inferred from those features).
  ``Worker.init_device`` takes a ``MemorySnapshot`` after NCCL is up and refuses to start when
  its free memory is below ``requested_memory = total * gpu_memory_utilization``;
  ``determine_available_memory`` returns ``requested_memory - non_kv_cache_memory`` where
  ``non_kv_cache_memory = weights + torch_peak_increase + non_torch_increase``
  (``vllm/utils/mem_utils.py`` ``memory_profiling``: the peak above what was allocated before
  the profile run, and the growth of non-torch memory since the snapshot, so the CUDA context
  is not counted), or ``kv_cache_memory_bytes`` when ``--kv-cache-memory`` is given.
  ``compile_or_warm_up_model`` captures CUDA graphs (``capture_model`` returns their bytes,
  logged, not budgeted) and then warms the sampler up.

Defaults: 0.13 ``vllm/engine/arg_utils.py`` ``get_batch_defaults`` (devices of >= 70 GiB that are
not A100s: 8192 batched tokens and 1024 sequences for the API server; others 2048 and 256);
capture sizes ``vllm/config/vllm.py`` ``VllmConfig._set_cudagraph_sizes`` (up to
``min(2 * max_num_seqs, 512, max_num_batched_tokens)``: 1, 2, 4, then steps of 8 below 256 and
of 16 from 256). 0.8: ``EngineArgs._set_default_args_v1`` of that series: 8192 batched tokens
for the API server on a >= 70 GiB device (a v0.8.1 log: "Chunked prefill is enabled with
max_num_batched_tokens=8192"), 2048 on others, and 256 sequences everywhere, capture sizes
1, 2, 4 and steps of 8 up to 512 (``VllmConfig._set_cudagraph_sizes`` of V1 0.8), within
``max_num_batched_tokens``. Block size 16 in both (``CacheConfig.block_size``); ``--block-size``
takes the ``BlockSize`` literal's values as argparse choices (``arg_utils.py``: a ``Literal``
hint becomes ``choices``), 1, 8, 16, 32, 64 and 128 in 0.8 (v0.8.5 ``vllm/config.py``), 256 too
in 0.13 (v0.13.0 ``vllm/config/cache.py``; both read from the releases' PyPI sdists).
"""

from __future__ import annotations

from dataclasses import dataclass

from oomkit.prediction.serving.model_spec import ServingConfigError

__all__ = ["DEFAULT_VLLM_VERSION", "VLLM_VERSIONS", "VllmRules", "vllm_rules"]

GIB = 1 << 30


@dataclass(frozen=True)
class VllmRules:
    """One vLLM release's start-up accounting.

    Attributes:
        version: ``"0.8"`` or ``"0.13"``.
        budget_counts_context: the KV budget subtracts everything outside torch's allocator,
            the CUDA context included (0.8), rather than only its growth since start (0.13).
        budget_counts_persistent_buffers: the runner's input buffers, allocated before the
            profile run, are in the subtracted peak (0.8: the peak is absolute).
        checks_free_memory_at_start: ``init_device`` refuses a utilization above the free
            memory (0.13).
        has_kv_cache_memory_flag: ``--kv-cache-memory`` exists (0.13).
        inplace_sampler: the top-p cumsum and the unsort write into existing buffers.
        large_device_defaults: batched tokens and sequences by default on a >= 70 GiB non-A100
            device, and on others.
        graph_modes: CUDA graphs captured a size (0.13 ``FULL_AND_PIECEWISE``: a piecewise and
            a full decode graph; 0.8: piecewise).
        block_sizes: the values ``--block-size`` accepts (``BlockSize``).
    """

    version: str
    budget_counts_context: bool
    budget_counts_persistent_buffers: bool
    checks_free_memory_at_start: bool
    has_kv_cache_memory_flag: bool
    inplace_sampler: bool
    large_device_defaults: tuple[tuple[int, int], tuple[int, int]]
    graph_modes: int
    block_sizes: tuple[int, ...]

    def default_batch(self, total_memory_bytes: int, gpu_name: str) -> tuple[int, int]:
        """``(max_num_batched_tokens, max_num_seqs)`` by default for the API server."""
        large, small = self.large_device_defaults
        if total_memory_bytes >= 70 * GIB and "a100" not in gpu_name.lower():
            return large
        return small

    def capture_sizes(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, ...]:
        """The batch sizes CUDA graphs are captured for by default, ascending."""
        if self.version == "0.8":
            sizes = [1, 2, 4, *range(8, 513, 8)]
            return tuple(s for s in sizes if s <= max_num_batched_tokens)
        limit = min(max_num_seqs * 2, 512, max_num_batched_tokens)
        sizes = [s for s in (1, 2, 4) if s <= limit]
        if limit >= 8:
            sizes += list(range(8, min(limit + 1, 256), 8))
        if limit >= 256:
            sizes += list(range(256, limit + 1, 16))
        return tuple(sizes)


_RULES = {
    "0.8": VllmRules(
        version="0.8",
        budget_counts_context=True,
        budget_counts_persistent_buffers=True,
        checks_free_memory_at_start=False,
        has_kv_cache_memory_flag=False,
        inplace_sampler=False,
        large_device_defaults=((8192, 256), (2048, 256)),
        graph_modes=1,
        block_sizes=(1, 8, 16, 32, 64, 128),
    ),
    "0.13": VllmRules(
        version="0.13",
        budget_counts_context=False,
        budget_counts_persistent_buffers=False,
        checks_free_memory_at_start=True,
        has_kv_cache_memory_flag=True,
        inplace_sampler=True,
        large_device_defaults=((8192, 1024), (2048, 256)),
        graph_modes=2,
        block_sizes=(1, 8, 16, 32, 64, 128, 256),
    ),
}
VLLM_VERSIONS = tuple(_RULES)
DEFAULT_VLLM_VERSION = "0.13"


def vllm_rules(version: str) -> VllmRules:
    """The accounting of a modelled vLLM release (``"0.13"``; ``"0.13.1"`` reads as 0.13).

    Raises:
        ServingConfigError: a release oomkit does not model.
    """
    key = ".".join(version.strip().removeprefix("v").split(".")[:2])
    if key not in _RULES:
        raise ServingConfigError(
            f"--vllm-version {version!r} is not modelled; oomkit models vLLM "
            f"{', '.join(VLLM_VERSIONS)} (their start-up accounting differs). Pick the nearest "
            "older one"
        )
    return _RULES[key]
