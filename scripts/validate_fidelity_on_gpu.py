"""Ground truth for issue 14's fidelity points: small probes run on a real CUDA GPU and predicted.

Run on a machine with a CUDA GPU, from the repository root::

    python scripts/validate_fidelity_on_gpu.py              # every probe
    python scripts/validate_fidelity_on_gpu.py --only cross-entropy-backward

Each probe runs in its own child process (a fresh CUDA context and fresh cuBLAS handles):

- ``inference-mode-autocast`` (item 1): a stack of fp32 linears under ``torch.inference_mode()``
  and ``torch.autocast("cuda", torch.bfloat16)``; autocast caches no weight cast there.
- ``no-grad-autocast`` (item 1, the other side): the same under ``torch.no_grad()``, where
  autocast does cache the casts of leaf weights that require grad (grad mode is not a condition
  of aten/src/ATen/autocast_mode.cpp ``cached_cast``; inference mode is).
- ``cross-entropy-backward`` (item 2): cross entropy on fp32 logits and its backward, where
  CUDA's ``gather`` backward scatters into a zeroed buffer in place.
- ``context-lazy`` / ``context-eager`` (item 3): memory outside the allocator after the first
  op and a cuBLAS matmul, with ``CUDA_MODULE_LOADING`` unset and ``EAGER``; compared with the
  range ``oomkit.core.gpus.overhead.cuda_context`` assumes for this GPU, CUDA and mode.

- ``layer-norm-two-pass``: a 768-wide layer norm over 100,000 rows, forward and backward; past
  65,536 rows torch 2.8 and later reduce its weight and bias gradients in two passes
  (emulations/layer_norm.py), read from the source and never measured.
- ``layer-norm-transposed``: a layer norm of a transposed input (ViT's ``ln_1`` seen through a
  transpose), whose CUDA forward and backward copy the input (``expect_contiguous``).
- ``rms-norm-fused``: ``nn.RMSNorm`` in bf16 over 100,000 rows, forward and backward: torch 2.9's
  fused ``_fused_rms_norm`` (emulations/rms_norm.py) and its two-pass weight gradient.
- ``clip-grad-norm``: ``clip_grad_norm_`` of 8 gradients: ``_foreach_norm``'s per-chunk partial
  norms (emulations/foreach_norm.py).
- ``amax-columns``: ``torch.amax`` of a [16384, 14336] bf16 gradient over the tokens, as
  torchao's rowwise float8 scaling takes it: its multi-block staging in the input's type
  (emulations/reductions.py).

- ``nccl-one-rank`` (issue 38 item 3): device memory outside the allocator that NCCL's first
  one-rank communicator adds (init, first collectives), then a second and a third; oomkit counts
  no buffers for one rank, so this is NCCL's fixed cost per process and per communicator.

The peak probes also keep the GPU's requests in order (``measured_events``) and the recording's
(``predicted_events``, for the installed torch), to compare where the peaks differ. The compiled GPT-2 step of item 4 is a run of
``scripts/validate_on_gpu.py`` (``compile=True``).

It writes ``validation/fidelity-<gpu>-torch<version>.json``. The comparison functions are pure
and unit-tested without a GPU (tests/scripts/test_validate_fidelity_on_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

MiB = 2**20


# --------------------------------------------------------------------------- pure parts


def compare_peak(probe: str, measured_bytes: int, predicted_bytes: int) -> dict:
    """A peak-allocated probe's record: both figures, the signed difference and relative error."""
    error = None if measured_bytes <= 0 else (predicted_bytes - measured_bytes) / measured_bytes
    return {
        "probe": probe,
        "measured_peak_allocated_bytes": measured_bytes,
        "predicted_peak_allocated_bytes": predicted_bytes,
        "difference_bytes": predicted_bytes - measured_bytes,
        "relative_error": error,
        "exact": predicted_bytes == measured_bytes,
    }


def compare_context(probe: str, measured_bytes: int, context: Mapping[str, Any]) -> dict:
    """A context probe's record: the measured bytes against the assumed range and point.

    Args:
        probe: the probe's name.
        measured_bytes: ``total - free - reserved`` after the first op and a cuBLAS matmul.
        context: ``expected_bytes``, ``low_bytes``, ``high_bytes`` (and anything to keep) of
            the ``CudaContext`` oomkit assumes.
    """
    low, high = int(context["low_bytes"]), int(context["high_bytes"])
    expected = int(context["expected_bytes"])
    return {
        "probe": probe,
        "measured_bytes": measured_bytes,
        "assumed": dict(context),
        "within_range": low <= measured_bytes <= high,
        "error_of_point_bytes": expected - measured_bytes,
    }


