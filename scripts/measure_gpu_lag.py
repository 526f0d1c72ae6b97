"""How far a real GPU trails the CPU, in allocations: the lag of issue 38's range model.

Run on a machine with a CUDA GPU, from the repository root::

    python scripts/measure_gpu_lag.py --out lag.json          # every shape in SHAPES
    python scripts/measure_gpu_lag.py --only gpt2-small

oomkit's multi-GPU range (``core/trace/delayed_frees.py``, ``benchmarks/torchtitan_rows.py
--lags``) moves each free that waits on a collective's event to N allocations later: the
allocations the CPU makes between issuing the collective and the GPU completing it. The
405B rows' gap note (``benchmarks/data/torchtitan_405b_1f1b_gap.md``, section 2) says the
measured peaks fit a lag of 32-40 allocations, and that how far the GPU trailed on those
machines is recorded nowhere. This script measures that lag on one GPU for a stack of
Llama-style blocks with full activation checkpointing, in bf16, at three sizes of kernel:

- ``gpt2-small``: GPT-2 124M's block sizes (dim 768, 12 heads, 4 x 512 tokens): small kernels,
  the CPU the bottleneck;
- ``llama3-8b``: Llama 3.1 8B's block (dim 4096, 32 heads, 8 KV heads, FFN 14336), 1 x 8192
  tokens: one GPU's share of torchtitan's 8B FSDP row (local batch 2 is two of these);
- ``llama3-405b-tp8``: one TP-8 rank's share of a Llama 3.1 405B block (dim 16384, 16 of 128
  heads, 1 of 8 KV heads, FFN 6656 of 53248), one micro-batch of 4 x 8192 tokens, as the PP rows
  run it (no collectives: the real rank also waits on TP's, so the GPU trails it more).

How: a ``TorchDispatchMode`` counts the CPU's allocations (op outputs whose storage is none of
the inputs') and records a CUDA event after every op; after each op it polls the oldest pending
events (one stream: they complete in order). When op k is first seen complete, its lag is the
allocations made since op k was issued. The mode's own work (~10-20 us an op) slows the CPU,
so each figure is a lower bound of plain eager's lag. Also printed: the CPU's time to issue a
step against the GPU's time to run it (without the mode).

Output: one JSON with, per shape, the lag's median, 90th percentile and maximum (allocations
and ops), the launch queue's deepest backlog in ops, and the two step times. The summary
functions are pure and tested without a GPU (tests/scripts/test_measure_gpu_lag.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Shape:
    """One block size and batch (a Llama-style block: RMSNorm, GQA attention, SwiGLU)."""

    name: str
    dim: int
    heads: int  # query heads on this GPU
    kv_heads: int  # key/value heads on this GPU
    head_dim: int
    ffn_dim: int  # on this GPU
    batch: int
    seq_len: int
    blocks: int


SHAPES: tuple[Shape, ...] = (
    Shape("gpt2-small", dim=768, heads=12, kv_heads=12, head_dim=64, ffn_dim=3072,
          batch=4, seq_len=512, blocks=12),
    Shape("llama3-8b", dim=4096, heads=32, kv_heads=8, head_dim=128, ffn_dim=14336,
          batch=1, seq_len=8192, blocks=8),
    Shape("llama3-405b-tp8", dim=16384, heads=16, kv_heads=1, head_dim=128, ffn_dim=6656,
          batch=4, seq_len=8192, blocks=8),
)


# --------------------------------------------------------------------------- pure parts


def lags_of(issued_at: Sequence[int], seen_at: Sequence[int]) -> list[int]:
    """Each op's lag in allocations: the CPU's allocation count when the op was first seen
    complete minus the count when it was issued. An op not seen complete before the step was
    issued (``seen_at`` -1) is left out; ``censored_lags`` gives those a lower bound."""
    return [seen - issued for issued, seen in zip(issued_at, seen_at, strict=True) if seen >= 0]


def censored_lags(issued_at: Sequence[int], seen_at: Sequence[int], end: int) -> list[int]:
    """Every op's lag, those not seen complete before the step's end given ``end - issued``
    (a lower bound: the GPU had not run them when the CPU made its last allocation)."""
    return [
        (seen if seen >= 0 else end) - issued
        for issued, seen in zip(issued_at, seen_at, strict=True)
    ]


def summarize_lags(lags: Sequence[int]) -> dict:
    """Median, 90th percentile and maximum of a lag series (``None`` each when it is empty)."""
    if not lags:
        return {"ops": 0, "median": None, "p90": None, "max": None}
    ordered = sorted(lags)
    p90 = ordered[min(len(ordered) - 1, (9 * len(ordered)) // 10)]
    return {"ops": len(ordered), "median": statistics.median(ordered), "p90": p90,
            "max": ordered[-1]}


# --------------------------------------------------------------------------- GPU parts


def _model(shape: Shape, markers: Any = None) -> Any:  # pragma: no cover - needs a GPU
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            s = shape
            self.attn_norm = nn.RMSNorm(s.dim)
            self.wq = nn.Linear(s.dim, s.heads * s.head_dim, bias=False)
            self.wk = nn.Linear(s.dim, s.kv_heads * s.head_dim, bias=False)
            self.wv = nn.Linear(s.dim, s.kv_heads * s.head_dim, bias=False)
            self.wo = nn.Linear(s.heads * s.head_dim, s.dim, bias=False)
            self.ffn_norm = nn.RMSNorm(s.dim)
            self.w1 = nn.Linear(s.dim, s.ffn_dim, bias=False)
            self.w3 = nn.Linear(s.dim, s.ffn_dim, bias=False)
            self.w2 = nn.Linear(s.ffn_dim, s.dim, bias=False)

        def _forward(self, x: Any) -> Any:
            s = shape
            b, t, _ = x.shape
            h = self.attn_norm(x)
            q = self.wq(h).view(b, t, s.heads, s.head_dim).transpose(1, 2)
            k = self.wk(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            v = self.wv(h).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=s.kv_heads != s.heads)
            x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

        def forward(self, x: Any) -> Any:
            return checkpoint(self._forward_marked, x, use_reentrant=False)

        def _forward_marked(self, x: Any) -> Any:
            if markers is not None:
                markers.mark()  # in forward, and again when backward recomputes the block
            return self._forward(x)

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = nn.Sequential(*(Block() for _ in range(shape.blocks))).to(torch.bfloat16)
        x = torch.randn(shape.batch, shape.seq_len, shape.dim, dtype=torch.bfloat16,
                        requires_grad=True)
    return model, x


def _step(model: Any, x: Any) -> None:  # pragma: no cover - needs a GPU
    model(x).float().square().mean().backward()
    for p in model.parameters():
        p.grad = None
    x.grad = None


def _measure(shape: Shape, steps: int) -> dict:  # pragma: no cover - needs a GPU
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    model, x = _model(shape)
    _step(model, x)  # warm-up: cuBLAS handles, kernels loaded
    torch.cuda.synchronize()

    # The step's two times without the mode: the CPU's to issue it, the GPU's to run it.
    start = time.perf_counter()
    _step(model, x)
    issued_s = time.perf_counter() - start
    torch.cuda.synchronize()
    total_s = time.perf_counter() - start

    class LagMode(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.allocations = 0
            self.issued_at: list[int] = []
            self.seen_at: list[int] = []
            self.seen_op: list[int] = []
            self.events: list[Any] = []
            self.oldest = 0  # the first op not yet seen complete
            self.deepest_backlog_ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_cuda}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_cuda and t.untyped_storage().nbytes():
                    if t.untyped_storage().data_ptr() not in inputs:
                        self.allocations += 1
            event = torch.cuda.Event()
            event.record()
            self.events.append(event)
            self.issued_at.append(self.allocations)
            self.seen_at.append(-1)
            self.seen_op.append(-1)
            while self.oldest < len(self.events) and self.events[self.oldest].query():
                self.seen_at[self.oldest] = self.allocations
                self.seen_op[self.oldest] = len(self.events) - 1
                self.events[self.oldest] = None
                self.oldest += 1
            self.deepest_backlog_ops = max(self.deepest_backlog_ops, len(self.events) - self.oldest)
            return out

    records = []
    for _ in range(steps):
        mode = LagMode()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with mode:
            _step(model, x)
        mode_issued_s = time.perf_counter() - start
        torch.cuda.synchronize()
        lags = lags_of(mode.issued_at, mode.seen_at)
        records.append({
            "ops": len(mode.issued_at),
            "allocations": mode.allocations,
            "ops_seen_complete_while_issuing": len(lags),
            "lag_allocations": summarize_lags(lags),
            "lag_allocations_pending_as_lower_bound": summarize_lags(
                censored_lags(mode.issued_at, mode.seen_at, mode.allocations)
            ),
            "lag_ops": summarize_lags(lags_of(range(len(mode.seen_op)), mode.seen_op)),
            "ops_pending_at_end": len(mode.events) - mode.oldest,
            "deepest_backlog_ops": mode.deepest_backlog_ops,
            "issue_time_with_mode_s": mode_issued_s,
        })
    return {
        "shape": asdict(shape),
        "method": "dispatch-mode",
        "step_issue_time_s": issued_s,
        "step_total_time_s": total_s,
        "steps": records,
    }


MARKER_BYTES = 3 * 512  # a size no tensor of these blocks has: the markers' own allocations


class _Markers:  # pragma: no cover - needs a GPU
    """A block-boundary marker whose free the allocator defers, as a collective's buffer's.

    ``mark()`` makes a side stream wait for the current one, allocates ``MARKER_BYTES``, calls
    ``record_stream(side)`` and frees it: CUDACachingAllocator records an event on the side
    stream (``insert_events``), which completes when the GPU reaches this point of the step, and
    the block's ``free_completed`` is logged at the first ``malloc`` after that
    (``process_events``). So the allocations between a marker's ``free_requested`` and its
    ``free_completed`` are how far the GPU trails the CPU, in the unit of
    ``core/trace/delayed_frees.py``, measured by the allocator itself with the step at full
    speed (one Python call per block).
    """

    def __init__(self) -> None:
        import torch

        self.side = torch.cuda.Stream()
        self._torch = torch

    def mark(self) -> None:
        torch = self._torch
        self.side.wait_stream(torch.cuda.current_stream())
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8, device="cuda")
        marker.record_stream(self.side)
        del marker


def allocator_lags(entries: Sequence[tuple[str, int, int]], marker_bytes: int) -> list[int]:
    """Per marker, the allocations (markers' own left out) between its ``free_requested`` and
    its ``free_completed`` in a trace of ``(action, address, size)``; a marker still pending at
    the end counts the allocations to the end."""
    pending: dict[int, int] = {}  # marker address -> allocations seen when it was freed
    allocations = 0
    lags: list[int] = []
    for action, address, size in entries:
        if action == "alloc" and size != marker_bytes:
            allocations += 1
        elif action == "free_requested" and size == marker_bytes:
            pending[address] = allocations
        elif action == "free_completed" and size == marker_bytes and address in pending:
            lags.append(allocations - pending.pop(address))
    lags.extend(allocations - start for start in pending.values())
    return lags


def _measure_allocator(shape: Shape, steps: int) -> dict:  # pragma: no cover - needs a GPU
    import torch

    markers = _Markers()
    model, x = _model(shape, markers)
    _step(model, x)
    torch.cuda.synchronize()
    records = []
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None, stacks="python")
    seen = 0  # trace entries of the steps before
    for _ in range(steps):
        start = time.perf_counter()
        _step(model, x)
        issued_s = time.perf_counter() - start
        torch.cuda.synchronize()
        total_s = time.perf_counter() - start
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        entries = [(e["action"], e["addr"], e["size"]) for e in trace[seen:]]
        seen = len(trace)
        lags = allocator_lags(entries, MARKER_BYTES)
        records.append({
            "markers": len(lags),
            "allocations": sum(1 for a, _, s in entries if a == "alloc" and s != MARKER_BYTES),
            "lag_allocations": summarize_lags(lags),
            "lags": lags,
            "issue_time_s": issued_s,
            "total_time_s": total_s,
        })
    torch.cuda.memory._record_memory_history(enabled=None)
    return {"shape": asdict(shape), "method": "allocator", "steps": records}


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - needs a GPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", action="append", help="run only these shapes")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("measure_gpu_lag: no CUDA device here; run it on a machine with a GPU.", file=sys.stderr)
        return 2
    results = []
    for shape in SHAPES:
        if args.only and shape.name not in args.only:
            continue
        for method in (_measure_allocator, _measure):
            try:
                result = method(shape, args.steps)
            except Exception as exc:  # keep the other shapes' figures
                result = {"shape": asdict(shape), "method": method.__name__,
                          "error": f"{type(exc).__name__}: {exc}"}
            results.append(result)
            print(json.dumps(result), flush=True)
            torch.cuda.empty_cache()
    document = {
        "device_name": torch.cuda.get_device_name(0),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "shapes": results,
    }
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
