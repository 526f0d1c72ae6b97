"""Batch-size finders compared on the simulated CUDA device (issue 5 §4).

For each built-in workload (a preset at a small setting on a small simulated GPU) this measures:

- the true maximum batch: every batch size from 1 up is run (two training steps on a fresh
  simulated device) until one runs out of memory, and a few sizes above it are run too, to make
  sure none of them fits (an exhaustive scan, not a bisection);
- oomkit's predicted batch (``oomkit.plan.batch_search.max_batch_size``, margin 0 unless
  ``--margin-mib``: the prediction itself is what is compared), and the OOMs paid when
  ``oomkit.runtime.batch_probe.find_batch_size`` confirms it on the simulated device;
- the batch found and the OOMs paid by ``accelerate.utils.find_executable_batch_size`` (its
  default start, 128, shrinking by 0.9 per OOM) and by Lightning's ``Tuner.scale_batch_size``
  in ``power`` and ``binsearch`` modes (its defaults: start 2, 3 steps per trial), run on the same
  simulated device and workloads.

Every step runs on the meta device under ``SimulatedCudaDevice(device_type="meta")``: shapes and
lifetimes are real, values are not computed, so a step costs no arithmetic. Two things are set as
CUDA sets them, since meta kernels would otherwise take other paths: ``torch.optim`` uses its
foreach kernels (the presets ask for them), and ``scaled_dot_product_attention`` runs the fused
kernel CUDA picks (the memory-efficient one for fp32 inputs; on meta it would take the math path
and materialise the attention matrix), by the SDPA hook of oomkit's tracer, which the simulated
device runs through the same engine (``emulations=``). Only that forward choice is emulated:
everything else is what the meta kernels allocate.

Lightning runs on meta through a small accelerator/strategy pair (``_MetaAccelerator``,
``_MetaStrategy``) and an iterable dataset of host (CPU) samples that Lightning copies to the
device each step, as it would to a GPU: Lightning needs nothing else.

Prints a table and, last, one JSON line:
{"rows": [{"workload": ..., "true_max_batch": ..., "oomkit_batch": ..., "oomkit_ooms": ...,
  "accelerate_batch": ..., "accelerate_ooms": ..., "lightning_batch": ..., "lightning_ooms": ...,
  "lightning_binsearch_batch": ..., "lightning_binsearch_ooms": ..., ...}, ...], "targets": {...}}
(``lightning_*`` is the power mode, Lightning's default.) ``runs_fresh`` says, per finder, whether
its answer also runs alone on a fresh device: a search leaves cached segments behind, and a size
that ran inside the search can OOM in a new process (the table marks those with ``!``).

Needs the ``bench`` extra: ``pip install oomkit[bench]`` (accelerate, lightning).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from oomkit.core.target import Target
from oomkit.plan.batch_search import max_batch_size
from oomkit.prediction.models import StepOptions, build_preset_step
from oomkit.prediction.tracing import DEFAULT_EMULATIONS
from oomkit.prediction.tracing.emulations.sdpa import SDPA_FUNCTION
from oomkit.runtime import SimulatedCudaDevice, current_device
from oomkit.runtime.batch_probe import find_batch_size

STEPS = 2  # training steps per probe: the first optimizer step and one steady-state step
# Sizes above the first OOM that the exhaustive scan also runs (none may fit).
CHECK_ABOVE = 3
TARGET_WITHIN_PCT = 5.0
TARGET_OOMKIT_OOMS = 1


@dataclass(frozen=True)
class Workload:
    """One preset at one setting on one simulated GPU."""

    name: str
    preset: str
    gpu: str
    options: dict[str, Any] = field(default_factory=dict)

    def step_options(self, batch_size: int) -> StepOptions:
        return StepOptions(batch_size=batch_size, **self.options)


# Small settings so that the whole comparison runs in minutes on 2 CPU cores; GPU sizes chosen
# so that the true maximum is below accelerate's default start (128).
WORKLOADS = (
    Workload("gpt2-124m seq128 fp32 adamw @4GiB", "gpt2-124m", "4GiB", {"seq_len": 128}),
    Workload("bert-base seq128 fp32 adamw @4GiB", "bert-base", "4GiB", {"seq_len": 128}),
    Workload("vit-b16 img224 fp32 adamw @6GiB", "vit-b16", "6GiB", {"image_size": 224}),
    Workload("resnet50 img128 fp32 adamw @2GiB", "resnet50", "2GiB", {"image_size": 128}),
)


# ---------------------------------------------------------------------- CUDA kernel choices


# sdp_utils.cpp select_sdp_backend: the kernel CUDA runs for scaled_dot_product_attention on the
# simulated GPU (a plain size picks as an H100 does: the memory-efficient kernel for fp32), whose
# meta op allocates the output and the fp32 logsumexp that autograd saves for its backward.
CUDA_ATTENTION = {SDPA_FUNCTION: DEFAULT_EMULATIONS[SDPA_FUNCTION]}


@contextlib.contextmanager
def simulated(gpu: str) -> Iterator[SimulatedCudaDevice]:
    """A fresh simulated GPU for meta tensors, with CUDA's attention kernel."""
    with SimulatedCudaDevice(gpu, device_type="meta", emulations=CUDA_ATTENTION) as device:
        yield device