def output_path(root: Path, gpu_name: str, torch_version: str) -> Path:
    """``validation/fidelity-<gpu>-torch<version>.json`` with a file-name-safe GPU name."""
    slug = re.sub(r"[^0-9a-z]+", "-", gpu_name.lower()).strip("-")
    return root / "validation" / f"fidelity-{slug}-torch{torch_version.split('+')[0]}.json"


# --------------------------------------------------------------------------- the probes


def _linears(device: str) -> tuple[Callable[[], Any], tuple[Any, ...]]:
    import torch

    torch.manual_seed(0)
    with torch.device(device):
        model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(8)))
        x = torch.randn(64, 4096)
    return model, (x,)


def _inference_mode_autocast(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    model, (x,) = _linears(device)

    def step(model: Any, x: Any) -> Any:
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x).sum()

    return step, (model, x)


def _no_grad_autocast(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    model, (x,) = _linears(device)

    def step(model: Any, x: Any) -> Any:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x).sum()

    return step, (model, x)


def _cross_entropy_backward(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch
    import torch.nn.functional as F

    with torch.device(device):
        logits = torch.zeros(8192, 50257, requires_grad=True)
        target = torch.zeros(8192, dtype=torch.long)

    def step(logits: Any, target: Any) -> None:
        F.cross_entropy(logits, target).backward()
        logits.grad = None

    return step, (logits, target)


def _norm_step(norm: Any, x: Any) -> None:
    y = norm(x)
    y.backward(y.new_ones(y.shape))
    x.grad = None
    norm.zero_grad(set_to_none=True)


def _layer_norm_two_pass(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    with torch.device(device):
        norm = torch.nn.LayerNorm(768)
        x = torch.zeros(100_000, 768, requires_grad=True)
    return _norm_step, (norm, x)


def _layer_norm_transposed(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    with torch.device(device):
        norm = torch.nn.LayerNorm(768)
        x = torch.zeros(197, 8, 768, requires_grad=True)

    def step(norm: Any, x: Any) -> None:
        norm(x.transpose(0, 1)).sum().backward()
        x.grad = None
        norm.zero_grad(set_to_none=True)

    return step, (norm, x)


def _rms_norm_fused(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    with torch.device(device):
        norm = torch.nn.RMSNorm(1024, dtype=torch.bfloat16)
        x = torch.zeros(100_000, 1024, dtype=torch.bfloat16, requires_grad=True)
    return _norm_step, (norm, x)


def _clip_grad_norm(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    with torch.device(device):
        model = torch.nn.Sequential(*(torch.nn.Linear(4096, 4096, bias=False) for _ in range(8)))
        for weight in model.parameters():
            weight.grad = torch.zeros_like(weight)

    def step(model: Any) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    return step, (model,)


def _amax_columns(device: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    import torch

    with torch.device(device):
        gradient = torch.zeros(16384, 14336, dtype=torch.bfloat16)

    def step(gradient: Any) -> None:
        torch.amax(gradient, dim=0, keepdim=True)

    return step, (gradient,)


PEAK_PROBES: dict[str, Callable[[str], tuple[Callable[..., Any], tuple[Any, ...]]]] = {
    "inference-mode-autocast": _inference_mode_autocast,
    "no-grad-autocast": _no_grad_autocast,
    "cross-entropy-backward": _cross_entropy_backward,
    "layer-norm-two-pass": _layer_norm_two_pass,
    "layer-norm-transposed": _layer_norm_transposed,
    "rms-norm-fused": _rms_norm_fused,
    "clip-grad-norm": _clip_grad_norm,
    "amax-columns": _amax_columns,
}
CONTEXT_PROBES: dict[str, str | None] = {"context-lazy": None, "context-eager": "EAGER"}
# Issue 38 item 3: NCCL's memory outside the allocator. One GPU makes a one-rank communicator
# only, for which oomkit counts no buffers (core/gpus/nccl.py: ring and NVLS buffers connect
# peers); what it measures is NCCL's fixed cost per communicator, beside those buffers.
NCCL_PROBES = ("nccl-one-rank",)


def _peak_child(name: str) -> dict:
    import torch

    from oomkit import predict

    step, args = PEAK_PROBES[name]("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=100_000, context=None, stacks="python")
    step(*args)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    target = probe_target(torch.__version__)
    meta_step, meta_args = PEAK_PROBES[name]("meta")
    predicted = predict(meta_step, *meta_args, steps=1, target=target).peak_allocated_bytes
    record = compare_peak(name, measured, predicted)
    # The step's requests in order, to compare with the recording where the peaks differ.
    record["measured_events"] = [
        [e["action"], e["size"]] for e in trace if e["action"] in ("alloc", "free_completed")
    ]
    record["predicted_events"] = predicted_events(name, target)
    return record


def probe_target(torch_version: str) -> Any:
    """The target the probes are predicted for: an H100 (the H200's 132 SMs, which the kernels'
    paths read) running the torch installed here."""
    from oomkit.core.target import Target

    return Target.resolve("h100", torch_version=torch_version.split("+")[0])


def predicted_events(name: str, target: Any) -> list[list[Any]]:
    """The recording of probe ``name``'s step, as ``measured_events`` lists the GPU's: each
    alloc and completed free with its size, from the step's first event."""
    from oomkit.prediction.tracing import trace_step

    step, args = PEAK_PROBES[name]("meta")
    recording = trace_step(step, *args, target=target)
    return [
        [e.action, e.size]
        for e in recording.events[recording.step_starts[0]:]
        if e.action in ("alloc", "free_completed")
    ]


def _context_child(name: str) -> dict:  # pragma: no cover - needs a GPU
    import dataclasses

    import torch

    from oomkit.core.gpus.overhead import cuda_context

    torch.cuda.init()
    a = torch.ones(1024, 1024, device="cuda")
    (a @ a).sum().item()  # loads cuBLAS and its handle, as a first training step does
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    measured = total - free - torch.cuda.memory_reserved()
    props = torch.cuda.get_device_properties(0)
    loading = "eager" if CONTEXT_PROBES[name] == "EAGER" else "lazy"
    context = cuda_context((props.major, props.minor), torch.version.cuda, loading)
    return compare_context(name, measured, dataclasses.asdict(context))


def _nccl_child(name: str) -> dict:  # pragma: no cover - needs a GPU
    import os

    import torch
    import torch.distributed as dist

    from oomkit.core.gpus import get_gpu
    from oomkit.core.gpus.nccl import communicators_of, nccl_memory

    def outside_allocator() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()

    torch.cuda.set_device(0)
    a = torch.ones(1024, 1024, device="cuda")
    (a @ a).sum().item()
    before = outside_allocator()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    after_init = outside_allocator()
    x = torch.ones(64 * 2**20, device="cuda")
    dist.all_reduce(x)
    after_all_reduce = outside_allocator()
    dist.all_gather_into_tensor(torch.empty(x.numel(), device="cuda"), x)
    dist.reduce_scatter_tensor(torch.empty(x.numel(), device="cuda"), x)
    after_collectives = outside_allocator()
    # Two more communicators (one rank each): what a second and third communicator add.
    more = []
    for _ in range(2):
        try:
            group = dist.new_group([0], device_id=torch.device("cuda", 0))
        except TypeError:  # a torch whose new_group takes no device_id: made at first use
            group = dist.new_group([0])
        dist.all_reduce(x, group=group)
        more.append(outside_allocator())
    nccl_version = ".".join(str(v) for v in torch.cuda.nccl.version())
    dist.destroy_process_group()
    gpu = get_gpu(torch.cuda.get_device_name(0))
    assumed = nccl_memory(communicators_of((("fsdp", 1),)), gpu)
    return {
        "probe": name,
        "nccl_version": nccl_version,
        "outside_allocator_before_bytes": before,
        "added_by_init_bytes": after_init - before,
        "added_by_first_all_reduce_bytes": after_all_reduce - after_init,
        "added_by_all_gather_and_reduce_scatter_bytes": after_collectives - after_all_reduce,
        "added_by_second_and_third_communicators_bytes": [
            more[0] - after_collectives, more[1] - more[0]
        ],
        "measured_bytes": after_collectives - before,
        "assumed_bytes": assumed.total_bytes,
    }


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - needs a GPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only these probes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out-root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    if args.child:
        if args.child in NCCL_PROBES:
            record = _nccl_child(args.child)
        elif args.child in CONTEXT_PROBES:
            record = _context_child(args.child)
        else:
            record = _peak_child(args.child)
        print(json.dumps(record))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("validate_fidelity_on_gpu: no CUDA device here; run it on a GPU machine.", file=sys.stderr)
        return 2
    names = [
        n for n in (*PEAK_PROBES, *CONTEXT_PROBES, *NCCL_PROBES) if not args.only or n in args.only
    ]
    records = []
    for name in names:
        env = dict(os.environ)
        env.pop("CUDA_MODULE_LOADING", None)
        if CONTEXT_PROBES.get(name):
            env["CUDA_MODULE_LOADING"] = str(CONTEXT_PROBES[name])
        proc = subprocess.run(
            [sys.executable, __file__, "--child", name],
            capture_output=True, text=True, check=False, env=env,
        )
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or ["(no output)"]
            records.append({"probe": name, "error": lines[-1]})
            print(f"{name}: failed:\n" + "\n".join(lines[-15:]), file=sys.stderr)
            continue
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        records.append(record)
        print(f"{name}: {json.dumps(record)}")
    name = torch.cuda.get_device_name(0)
    path = output_path(args.out_root, name, torch.__version__)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"device_name": name, "torch_version": torch.__version__,
                "cuda_version": torch.version.cuda, "probes": records}
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
