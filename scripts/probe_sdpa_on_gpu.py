"""What scaled_dot_product_attention allocates on a real GPU, call by call, at several shapes.

Run on a machine with a CUDA GPU, from the repository root::

    python scripts/probe_sdpa_on_gpu.py --out sdpa.json

oomkit emulates each SDPA kernel's CUDA memory (``prediction/tracing/emulations/sdpa.py``):
outputs, softmax statistics, and for cuDNN attention's backward a fp32 dQ accumulator, leaving
the rest of cuDNN's graph workspace out with a warning. The H200 validation
(``validation/h200-torch2.11.0.json``) found Llama 1B's cuDNN backward asking for 8,454,400
bytes of workspace where oomkit has 4 MiB, and a 256-byte forward allocation oomkit lacks. One
shape cannot say how the workspace scales, so this script records, for each case below (batch,
query heads, key/value heads, sequence, head dimension, causal, backend), the sizes the caching
allocator was asked for during the forward and during the backward, in order, with
``torch.cuda.memory._record_memory_history``. ``tests/prediction/test_sdpa_gpu_probe.py``
compares oomkit's emulation with the committed result.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Case:
    """One SDPA call: ``q [batch, heads, seq, head_dim]``, ``k``/``v`` with ``kv_heads``."""

    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    causal: bool = True
    backend: str = "default"  # default | flash | efficient | cudnn
    dtype: str = "bfloat16"  # bfloat16 | float32
    layout: str = "bhsd"  # bhsd: contiguous [b, h, s, d]; bshd: [b, s, h, d] transposed, as models


CASES: tuple[Case, ...] = (
    Case(1, 32, 8, 512, 64),  # Llama 3.2 1B's attention in the validation run
    Case(1, 32, 32, 512, 64),
    Case(2, 32, 8, 512, 64),
    Case(1, 16, 8, 512, 64),
    Case(1, 32, 4, 512, 64),
    Case(1, 32, 8, 1024, 64),
    Case(1, 32, 8, 500, 64),
    Case(1, 32, 8, 512, 128),
    Case(1, 32, 8, 4096, 128),
    Case(1, 32, 8, 8192, 128),
    Case(4, 12, 12, 512, 64),
    Case(1, 32, 8, 512, 64, causal=False),
    Case(1, 32, 8, 512, 64, backend="flash"),
    Case(1, 32, 8, 512, 64, backend="efficient"),
    Case(1, 32, 8, 4096, 128, backend="flash"),
    Case(1, 32, 8, 4096, 128, backend="efficient"),
    # Open after the first H200 run (docs/explanations/accuracy.md): fp32 grouped-query attention
    # (Llama 1B fp32 ran a fused kernel where oomkit picks math), and flash's backward with the
    # projections' layout (oomkit records no grad_out / out copies there; the [b, h, s, d] calls
    # above showed both).
    Case(1, 32, 8, 256, 64, dtype="float32"),
    Case(1, 32, 32, 256, 64, dtype="float32"),
    Case(1, 32, 8, 512, 64, backend="flash", layout="bshd"),
    Case(1, 32, 8, 512, 64, layout="bshd"),
)


def _run(case: Case) -> dict:  # pragma: no cover - needs a GPU
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {
        "flash": [SDPBackend.FLASH_ATTENTION],
        "efficient": [SDPBackend.EFFICIENT_ATTENTION],
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
    }
    torch.manual_seed(0)
    dtype = getattr(torch, case.dtype)

    def tensor(heads: int, requires_grad: bool = True) -> torch.Tensor:
        if case.layout == "bshd":  # a [b, s, h, d] projection output, transposed to [b, h, s, d]
            t = torch.randn(case.batch, case.seq, heads, case.head_dim, device="cuda", dtype=dtype)
            t = t.transpose(1, 2)
        else:
            t = torch.randn(case.batch, heads, case.seq, case.head_dim, device="cuda", dtype=dtype)
        return t.detach().requires_grad_(requires_grad)

    q, k, v = tensor(case.heads), tensor(case.kv_heads), tensor(case.kv_heads)
    grad = tensor(case.heads, requires_grad=False)
    gqa = case.kv_heads != case.heads

    def call() -> object:
        return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=gqa)

    def entries(trace: list, start: int) -> list[list]:
        return [[e["action"], e["size"]] for e in trace[start:]
                if e["action"] in ("alloc", "free_completed")]

    context = sdpa_kernel(backends[case.backend]) if case.backend in backends else None
    if context is not None:
        context.__enter__()
    try:
        call().backward(grad)  # warm-up: kernels loaded, cuDNN graphs built and cached
        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=100_000, context=None,
                                                 stacks="python")
        out = call()
        torch.cuda.synchronize()
        forward = torch.cuda.memory._snapshot()["device_traces"][0]
        out.backward(grad)
        torch.cuda.synchronize()
        backward = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        kernel = str(out.grad_fn.name()) if out.grad_fn is not None else None
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    return {
        "case": asdict(case),
        "grad_fn": kernel,
        "forward": entries(forward, 0),
        "backward": entries(backward, len(forward)),
    }


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - needs a GPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("probe_sdpa_on_gpu: no CUDA device here; run it on a machine with a GPU.",
              file=sys.stderr)
        return 2
    results = []
    for case in CASES:
        try:
            result = _run(case)
        except Exception as exc:  # keep the other cases
            result = {"case": asdict(case), "error": f"{type(exc).__name__}: {exc}"}
        results.append(result)
        print(json.dumps(result)[:400], flush=True)
        torch.cuda.empty_cache()
    document = {
        "device_name": torch.cuda.get_device_name(0),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cudnn_version": torch.backends.cudnn.version(),
        "cases": results,
    }
    args.out.write_text(json.dumps(document) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