def run_steps(workload: Workload, batch_size: int) -> None:
    """Build the workload at ``batch_size`` on meta and run ``STEPS`` training steps."""
    built = build_preset_step(workload.preset, workload.step_options(batch_size), device="meta")
    for _ in range(STEPS):
        built.step_fn()


def fits(workload: Workload, batch_size: int) -> bool:
    """Whether ``batch_size`` runs on a fresh simulated device."""
    with simulated(workload.gpu):
        try:
            run_steps(workload, batch_size)
        except torch.OutOfMemoryError:
            return False
        finally:
            gc.collect()
    return True


# ---------------------------------------------------------------------- the finders


def true_max(workload: Workload, seen: dict[int, bool]) -> tuple[int, int]:
    """Exhaustive scan: (largest size that runs, sizes run); ``seen`` gets every outcome."""
    batch, runs = 1, 0
    while True:
        runs += 1
        seen[batch] = fits(workload, batch)
        if not seen[batch]:
            break
        batch += 1
    largest = batch - 1
    for above in range(batch + 1, batch + 1 + CHECK_ABOVE):
        runs += 1
        seen[above] = fits(workload, above)
        if seen[above]:
            raise RuntimeError(
                f"{workload.name}: batch {above} runs although {batch} does not; memory is not "
                "monotonic in the batch size here, so the scan's answer would be wrong"
            )
    return largest, runs


def oomkit_prediction(workload: Workload, margin_bytes: int) -> Any:
    """oomkit's prediction: ``max_batch_size`` on the same GPU, no real step run."""
    return max_batch_size(
        lambda b: build_preset_step(workload.preset, workload.step_options(b)),
        target=Target.resolve(workload.gpu),
        margin_bytes=margin_bytes,
        steps=STEPS,
    )


def oomkit_confirmed(workload: Workload, predicted: int) -> tuple[int, int]:
    """``find_batch_size`` from the prediction, on one simulated device: (batch, OOMs)."""
    with simulated(workload.gpu) as device:
        result = find_batch_size(lambda b: run_steps(workload, b), predicted=predicted)
        assert result.oom_count == device.oom_count
    return result.batch_size, result.oom_count


@contextlib.contextmanager
def _empty_cache_reaches_the_simulated_device() -> Iterator[None]:
    """What accelerate and Lightning call on CUDA after an OOM, routed to the simulated device.

    accelerate's ``clear_device_cache`` ends in ``torch.cuda.empty_cache()`` only where CUDA is
    available (accelerate/utils/memory.py); Lightning's ``garbage_collection_cuda`` calls
    ``torch.cuda.empty_cache()`` (lightning/pytorch/utilities/memory.py), a no-op without CUDA.
    """
    import accelerate.utils.memory as accelerate_memory

    original_clear = accelerate_memory.clear_device_cache
    original_empty = torch.cuda.empty_cache

    def clear_device_cache(garbage_collection: bool = False) -> None:
        original_clear(garbage_collection=garbage_collection)
        current_device().empty_cache()

    accelerate_memory.clear_device_cache = clear_device_cache
    torch.cuda.empty_cache = lambda: current_device().empty_cache()
    try:
        yield
    finally:
        accelerate_memory.clear_device_cache = original_clear
        torch.cuda.empty_cache = original_empty


