"""An engine's profile run, recorded GPU-free: the dummy forward and the dummy sampler.

vLLM measures the activation term of its budget by running the model once on dummy inputs and
reading ``torch.cuda.memory_stats()["allocated_bytes.all.peak"]`` (``gpu_worker.py``
``Worker.determine_available_memory``): a forward over ``max_num_batched_tokens`` tokens
(``gpu_model_runner.py`` ``GPUModelRunner.profile_run`` -> ``_dummy_run``), then the sampler over
one row of logits per request, ``min(max_num_seqs, max_num_batched_tokens)`` rows
(``_dummy_sampler_run``). ``trace_profile_run`` runs the same two steps on the meta device with
oomkit's tracer (``prediction.tracing.trace_step``) and returns the peak above what was live
before the run, rounded as the CUDA caching allocator rounds each block (512 bytes,
``CUDACachingAllocator.cpp`` ``round_size``): the figure vLLM logs as "peak activation".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomkit.core.gpus import GpuSpec
from oomkit.errors import OomkitError

__all__ = ["SORT_WORKSPACE_BYTES_PER_ELEMENT", "ProfilePeak", "RankRecorder", "trace_profile_run"]

# The transient of CUDA's segmented sort of the sampler's [rows, vocab] fp32 logits: an int64
# iota of indices (8 bytes) and cub's alternate fp32 keys and int64 values (4 + 8), per element
# (ATen/native/cuda/SortStable.cu launch_stable_sort_kernel, cub DeviceRadixSort::SortPairs).
# An estimate: with it the recorded profile of Llama-3.1-8B (8192 tokens, 1024 rows) is
# 4.71 GiB where vLLM logged 4.76 GiB peak activation on an H100 (llm-d/llm-d-benchmark
# config_explorer/empirical-vllm-memory-results.md); without it, 2.88 GiB. (Recorded before
# the tracer decomposed composite ops under inference_mode, which adds the 32 MiB cuBLAS
# workspace of the run's first matmul, as on CUDA: about 4.74 GiB now, not re-run.)
SORT_WORKSPACE_BYTES_PER_ELEMENT = 20

# CUDACachingAllocator.cpp round_size: every block is a multiple of kMinBlockSize = 512 bytes.
_MIN_BLOCK_BYTES = 512


@dataclass(frozen=True)
class ProfilePeak:
    """What one recorded profile run allocated above its start.

    Attributes:
        num_tokens: tokens of the dummy forward.
        num_logit_rows: rows of logits the dummy sampler ran over (0: no sampler).
        peak_bytes: the most allocated at once above the start (vLLM's ``torch_peak_increase``).
        forward_peak_bytes: the same, during the forward only.
        sampler_peak_bytes: the same, from the logits to the end of sampling.
        warnings: what the tracer could not model, one line each.
    """

    num_tokens: int
    num_logit_rows: int
    peak_bytes: int
    forward_peak_bytes: int
    sampler_peak_bytes: int
    warnings: tuple[str, ...] = ()


def _dummy_sampler(logits: Any, *, inplace: bool) -> Any:
    """vLLM's V1 sampler on the dummy metadata of ``_dummy_sampler_run`` (temperature 0.5,
    top-p 0.9, top-k vocab - 1, no penalties, no logprobs), with torch-native top-k/top-p.

    Mirrors, op for op, ``v1/sample/sampler.py`` ``Sampler.forward`` / ``sample`` and
    ``v1/sample/ops/topk_topp_sampler.py`` ``apply_top_k_top_p`` / ``random_sample``. ``inplace``:
    the newer releases cumsum into the softmax's buffer and scatter into the logits
    (``torch.cumsum(..., out=probs_sort)``, ``logits.scatter_``); 0.8 made new tensors.
    """
    import torch

    rows, vocab = logits.shape
    temperature = torch.full((rows,), 0.5, dtype=torch.float32, device=logits.device)
    top_p = torch.full((rows,), 0.9, dtype=torch.float32, device=logits.device)
    top_k = torch.full((rows,), vocab - 1, dtype=torch.int32, device=logits.device)
    # Sampler.forward: sampling runs in fp32.
    logits = logits.to(torch.float32)
    # Sampler.sample: the greedy answer first, then temperature in place.
    greedy = logits.argmax(dim=-1).view(-1)
    logits.div_(temperature.unsqueeze(dim=1))
    # apply_top_k_top_p: sort, mask below the k-th and outside the top-p mass, unsort.
    # CUDA's sort of rows longer than 4096 (ATen/native/cuda/SortStable.cu
    # launch_stable_sort_kernel) sorts pairs with cub: an int64 index input and cub's alternate
    # key and value buffers live while it runs, ~20 bytes an element on top of the outputs
    # (SORT_WORKSPACE_BYTES_PER_ELEMENT: an estimate; meta's sort allocates only the outputs).
    workspace = torch.empty(
        rows * vocab * SORT_WORKSPACE_BYTES_PER_ELEMENT, dtype=torch.uint8, device=logits.device
    )
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    del workspace
    top_k_mask = logits_sort.size(1) - top_k.to(torch.long)
    top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
    top_k_mask = logits_sort < top_k_mask
    logits_sort.masked_fill_(top_k_mask, -float("inf"))
    del top_k_mask
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort) if inplace else probs_sort.cumsum(
        dim=-1
    )
    top_p_mask = probs_sum <= 1 - top_p.unsqueeze(dim=1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, -float("inf"))
    del top_p_mask, probs_sum, probs_sort
    if inplace:
        logits = logits.scatter_(dim=-1, index=logits_idx, src=logits_sort)
        masked = logits
    else:
        masked = logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)
    del logits_sort, logits_idx
    # TopKTopPSampler.forward_native -> random_sample: exponential race.
    probs = masked.softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs)
    q.exponential_()
    sampled = probs.div_(q).argmax(dim=-1).view(-1)
    return torch.where(temperature < 1e-5, greedy, sampled)


def _peaks(recording: Any, split_marker: int) -> tuple[int, int, int]:
    """Peak allocated above the step start, overall, before and after ``split_marker`` events."""
    start = recording.step_starts[0]
    live = 0
    for event in recording.events[:start]:
        if event.action == "alloc":
            live += -(-event.size // _MIN_BLOCK_BYTES) * _MIN_BLOCK_BYTES
        elif event.action == "free_requested":
            live -= -(-event.size // _MIN_BLOCK_BYTES) * _MIN_BLOCK_BYTES
    base = live
    forward = sampler = 0
    for index, event in enumerate(recording.events[start:], start):
        size = -(-event.size // _MIN_BLOCK_BYTES) * _MIN_BLOCK_BYTES
        if event.action == "alloc":
            live += size
        elif event.action == "free_requested":
            live -= size
        if index < split_marker:
            forward = max(forward, live - base)
        else:
            sampler = max(sampler, live - base)
    return max(forward, sampler), forward, sampler


def trace_profile_run(
    built: Any,
    *,
    num_tokens: int,
    num_logit_rows: int,
    gpu: GpuSpec,
    inplace_sampler: bool = True,
) -> ProfilePeak:
    """Record the engine's dummy forward over ``num_tokens`` tokens, then (``num_logit_rows`` >
    0) its dummy sampler over that many rows of logits, on the meta device.

    Args:
        built: the rank's model (``weights.rank_model``), on meta.
        num_tokens: tokens of the dummy batch (vLLM: ``max_num_batched_tokens``).
        num_logit_rows: rows the sampler sees (vLLM: ``min(max_num_seqs, num_tokens)``); 0
            records the forward only (a CUDA graph capture has no sampler).
        gpu: the device the CUDA emulations choose kernels for.
        inplace_sampler: see ``_dummy_sampler``.

    Returns:
        The peaks above what was live before the run (the weights).
    """
    import torch

    from oomkit.prediction.tracing import trace_step

    base = built.model if hasattr(built, "model") else built
    head = built.get_output_embeddings()

    def step(_model: Any, ids: torch.Tensor) -> None:
        with torch.inference_mode():
            hidden = base(input_ids=ids, use_cache=False).last_hidden_state[0]
            if num_logit_rows:
                # compute_logits on the last token of each dummy request.
                rows = torch.arange(num_logit_rows, device=hidden.device)
                logits = head(hidden[rows])
                _dummy_sampler(logits, inplace=inplace_sampler)

    ids = torch.zeros((1, num_tokens), dtype=torch.long, device="meta")
    try:
        recording = trace_step(step, built, ids, gpu=gpu)
    except OomkitError as exc:
        return _estimated_profile(built, head, num_tokens, num_logit_rows, gpu, inplace_sampler,
                                  reason=str(exc).splitlines()[0])
    # Forward and sampler split at the LM head's output: the first allocation tagged with the
    # head's module path.
    split = len(recording.events)
    head_path = next((name for name, module in built.named_modules() if module is head), None)
    if num_logit_rows and head_path is not None:
        for index in range(recording.step_starts[0], len(recording.events)):
            tags = dict(recording.events[index].tags)
            if recording.events[index].action == "alloc" and tags.get("module") == head_path:
                split = index
                break
    peak, forward, sampler = _peaks(recording, split)
    return ProfilePeak(
        num_tokens=num_tokens,
        num_logit_rows=num_logit_rows,
        peak_bytes=peak,
        forward_peak_bytes=forward,
        sampler_peak_bytes=sampler,
        warnings=tuple(recording.warnings),
    )


def _estimated_profile(built: Any, head: Any, num_tokens: int, num_logit_rows: int,
                       gpu: GpuSpec, inplace_sampler: bool, *, reason: str) -> ProfilePeak:
    """The profile run when the model's forward cannot run on meta (a routing or RoPE variant
    that reads values): the sampler recorded alone over meta logits, next to the final hidden
    states, and the forward estimated as one decoder layer's widest live set, ``tokens x (4 x
    hidden + 3 x intermediate)`` elements in the model dtype (an MLP's gate, up and product
    beside the residual stream)."""
    import torch

    from oomkit.prediction.tracing import trace_step

    config = built.config
    hidden_size = int(config.hidden_size)
    intermediate = int(getattr(config, "intermediate_size", 4 * hidden_size) or 4 * hidden_size)
    element = next(built.parameters()).element_size()
    forward = num_tokens * (4 * hidden_size + 3 * intermediate) * element
    vocab = int(head.weight.shape[0])

    def sampler_step() -> None:
        with torch.inference_mode():
            hidden = torch.empty((num_tokens, hidden_size), dtype=head.weight.dtype)
            if num_logit_rows:
                logits = torch.empty((num_logit_rows, vocab), dtype=head.weight.dtype)
                _dummy_sampler(logits, inplace=inplace_sampler)
            del hidden

    sampler = 0
    if num_logit_rows:
        recording = trace_step(sampler_step, gpu=gpu)
        sampler, _, _ = _peaks(recording, len(recording.events))
    return ProfilePeak(
        num_tokens=num_tokens,
        num_logit_rows=num_logit_rows,
        peak_bytes=max(forward, sampler),
        forward_peak_bytes=forward,
        sampler_peak_bytes=sampler,
        warnings=(f"the forward could not be recorded on meta ({reason}); its activation is "
                  "estimated from the config, the sampler recorded alone",),
    )


class RankRecorder:
    """One rank's model, built once, and its recorded profile runs, each recorded once.

    Args:
        built: the rank's model on meta (``weights.rank_model``).
        gpu: the device the CUDA emulations choose kernels for.
        inplace_sampler: see ``_dummy_sampler``.
    """

    def __init__(self, built: Any, gpu: GpuSpec, *, inplace_sampler: bool = True) -> None:
        self.built = built
        self.gpu = gpu
        self.inplace_sampler = inplace_sampler
        self._peaks: dict[tuple[int, int], ProfilePeak] = {}

    def peak(self, num_tokens: int, num_logit_rows: int) -> ProfilePeak:
        """The recorded run of ``num_tokens`` tokens and ``num_logit_rows`` sampled rows."""
        key = (num_tokens, num_logit_rows)
        if key not in self._peaks:
            self._peaks[key] = trace_profile_run(
                self.built,
                num_tokens=num_tokens,
                num_logit_rows=num_logit_rows,
                gpu=self.gpu,
                inplace_sampler=self.inplace_sampler,
            )
        return self._peaks[key]
