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

The compiled GPT-2 step of item 4 is a run of ``scripts/validate_on_gpu.py`` (``compile=True``).

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


PEAK_PROBES: dict[str, Callable[[str], tuple[Callable[..., Any], tuple[Any, ...]]]] = {
    "inference-mode-autocast": _inference_mode_autocast,
    "no-grad-autocast": _no_grad_autocast,
    "cross-entropy-backward": _cross_entropy_backward,
}
CONTEXT_PROBES: dict[str, str | None] = {"context-lazy": None, "context-eager": "EAGER"}


def _peak_child(name: str) -> dict:  # pragma: no cover - needs a GPU
    import torch

    from oomkit import predict

    step, args = PEAK_PROBES[name]("cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(*args)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated()
    meta_step, meta_args = PEAK_PROBES[name]("meta")
    predicted = predict(meta_step, *meta_args, steps=1).peak_allocated_bytes
    return compare_peak(name, measured, predicted)


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


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - needs a GPU
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", help="run only these probes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out-root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    if args.child:
        record = _context_child(args.child) if args.child in CONTEXT_PROBES else _peak_child(args.child)
        print(json.dumps(record))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("validate_fidelity_on_gpu: no CUDA device here; run it on a GPU machine.", file=sys.stderr)
        return 2
    names = [n for n in (*PEAK_PROBES, *CONTEXT_PROBES) if not args.only or n in args.only]
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
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            records.append({"probe": name, "error": tail[0]})
            print(f"{name}: failed: {tail[0]}", file=sys.stderr)
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
