"""``oomkit serve vllm|sglang MODEL``: will the serving engine start, with what KV cache, GPU-free.

Exit codes: 0 the engine starts and survives warm-up; 1 it does not (the verdict says where and
which knob to turn); 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import re
import sys

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._common import add_json_flag, print_json, stdout_console
from oomkit.units import parse_bytes

__all__ = ["add_parser", "run"]

EXIT_STARTS = 0
EXIT_FAILS = 1
EXIT_USAGE = 2


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 0.9; got {text!r}") from None
    return value


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except OomkitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# vllm/engine/arg_utils.py human_readable_int (0.13: --max-model-len, --max-num-batched-tokens,
# --kv-cache-memory-bytes): a number and one letter, k m g t decimal (25.6k is 25,600), K M G T
# binary and whole (32K is 32,768; 1.5K is refused), or a plain integer.
_VLLM_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _vllm_int(text: str) -> int:
    match = _VLLM_INT.fullmatch(text.strip())
    if match is None:
        try:
            return int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a whole number as vLLM reads it (32768, 32k = 32,000, 32K = 32,768); "
                f"got {text!r}"
            ) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"vLLM refuses decimals with the binary suffix {suffix} ({text!r}); did you mean "
            f"{number}{suffix.lower()}?"
        )
    return int(number) * _BINARY[suffix]


def _kv_bytes(text: str) -> int:
    """``--kv-cache-memory-bytes``: vLLM's reading (8G is 8 GiB, 8g 8e9 bytes); oomkit's sizes
    with a unit (8GiB, 500MB) are taken too."""
    if _VLLM_INT.fullmatch(text.strip()) or text.strip().isdigit():
        return _vllm_int(text)
    return _size(text)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="a local model directory holding config.json, the config.json itself, a hub "
        "name already in the local Hugging Face cache (no network is used), or a Llama preset "
        "(llama-8b: its published config)",
    )
    parser.add_argument("--gpu", default="h100", help="the device: a catalog GPU or its total "
                        "memory, as predict --gpu (default: h100; see `oomkit gpus`)")
    parser.add_argument("--context-overhead", dest="context_overhead", type=_size, metavar="SIZE",
                        help="memory outside PyTorch on the device (default: the GPU's CUDA "
                        "context, as predict models it)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8, fp8_e4m3, fp8_e5m2")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32")
    parser.add_argument("--quantization", "-q", default=None,
                        help="fp8, or a pre-quantized checkpoint's method (default: the config's own)")
    add_json_flag(parser)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="will vLLM / SGLang start with these flags, and with what KV cache (GPU-free)",
        description="Walk a serving engine's start-up as its release computes it: weights from "
        "the config, the profile run recorded on meta, the KV cache, CUDA graphs and warm-up; "
        "say whether it starts, why not, and which knob to turn. Exit 0: starts; 1: does not; "
        "2: bad input.",
    )
    engines = parser.add_subparsers(dest="engine", required=True, metavar="{vllm,sglang}")
    # No abbreviated flags (as cli/__init__.py build_parser sets for every subcommand).
    vllm = engines.add_parser("vllm", help="vLLM's gpu_memory_utilization, KV blocks, warm-up",
                              description="vLLM's start-up; flags as `vllm serve` spells them.",
                              allow_abbrev=False)
    _common(vllm)
    vllm.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    vllm.add_argument("--max-model-len", type=_vllm_int, default=None)
    vllm.add_argument("--max-num-seqs", type=int, default=None)
    vllm.add_argument("--max-num-batched-tokens", type=_vllm_int, default=None)
    vllm.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9)
    vllm.add_argument("--enforce-eager", action="store_true")
    # 0.13 spells it --cudagraph-capture-sizes (CompilationConfig.cudagraph_capture_sizes);
    # --cuda-graph-sizes is the spelling of the releases between (SchedulerConfig).
    vllm.add_argument("--cudagraph-capture-sizes", "--cuda-graph-sizes", dest="cuda_graph_sizes",
                      type=int, nargs="+", default=None)
    # 0.13's flag is --kv-cache-memory-bytes; its own log suggests --kv-cache-memory=N (a
    # prefix argparse takes), so both spellings are taken.
    vllm.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", dest="kv_cache_memory",
                      type=_kv_bytes, default=None,
                      help="KV cache bytes (8589934592, 8G as vLLM reads it, or 8GiB); skips "
                      "the utilization budget")
    vllm.add_argument("--block-size", type=int, default=16)
    vllm.add_argument("--vllm-version", default=None,
                      help="the release whose accounting to follow: 0.8 or 0.13 (default 0.13)")
    vllm.add_argument("--concurrency", type=int, default=None,
                      help="requests of max_model_len to size --kv-cache-memory for (default: 1)")
    sglang = engines.add_parser("sglang", help="SGLang's mem_fraction_static and KV pool",
                                description="SGLang's start-up; flags as sglang.launch_server spells them.",
                                allow_abbrev=False)
    _common(sglang)
    sglang.add_argument("--tp-size", "--tp", dest="tp", type=int, default=1)
    sglang.add_argument("--mem-fraction-static", type=_fraction, default=None)
    sglang.add_argument("--max-running-requests", type=int, default=None)
    sglang.add_argument("--chunked-prefill-size", type=int, default=None)
    sglang.add_argument("--cuda-graph-max-bs", type=int, default=None)
    sglang.add_argument("--max-total-tokens", type=int, default=None)
    sglang.add_argument("--context-length", type=int, default=None)
    sglang.add_argument("--disable-cuda-graph", action="store_true")
    sglang.add_argument("--page-size", type=int, default=1)
    sglang.add_argument("--sglang-version", default=None, help="0.4 or 0.5 (default 0.5)")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Predict the engine's start-up and print it; 0 starts, 1 does not, 2 bad input."""
    try:
        return _run(args)
    except OomkitError as exc:
        print(f"oomkit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    from oomkit.prediction import serving

    if args.engine == "vllm":
        request = serving.VllmRequest(
            model=args.model, gpu=args.gpu, context_overhead_bytes=args.context_overhead,
            tensor_parallel_size=args.tensor_parallel_size,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, quantization=args.quantization,
            enforce_eager=args.enforce_eager,
            cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
            kv_cache_memory_bytes=args.kv_cache_memory, block_size=args.block_size,
            vllm_version=args.vllm_version or serving.DEFAULT_VLLM_VERSION,
            concurrency=args.concurrency,
        )
        startup = serving.predict_vllm(request)
        from oomkit.interfaces.reports.serving import render_vllm_startup, vllm_startup_to_json

        if args.json:
            print_json(vllm_startup_to_json(startup))
        else:
            render_vllm_startup(startup, stdout_console())
        return EXIT_STARTS if startup.verdict.starts else EXIT_FAILS
    sg_request = serving.SglangRequest(
        model=args.model, gpu=args.gpu, context_overhead_bytes=args.context_overhead, tp=args.tp, mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size, cuda_graph_max_bs=args.cuda_graph_max_bs,
        max_total_tokens=args.max_total_tokens, context_length=args.context_length,
        kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, quantization=args.quantization,
        disable_cuda_graph=args.disable_cuda_graph, page_size=args.page_size,
        sglang_version=args.sglang_version or serving.DEFAULT_SGLANG_VERSION,
    )
    sg_startup = serving.predict_sglang(sg_request)
    from oomkit.interfaces.reports.serving import render_sglang_startup, sglang_startup_to_json

    if args.json:
        print_json(sglang_startup_to_json(sg_startup))
    else:
        render_sglang_startup(sg_startup, stdout_console())
    return EXIT_STARTS if sg_startup.verdict.starts else EXIT_FAILS
