"""vLLM's and SGLang's start-up logs: their memory figures, their OOM, and the knob that fixes it.

``diagnose_serving_log(text)`` reads a log (or one error message) and returns a
``ServingLogDiagnosis``: which engine, the figures it printed (weights, KV cache, blocks,
concurrency, graph memory, SGLang's pool), the failure it ended on, and the flags to change,
each with its direction. It returns ``None`` for text that is not a serving engine's. The messages
matched are the engines' own (the source file that prints each is named beside its pattern); the
knobs follow the accounting in ``oomkit.prediction.serving``: in vLLM the KV cache gets what the
utilization leaves, so a cache failure wants a higher ``--gpu-memory-utilization`` while an OOM
after the cache (graph capture, sampler warm-up) wants a lower one; in SGLang the KV pool is
``--mem-fraction-static`` of the memory, so "Not enough memory" wants it higher and a run-time OOM
wants it lower.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from oomkit.prediction.serving import Knob

__all__ = ["ServingLogDiagnosis", "diagnose_serving_log", "is_serving_log"]

Engine = Literal["vllm", "sglang"]

_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


# (figure name, pattern, engine): figures print as GiB unless the name says otherwise.
_FIGURES: tuple[tuple[str, re.Pattern[str], Engine], ...] = (
    # gpu_model_runner.py load_model: "Model loading took 14.99 GiB [memory and N seconds]".
    ("weights_gib", re.compile(r"Model loading took " + _NUM + r" ?GiB"), "vllm"),
    # gpu_worker.py determine_available_memory.
    ("available_kv_cache_gib", re.compile(r"Available KV cache memory: " + _NUM + r" ?GiB"), "vllm"),
    # kv_cache_utils.py: "GPU KV cache size: 421,392 tokens".
    ("kv_cache_tokens", re.compile(r"GPU KV cache size: " + _NUM + r" tokens"), "vllm"),
    ("max_concurrency", re.compile(
        r"Maximum concurrency for " + _NUM + r" tokens per request: " + _NUM + r"x"), "vllm"),
    # gpu_model_runner.py capture_model.
    ("cuda_graph_gib", re.compile(r"Graph capturing finished in \d+ secs?, took " + _NUM + r" ?GiB"), "vllm"),
    # worker.py (V0) memory profiling summary.
    ("kv_cache_rest_gib", re.compile(
        r"the rest of the memory reserved for KV Cache is " + _NUM + r" ?GiB"), "vllm"),
    ("activation_peak_gib", re.compile(
        r"(?:PyTorch activation peak memory takes|GiB for weight, )" + r"\s*" + _NUM
        + r" ?GiB(?: for peak activation)?"), "vllm"),
    ("gpu_memory_utilization", re.compile(r"gpu_memory_utilization \(?" + _NUM), "vllm"),
    # model_runner.py (SGLang): "KV Cache is allocated. #tokens: N, K size: X GB".
    ("kv_pool_tokens", re.compile(r"KV Cache is allocated\. #tokens: " + _NUM), "sglang"),
    ("max_total_num_tokens", re.compile(r"max_total_num_tokens=" + _NUM), "sglang"),
    ("max_running_requests", re.compile(r"max_running_requests=" + _NUM), "sglang"),
    ("chunked_prefill_size", re.compile(r"chunked_prefill_size=" + _NUM), "sglang"),
    ("mem_fraction_static", re.compile(r"mem_fraction_static=" + _NUM), "sglang"),
    ("available_gpu_mem_gb", re.compile(r"available_gpu_mem=" + _NUM + r" ?GB"), "sglang"),
    ("load_weight_avail_gb", re.compile(r"Load weight end\..*?avail mem=" + _NUM + r" ?GB"), "sglang"),
)

_VLLM_MARKERS = re.compile(r"vllm|V1 LLM engine|gpu[_ ]memory[_ ]utilization|KV cache memory|cache blocks",
                           re.IGNORECASE)
_SGLANG_MARKERS = re.compile(r"sglang|mem[-_]fraction[-_]static|\[TP\d+\]|max_total_num_tokens|"
                             r"KV Cache is allocated|Memory pool end", re.IGNORECASE)
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError", re.IGNORECASE)
# The engine's own lines (its logger, its modules in a traceback, its settings): what makes a
# PyTorch OOM in the text the engine's, where no figure and no engine-specific failure says so.
# A bare mention ("pip install vllm", a run named VLLM) does not.
_ENGINE_AT_WORK = {
    "vllm": re.compile(r"[/\\]vllm[/\\]|\bvllm\.|\bLLM engine\b|EngineCore|"
                       r"gpu[_ ]memory[_ ]utilization|KV cache memory|cache blocks", re.IGNORECASE),
    "sglang": re.compile(r"[/\\]sglang[/\\]|\bsglang\.|\[TP\d+\]|mem[-_]fraction[-_]static|"
                         r"max_total_num_tokens|KV Cache is allocated|Memory pool end", re.IGNORECASE),
}


@dataclass(frozen=True)
class ServingLogDiagnosis:
    """What a serving engine's log says about its memory.

    Attributes:
        engine: ``"vllm"`` or ``"sglang"``.
        version: the release the log names (``"0.8.1"``), or ``None``.
        figures: the figures found, by name (``weights_gib``, ``kv_cache_tokens``, ...).
        failure: what it failed on (``"no_kv_cache"``, ``"free_memory_at_start"``,
            ``"max_model_len"``, ``"cuda_graph_oom"``, ``"profile_oom"``, ``"load_oom"``,
            ``"sampler_oom"``, ``"runtime_oom"``, ``"not_enough_memory"``), or ``None``.
        message: the log line of the failure.
        knobs: the flags to change, most direct first.
        explanation: one sentence on why that knob, that way.
    """

    engine: Engine
    version: str | None
    figures: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    message: str | None = None
    knobs: tuple[Knob, ...] = ()
    explanation: str = ""


def is_serving_log(text: str) -> bool:
    """Whether ``text`` reads as a vLLM or SGLang log or error."""
    return bool(_VLLM_MARKERS.search(text) or _SGLANG_MARKERS.search(text))


def _engine(text: str) -> Engine | None:
    sglang = len(_SGLANG_MARKERS.findall(text))
    vllm = len(_VLLM_MARKERS.findall(text))
    if not sglang and not vllm:
        return None
    return "sglang" if sglang > vllm else "vllm"


def _line(text: str, pattern: re.Pattern[str]) -> str | None:
    match = pattern.search(text)
    if match is None:
        return None
    start = text.rfind("\n", 0, match.start()) + 1
    end = text.find("\n", match.end())
    return text[start:end if end >= 0 else len(text)].strip()


def _figures(text: str, engine: Engine) -> dict[str, float]:
    found: dict[str, float] = {}
    for name, pattern, owner in _FIGURES:
        if owner != engine:
            continue
        matches = list(pattern.finditer(text))
        if not matches:
            continue
        last = matches[-1]
        if name == "max_concurrency":
            found["max_model_len"] = _number(last.group(1))
            found[name] = _number(last.group(2))
        else:
            found[name] = _number(last.group(1))
    return found


_FREE_AT_START = re.compile(
    r"Free memory on device \(" + _NUM + r"/" + _NUM + r" GiB\) on startup is less than desired "
    r"GPU memory utilization \(" + _NUM)
_MAX_LEN = re.compile(
    r"max seq len \(" + _NUM + r"\).*?estimated maximum model length is " + _NUM, re.DOTALL)
_MAX_LEN_OLD = re.compile(r"max seq len \(" + _NUM + r"\)")
_NO_BLOCKS = re.compile(r"No available memory for the cache blocks")
_NOT_ENOUGH = re.compile(r"Not enough memory\. Please try to increase --mem-fraction-static")
_GRAPH = re.compile(r"Capture cuda graph failed|Capturing CUDA graph|capture_model|cuda graph",
                    re.IGNORECASE)


def _vllm_failure(text: str, figures: dict[str, float]) -> tuple[str | None, str | None, tuple[Knob, ...], str]:
    if (match := _FREE_AT_START.search(text)) is not None:
        free, total = _number(match.group(1)), _number(match.group(2))
        # gpu_worker.py init_device: requested = total * utilization must not exceed the free.
        highest = int(free / total * 100) / 100
        return ("free_memory_at_start", _line(text, _FREE_AT_START),
                (Knob("--gpu-memory-utilization", "lower", f"at most {highest:.2f}"),),
                f"only {free:.2f} of {total:.2f} GiB was free when vLLM started (another process, "
                "or the CUDA context); the utilization asks for a share of the total")
    if (match := _MAX_LEN.search(text)) is not None:
        longest = int(_number(match.group(2)))
        return ("max_model_len", _line(text, _MAX_LEN_OLD),
                (Knob("--max-model-len", "lower", f"at most {longest}"),
                 Knob("--gpu-memory-utilization", "raise", "more memory for the KV cache"),
                 Knob("--kv-cache-dtype", "fp8", "half the bytes a token")),
                "one request of the maximum length does not fit in the KV cache left")
    if _MAX_LEN_OLD.search(text) and "KV cache is needed" in text:
        return ("max_model_len", _line(text, _MAX_LEN_OLD),
                (Knob("--max-model-len", "lower", "to what the KV cache holds"),
                 Knob("--gpu-memory-utilization", "raise", "more memory for the KV cache")),
                "one request of the maximum length does not fit in the KV cache left")
    if _NO_BLOCKS.search(text):
        return ("no_kv_cache", _line(text, _NO_BLOCKS),
                (Knob("--gpu-memory-utilization", "raise", "the KV cache gets what it leaves"),
                 Knob("--max-num-batched-tokens", "lower", "a smaller profile-run peak"),
                 Knob("--max-num-seqs", "lower", "fewer sampler rows in the profile run"),
                 Knob("--tensor-parallel-size", "raise", "weights split over more GPUs"),
                 Knob("--quantization", "fp8", "weights in one byte")),
                "weights and the profile run's peak took all the requested memory")
    if _OOM.search(text):
        oom_line = _line(text, _OOM)
        before = text[: _OOM.search(text).start()]  # type: ignore[union-attr]
        if _GRAPH.search(before[-4000:]):
            return ("cuda_graph_oom", oom_line,
                    (Knob("--gpu-memory-utilization", "lower", "graphs are captured after the KV "
                          "cache and are not in vLLM's budget"),
                     Knob("--enforce-eager", "set", "no CUDA graphs"),
                     Knob("--cudagraph-capture-sizes", "lower", "fewer, smaller graphs")),
                    "CUDA graph capture runs after the KV cache took its share")
        if re.search(r"sampler|warm", before[-4000:], re.IGNORECASE):
            return ("sampler_oom", oom_line,
                    (Knob("--gpu-memory-utilization", "lower", "room for the warm-up after the KV "
                          "cache"),
                     Knob("--max-num-seqs", "lower", "fewer rows of logits")),
                    "the sampler warm-up runs after the KV cache took its share")
        if re.search(r"profile_run|determine_available_memory|memory profiling", before[-4000:],
                     re.IGNORECASE):
            return ("profile_oom", oom_line,
                    (Knob("--max-num-batched-tokens", "lower", "a smaller dummy batch"),
                     Knob("--max-num-seqs", "lower", "fewer sampler rows"),
                     Knob("--tensor-parallel-size", "raise", "weights split over more GPUs")),
                    "the profile run itself does not fit next to the weights")
        if re.search(r"load_model|Loading (?:model )?weights|Starting to load model", before[-4000:],
                     re.IGNORECASE) and "Model loading took" not in before:
            return ("load_oom", oom_line,
                    (Knob("--tensor-parallel-size", "raise", "weights split over more GPUs"),
                     Knob("--quantization", "fp8", "weights in one byte")),
                    "the weights alone do not fit")
        return ("runtime_oom", oom_line,
                (Knob("--gpu-memory-utilization", "lower", "more room outside the KV cache"),
                 Knob("--max-num-batched-tokens", "lower", "smaller steps")),
                "memory ran out outside vLLM's budget")
    return None, None, (), ""


def _sglang_failure(text: str) -> tuple[str | None, str | None, tuple[Knob, ...], str]:
    if _NOT_ENOUGH.search(text):
        return ("not_enough_memory", _line(text, _NOT_ENOUGH),
                (Knob("--mem-fraction-static", "raise", "the KV pool is this share less the "
                      "weights"),
                 Knob("--tp-size", "raise", "weights split over more GPUs"),
                 Knob("--quantization", "fp8", "weights in one byte")),
                "after the weights, nothing of the static fraction is left for the KV pool")
    if _OOM.search(text) or re.search(r"Capture cuda graph failed", text, re.IGNORECASE):
        oom_line = _line(text, _OOM) or _line(text, re.compile("Capture cuda graph failed", re.I))
        graph = re.search(r"cuda graph", text, re.IGNORECASE) is not None
        knobs: tuple[Knob, ...] = (
            Knob("--mem-fraction-static", "lower", "the run's activations and graphs live in the rest"),
        )
        if graph:
            knobs += (Knob("--cuda-graph-max-bs", "lower", "fewer, smaller graphs"),
                      Knob("--disable-cuda-graph", "set", "no CUDA graphs"))
        knobs += (Knob("--chunked-prefill-size", "lower", "a smaller prefill activation"),
                  Knob("--max-running-requests", "lower", "a smaller decode batch"))
        return ("cuda_graph_oom" if graph else "runtime_oom", oom_line, knobs,
                "SGLang's static fraction left too little for activations and graphs: the "
                "opposite of 'Not enough memory'")
    return None, None, (), ""


_VERSION = re.compile(r"(?:V1 LLM engine \(v|vLLM (?:API server )?version |sglang[ =]v?|version=)"
                      r"([0-9]+\.[0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)


def diagnose_serving_log(text: str) -> ServingLogDiagnosis | None:
    """Read a vLLM or SGLang log (or one of their error messages).

    Returns:
        The engine, its figures, the failure and the knobs; ``None`` when the text is neither
        engine's.
    """
    engine = _engine(text)
    if engine is None:
        return None
    figures = _figures(text, engine)
    if engine == "vllm":
        failure, message, knobs, why = _vllm_failure(text, figures)
    else:
        failure, message, knobs, why = _sglang_failure(text)
    if failure == "runtime_oom" and not figures and not _ENGINE_AT_WORK[engine].search(text):
        return None  # a PyTorch OOM that only mentions the engine: explained as PyTorch's
    version = _VERSION.search(text)
    return ServingLogDiagnosis(
        engine=engine,
        version=version.group(1) if version else None,
        figures=figures,
        failure=failure,
        message=message,
        knobs=knobs,
        explanation=why,
    )