def accelerate_search(workload: Workload) -> tuple[int, int]:
    """``find_executable_batch_size`` with its defaults: (batch, OOMs)."""
    from accelerate.utils import find_executable_batch_size

    with simulated(workload.gpu) as device, _empty_cache_reaches_the_simulated_device():

        @find_executable_batch_size
        def train(batch_size: int) -> int:
            run_steps(workload, batch_size)
            return batch_size

        batch = train()
        return batch, device.oom_count


def _lightning_module(workload: Workload) -> Any:
    import lightning.pytorch as pl

    class _Samples(torch.utils.data.IterableDataset):
        """Endless samples shaped like one row of the preset's batch, in host memory.

        As on a GPU, the loader's batches live on the host (CPU tensors are not accounted by
        the meta-type simulated device) until Lightning's ``batch_to_device`` copies them over.
        The values are never read (the step runs on meta), so they stay uninitialised.
        """

        def __init__(self, shapes: tuple[tuple[torch.Size, torch.dtype], ...]) -> None:
            self.shapes = shapes

        def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
            while True:
                yield tuple(torch.empty(s, dtype=d) for s, d in self.shapes)

    class _PresetModule(pl.LightningModule):
        """The preset's model, AdamW (foreach) and cross-entropy loss, as its step has them."""

        def __init__(self) -> None:
            super().__init__()
            built = build_preset_step(workload.preset, workload.step_options(1), device="meta")
            model, _optimizer, inputs, labels = built.track
            assert isinstance(model, torch.nn.Module)
            assert isinstance(inputs, torch.Tensor) and isinstance(labels, torch.Tensor)
            self.net = model
            self.shapes = tuple((t.shape[1:], t.dtype) for t in (inputs, labels))
            self.batch_size = 2

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, labels = batch
            logits = self.net(inputs)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, foreach=True)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(_Samples(self.shapes), batch_size=self.batch_size)

    return _PresetModule()


def lightning_search(workload: Workload, mode: str, tmp_dir: str) -> tuple[int, int]:
    """``Tuner.scale_batch_size`` in ``mode`` with its defaults: (batch, OOMs)."""
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.strategies import SingleDeviceStrategy
    from lightning.pytorch.tuner import Tuner

    class _MetaAccelerator(CPUAccelerator):
        def setup_device(self, device: torch.device) -> None:
            pass

    class _MetaStrategy(SingleDeviceStrategy):
        def teardown(self) -> None:
            # The default moves the module back to CPU, which meta tensors cannot do.
            pass

    with simulated(workload.gpu) as device, _empty_cache_reaches_the_simulated_device():
        module = _lightning_module(workload)
        trainer = pl.Trainer(
            strategy=_MetaStrategy(torch.device("meta"), accelerator=_MetaAccelerator()),
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_dir,
        )
        batch = Tuner(trainer).scale_batch_size(module, mode=mode)
        assert batch is not None  # None only when the tuner is skipped (fast_dev_run)
        return batch, device.oom_count


# ---------------------------------------------------------------------- report


def _quiet() -> None:
    # Lightning sets its loggers to INFO when imported: import it first, then lower them.
    import lightning.pytorch  # noqa: F401

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def measure(workload: Workload, margin_bytes: int, tmp_dir: str) -> dict[str, Any]:
    seen: dict[int, bool] = {}
    (truth, runs), truth_s = _timed(lambda: true_max(workload, seen))
    prediction, predict_s = _timed(lambda: oomkit_prediction(workload, margin_bytes))
    (confirmed, oomkit_ooms), _ = _timed(lambda: oomkit_confirmed(workload, prediction.batch_size))
    (acc_batch, acc_ooms), acc_s = _timed(lambda: accelerate_search(workload))
    (pl_batch, pl_ooms), pl_s = _timed(lambda: lightning_search(workload, "power", tmp_dir))
    (bs_batch, bs_ooms), bs_s = _timed(lambda: lightning_search(workload, "binsearch", tmp_dir))

    def runs_fresh(batch: int) -> bool:
        # A finder's answer is only as good as a fresh run at that size: caching state left by
        # the probes before it can let a size run inside the search that OOMs in a new process.
        if batch not in seen:
            seen[batch] = fits(workload, batch)
        return seen[batch]

    return {
        "workload": workload.name,
        "true_max_batch": truth,
        "oomkit_batch": prediction.batch_size,
        "oomkit_ooms": oomkit_ooms,
        "accelerate_batch": acc_batch,
        "accelerate_ooms": acc_ooms,
        "lightning_batch": pl_batch,
        "lightning_ooms": pl_ooms,
        "lightning_binsearch_batch": bs_batch,
        "lightning_binsearch_ooms": bs_ooms,
        "oomkit_confirmed_batch": confirmed,
        "runs_fresh": {
            "oomkit": runs_fresh(prediction.batch_size),
            "accelerate": runs_fresh(acc_batch),
            "lightning": runs_fresh(pl_batch),
            "lightning_binsearch": runs_fresh(bs_batch),
        },
        "oomkit_traces": prediction.traces,
        "oomkit_error_pct": round(100.0 * (truth - prediction.batch_size) / truth, 2),
        "truth_runs": runs,
        "seconds": {
            "truth": round(truth_s, 1),
            "oomkit_predict": round(predict_s, 1),
            "accelerate": round(acc_s, 1),
            "lightning_power": round(pl_s, 1),
            "lightning_binsearch": round(bs_s, 1),
        },
    }


def _table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'workload':<38} {'true':>5} {'oomkit':>6} {'ooms':>4} {'accel':>5} {'ooms':>4} "
        f"{'L-pow':>5} {'ooms':>4} {'L-bin':>5} {'ooms':>4}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        # "!" marks an answer that runs out of memory when run alone on a fresh device.
        mark = {k: " " if ok else "!" for k, ok in r["runs_fresh"].items()}
        lines.append(
            f"{r['workload']:<38} {r['true_max_batch']:>5} {r['oomkit_batch']:>5}{mark['oomkit']} "
            f"{r['oomkit_ooms']:>4} {r['accelerate_batch']:>4}{mark['accelerate']} "
            f"{r['accelerate_ooms']:>4} {r['lightning_batch']:>4}{mark['lightning']} "
            f"{r['lightning_ooms']:>4} {r['lightning_binsearch_batch']:>4}"
            f"{mark['lightning_binsearch']} {r['lightning_binsearch_ooms']:>4}"
        )
    lines.append(
        "true: exhaustive scan; L-pow / L-bin: Lightning power / binsearch; "
        "! = that batch OOMs when run on a fresh device"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads",
        nargs="*",
        default=None,
        help="preset names to run (default: all of " + ", ".join(w.preset for w in WORKLOADS) + ")",
    )
    parser.add_argument(
        "--margin-mib", type=int, default=0, help="oomkit's safety margin in MiB (default 0)"
    )
    args = parser.parse_args()
    _quiet()
    chosen = [w for w in WORKLOADS if args.workloads is None or w.preset in args.workloads]
    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        for workload in chosen:
            print(f"running {workload.name} ...", file=sys.stderr, flush=True)
            rows.append(measure(workload, args.margin_mib * 2**20, tmp_dir))
    print(
        "Largest batch found and OOMs paid, on the simulated CUDA device (meta tensors, "
        f"{STEPS} training steps per probe; oomkit margin {args.margin_mib} MiB)"
    )
    print(_table(rows))
    within = all(
        0
        <= r["true_max_batch"] - r["oomkit_batch"]
        <= r["true_max_batch"] * TARGET_WITHIN_PCT / 100
        for r in rows
    )
    ooms_ok = all(r["oomkit_ooms"] <= TARGET_OOMKIT_OOMS for r in rows)
    print(
        f"oomkit within {TARGET_WITHIN_PCT:g}% of the true maximum and never above it: "
        f"{'yes' if within else 'NO'}; oomkit paid at most {TARGET_OOMKIT_OOMS} OOM: "
        f"{'yes' if ooms_ok else 'NO'}"
    )
    targets = {
        "oomkit_within_pct": TARGET_WITHIN_PCT,
        "oomkit_max_ooms": TARGET_OOMKIT_OOMS,
        "met_within": within,
        "met_ooms": ooms_ok,
    }
    print(json.dumps({"rows": rows, "targets": targets}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
