"""torchtitan's published Llama 3.1 peaks against oomkit's torchtitan route (issue 38).

Reads ``benchmarks/data/torchtitan_published.json`` (the rows of torchtitan's
benchmarks/llama3_h100_202412_torchtitan.md, with their source commit) and predicts each row the
torchtitan route can express (``oomkit.prediction.torchtitan_job``: torchtitan 0.3.0's own
config, model, ``parallelize_llama``, loss and optimizer on a fake process group of the row's
world size); async TP runs Inductor's micro-pipeline pass and records its fused ops
(``prediction/tracing/async_tp.py``). The job is the 2024 one written as 0.3.0 overrides: the
row's FSDP / TP / CP degrees, local batch and sequence length, torchtitan's selective (op) or
full AC, Float8 as 2024 ran it (torchao's tensorwise recipe on the blocks' linears, the LM head
in bf16: ``--override.imports oomkit.prediction._torchtitan_float8.float8_block_linears``;
0.3.0's registry has Float8 configs for the debug model only; ``--float8-all-gather`` adds
torchao's FSDP2 float8 all-gather, ``enable_fsdp_float8_all_gather``), no CUDA
graphs (``--training.disable_cuda_graphs``: 2024's eager step), DTensor TP with
FSDP2 over plain parameters (``--parallelism.spmd_backend partial_dtensor``), SDPA attention;
the loss is the plain cross-entropy over the full logits (2024's; ``--loss configured`` keeps
0.3.0's chunked loss instead). The GPU is a 96 GiB H100 (the Grand Teton H100's HBM2e), as
``oomkit predict --gpu 96GiB``.

``--rows`` picks rows by id (default: every row); ``--preset`` also predicts the 8B FSDP rows
through oomkit's preset route (``oomkit.predict("llama3-8b", fsdp=N, ...)``) for comparison.
``--eager-part`` records each row's eager part instead (no compile or async TP; Float8, context
and pipeline parallel kept): its peak is printed against the row's with its error, as a
different job, and its wall time.
``--stages`` predicts, for a pipeline-parallel row, the first rank of every pipeline stage and
compares their maximum, as the table's memory column is taken (its footnote: "Different PP ranks
can have different peak memory usages. We take the maximum across all GPUs"); without it the
row is rank 0's (stage 0). The first rank of a stage stands for all of its ranks here: torchtitan
puts ``pp`` outermost in its mesh (torchtitan/distributed/parallel_dims.py ``build_mesh``:
``pp, dp_replicate, dp_shard, cp, tp``), so stage ``s`` holds ranks ``s * world / pp`` onward,
and FSDP 8 and TP 8 divide every dimension of the 405B's parameters, so its ranks' shards are
alike (``--all-ranks`` also records each stage's last rank, for uneven shards).
``--torch-version X.Y`` predicts for that torch (``Target.resolve(..., torch_version=)``; default:
the installed one). The rows ran on torch 1963fc83 (2024-12-23, the 2.6 development line), whose
ProcessGroupNCCL called ``record_stream`` on every collective's tensors (before 2.8:
``prediction/tracing/stream_timeline.py``), so a block a collective used came back only once the
GPU passed that collective: the prediction is then a range, from the GPU keeping up (the
verdict's figure) to the GPU a full launch queue behind; each row records it
(``gpu_timing``). ``--lags N ...`` also replays the recording with the GPU N allocations behind
(``core/trace/delayed_frees.py``) and records each peak, to say how far behind the GPU must run
for the measured peak. ``--pipeline-outputs merged`` steps a pipeline row's schedule as 9dec370
did (``TorchtitanJob.pipeline_outputs``: the last stage keeps every micro-batch's output and
merges them at the step's end).
Prints a table, then writes ``--out`` (JSON): each row's measured and predicted GiB (the
prediction's ``required_bytes``: its peak reserved when the step fits 96 GiB, else the peak
reserved of the same replay on unlimited memory), the error in % and the wall time, or the
route's refusal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_TORCH_VERSION: str | None = None  # --torch-version (None: the installed torch)
_LAGS: tuple[int, ...] = ()  # --lags
_PIPELINE_OUTPUTS = "dropped"  # --pipeline-outputs
_RANKS: tuple[int, ...] = ()  # --ranks (with --stages: only these stages' first ranks)
sys.path.insert(0, str(HERE))  # torchtitan_long_configs, a registry module of one's own
GIB = 2**30


# 2024's Float8 (torchtitan/float8.py at 9dec370: torchao's default tensorwise recipe, every
# linear but the output one); first, as --override.imports takes every value up to the next flag
_FLOAT8 = (
    "--override.imports",
    'oomkit.prediction._torchtitan_float8.float8_block_linears={"recipe_name": "tensorwise"}',
)
# --float8-all-gather: the same with torchao's FSDP2 float8 all-gather, as torchtitan's docs at
# 9dec370 launched Float8 (docs/float8.md: --float8.enable_fsdp_float8_all_gather) and its
# 405B config set it (train_configs/llama3_405b.toml); the 2024 table does not say.
_FLOAT8_ALL_GATHER = (
    "--override.imports",
    'oomkit.prediction._torchtitan_float8.float8_block_linears={"recipe_name": "tensorwise", '
    '"enable_fsdp_float8_all_gather": true}',
)
# --float8-precompute: the all-gather with torchao's precompute_float8_dynamic_scale_for_fsdp
# after each optimizer step, as torchtitan's docs at 9dec370 launched Float8 (docs/float8.md:10
# --float8.precompute_float8_dynamic_scale_for_fsdp) and its 405B config set it
# (train_configs/llama3_405b.toml [float8])
_FLOAT8_PRECOMPUTE = (
    "--override.imports",
    'oomkit.prediction._torchtitan_float8.float8_block_linears={"recipe_name": "tensorwise", '
    '"enable_fsdp_float8_all_gather": true, "precompute_float8_dynamic_scale_for_fsdp": true}',
)


# The 405B's registry config converts to Float8 itself (0.3.0: rowwise); 2024's 405B job ran
# torchao's tensorwise recipe with float8 all-gather and the scales' precompute
# (train_configs/llama3_405b.toml [float8] at 9dec370): float8_recipe sets all three
_FLOAT8_405B = (
    "--override.imports",
    'oomkit.prediction._torchtitan_float8.float8_recipe={"recipe_name": "tensorwise", '
    '"enable_fsdp_float8_all_gather": true, "precompute_float8_dynamic_scale_for_fsdp": true}',
)


def _overrides(row: dict) -> tuple[str, ...]:
    layout = row["layout"]
    ac = {"selective-op": (), "full": ("activation_checkpoint:full",)}[row["activation_checkpoint"]]
    return (
        *((_FLOAT8_405B if row["model"] == "405B" else _FLOAT8) if row.get("float8", False)
          else ()),
        "--parallelism.spmd_backend", "partial_dtensor",
        "--training.disable_cuda_graphs",
        # the row's compile (torchtitan's apply_compile: each block and the loss); the 405B
        # config compiles (with async TP) by default, so an eager row says no-enable
        "--compile.enable" if row["compile"] else "--compile.no-enable",
        # 2024's torchtitan compiled each block only (apply_compile); the loss's compile (0.3.0's
        # default components ["model", "loss"]) came later
        *(("--compile.components", "model") if row["compile"] else ()),
        # async TP (torchtitan's _maybe_enable_async_tp; Inductor's micro_pipeline_tp pass and
        # the fused symm_mem ops: prediction/tracing/async_tp.py)
        "--compile.enable-async-tensor-parallel" if row.get("async_tp") and row["compile"]
        else "--compile.no-enable-async-tensor-parallel",
        "--training.local_batch_size", str(row["local_batch_size"]),
        "--training.seq_len", str(row["seq_len"]),
        "--parallelism.data_parallel_shard_degree", str(layout["fsdp"]),
        "--parallelism.tensor_parallel_degree", str(layout["tp"]),
        "--parallelism.context_parallel_degree", str(layout.get("cp", 1)),
        # pipeline parallel: torchtitan's own pipeline_llm and schedule; rank 0 runs stage 0
        # (1F1B's warm-up keeps the most micro-batches in flight there)
        *(("--parallelism.pipeline_parallel_degree", str(layout["pp"]),
           "--parallelism.pipeline_parallel_schedule", row["pp_schedule"],
           "--parallelism.pipeline_parallel_microbatch_size", str(_microbatch_size(row)))
          if layout.get("pp", 1) > 1 else ()),
        *ac,
    )


def _microbatch_size(row: dict) -> int:
    """2024's micro-batch: torchtitan 9dec370 (the rows' commit) split the local batch into as
    many micro-batches as the pipeline degree, for every schedule (torchtitan/parallelisms/
    pipelining_utils.py build_pipeline_schedule: ``n_microbatches = job_config.experimental.
    pipeline_parallel_degree`` when ``pipeline_parallel_microbatches`` is None): 8 micro-batches
    of 4 for 1F1B and Interleaved1F1B alike. The number of stages (16 under Interleaved1F1B)
    became the default on 2025-01-07 (torchtitan 90567fc, "fix num_microbatches input for PP",
    pytorch/torchtitan#781), after these rows ran. 0.3.0 takes a micro-batch size instead
    (default 1: 32 micro-batches of 1 for these rows)."""
    return max(1, row["local_batch_size"] // row["layout"]["pp"])


def _job_name(row: dict) -> tuple[str, str]:
    """torchtitan's ``--module`` and ``--config`` (Float8 comes with ``_FLOAT8``, the 405B's own
    converter aside): the registry's, or for more than 131,072 tokens (0.3.0's RoPE maximum)
    ``torchtitan_long_configs.py``'s, which sizes RoPE as 2024's torchtitan did."""
    if row["seq_len"] > 131_072:
        return "torchtitan_long_configs", f"llama3_{row['model'].lower()}_256k"
    return "llama3", f"llama3_{row['model'].lower()}"


def _eager_part(row: dict) -> dict:
    """The row eager, without async TP (Float8, context and pipeline parallel are kept)."""
    layout = dict(row["layout"])
    gpus = layout["fsdp"] * layout["tp"] * layout.get("pp", 1) * layout["cp"]
    return dict(row, layout=layout, gpus=gpus, compile=False, async_tp=False)


def _stage_ranks(row: dict) -> tuple[int, ...]:
    """The first rank of each pipeline stage (each rank's first under interleaved 1F1B): ``pp``
    is the outermost mesh dimension (torchtitan/distributed/parallel_dims.py ``build_mesh``)."""
    pp = row["layout"].get("pp", 1)
    return tuple(stage * (row["gpus"] // pp) for stage in range(pp))


def _predict_stages(row: dict, loss: str) -> dict:
    """Each stage's first rank predicted; the row's figures are the highest one's, with every
    stage's peak under ``stages`` (torchtitan's table takes the maximum over all GPUs)."""
    stages = []
    for rank in _stage_ranks(row):
        if _RANKS and rank not in _RANKS:
            continue
        got = _predict_row(row, loss, rank=rank)
        stages.append(got)
        timing = got.get("gpu_timing", {})
        span = timing.get("reserved_range_gib")
        print(f"  rank {rank:4}: {got['predicted_reserved_gib']:6.2f} GiB reserved "
              f"({got['predicted_allocated_gib']:.2f} allocated) in {got['wall_s']:.0f} s"
              + (f"; GPU timing {span[0]:.2f}-{span[1]:.2f} GiB" if span else "")
              + (f"; at lags {timing['reserved_allocated_gib_at_lag']}"
                 if "reserved_allocated_gib_at_lag" in timing else ""),
              flush=True)
    top = max(stages, key=lambda got: got["predicted_reserved_gib"])
    return {
        **top,
        "peak_rank": top["rank"],
        "wall_s": round(sum(got["wall_s"] for got in stages), 1),
        "cpu_s": round(sum(got["cpu_s"] for got in stages), 1),
        "stages": [
            {key: got[key] for key in ("rank", "description", "predicted_reserved_gib",
                                       "predicted_allocated_gib", "fits_96gib", "wall_s",
                                       "gpu_timing") if key in got}
            for got in stages
        ],
    }


def _predict_row(row: dict, loss: str, rank: int = 0) -> dict:
    from oomkit.core.target import Target
    from oomkit.prediction.predictor import predict_recording
    from oomkit.prediction.torchtitan_job import TorchtitanJob, record_torchtitan_job

    target = Target.resolve("96GiB", torch_version=_TORCH_VERSION)
    job = TorchtitanJob(
        *_job_name(row), _overrides(row),
        world_size=row["gpus"], loss=loss,  # type: ignore[arg-type]
        rank=rank,
        # a pipeline row's step as torchtitan 0.3.0 ("dropped") or 2024 ("merged") stepped it
        pipeline_outputs=_PIPELINE_OUTPUTS if row["layout"].get("pp", 1) > 1 else "dropped",  # type: ignore[arg-type]
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    recording, run = record_torchtitan_job(job, target=target)
    recorded_s = time.perf_counter() - start
    prediction = predict_recording(recording, target=target, description=run.description)
    wall_s = time.perf_counter() - start
    # required_bytes: the peak reserved when it fits, else the same replay's on unlimited memory
    reserved = prediction.required_bytes / GIB
    return {
        "job": f"{job.module}:{job.config} {' '.join(job.overrides)} (world size {job.world_size}, loss {loss})",
        "rank": rank,
        "description": run.description,
        "predicted_reserved_gib": round(reserved, 2),
        "predicted_allocated_gib": round(prediction.peak_allocated_bytes / GIB, 2),
        "fits_96gib": prediction.fits,
        "error_pct": round(100 * (reserved - row["measured_gib"]) / row["measured_gib"], 1),
        "record_s": round(recorded_s, 1),
        "wall_s": round(wall_s, 1),
        # this process's CPU time: the wall time on a shared machine waits for the others
        "cpu_s": round(time.process_time() - cpu_start, 1),
        "warnings": list(recording.warnings),
        **_gpu_timing(recording, prediction, target),
    }


def _gpu_timing(recording, prediction, target) -> dict:
    """The GPU-timing range of a prediction (``prediction.distributed``) and, for ``--lags``, the
    peaks with the GPU that many allocations behind the CPU (the collectives' frees moved,
    ``core/trace/delayed_frees.py``; unlimited memory, as the range's upper end)."""
    from oomkit.core.trace.delayed_frees import delayed_frees
    from oomkit.prediction._replay import replay_for_prediction

    memory = prediction.distributed
    if memory is None or memory.reserved_range_bytes is None:
        return {}
    ids = recording.collective_ids or frozenset()
    timing: dict = {
        "torch_version": target.torch_version,
        "collective_allocations": len(ids),
        "reserved_range_gib": [round(b / GIB, 2) for b in memory.reserved_range_bytes],
        "allocated_range_gib": [round(b / GIB, 2) for b in memory.allocated_range_bytes],
    }
    if _LAGS and ids:
        starts = tuple(recording.step_starts)
        at_lag = {}
        for lag in _LAGS:
            replayed = replay_for_prediction(
                delayed_frees(recording.events, starts, ids, lag_allocations=lag),
                starts,
                target.allocator_config,
                capacity_bytes=2**50,  # unlimited, as the range's upper end
                reserved_outside_bytes=0,
                torch_version=target.torch_version,
                max_points=1,
            )
            at_lag[str(lag)] = [round(replayed.peak_reserved_bytes / GIB, 2),
                                round(replayed.peak_allocated_bytes / GIB, 2)]
        timing["reserved_allocated_gib_at_lag"] = at_lag
    return {"gpu_timing": timing}


def _preset_row(row: dict) -> dict:
    import oomkit

    start = time.perf_counter()
    prediction = oomkit.predict(
        "llama3-8b", fsdp=row["layout"]["fsdp"], batch=row["local_batch_size"],
        seq=row["seq_len"], checkpointing="selective-op", gpu="96GiB",
    )
    reserved = prediction.required_bytes / GIB
    return {
        "predicted_reserved_gib": round(reserved, 2),
        "fits_96gib": prediction.fits,
        "predicted_allocated_gib": round(prediction.peak_allocated_bytes / GIB, 2),
        "error_pct": round(100 * (reserved - row["measured_gib"]) / row["measured_gib"], 1),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="row ids (default: all)")
    parser.add_argument("--loss", choices=("cross_entropy", "configured"), default="cross_entropy")
    parser.add_argument("--preset", action="store_true", help="also the preset route (8B FSDP)")
    parser.add_argument("--eager-part", action="store_true",
                        help="each row's eager part (no compile or async TP) instead")
    parser.add_argument("--stages", action="store_true",
                        help="pipeline rows: every stage's first rank, the maximum compared "
                             "(as torchtitan's table)")
    parser.add_argument("--out", type=Path, help="write the results here (JSON)")
    parser.add_argument("--float8-all-gather", action="store_true",
                        help="Float8 rows with torchao's FSDP2 float8 all-gather")
    parser.add_argument("--float8-precompute", action="store_true",
                        help="with --float8-all-gather: torchao's scale precompute after each "
                             "optimizer step")
    parser.add_argument("--torch-version", metavar="X.Y",
                        help="predict for this torch (the rows ran on 2.6's development line); "
                             "default: the installed one")
    parser.add_argument("--lags", nargs="*", type=int, default=[], metavar="N",
                        help="also replay with the GPU N allocations behind the CPU (where the "
                             "torch calls record_stream on collectives' tensors)")
    parser.add_argument("--pipeline-outputs", choices=("dropped", "merged"), default="dropped",
                        help="pipeline rows: 'merged' steps the schedule as torchtitan 9dec370 "
                             "did (the last stage keeps and merges its outputs)")
    parser.add_argument("--ranks", nargs="*", type=int, default=[], metavar="R",
                        help="with --stages: only the stages whose first rank is one of these")
    args = parser.parse_args()
    if any(lag < 0 for lag in args.lags):
        parser.error("--lags takes allocation counts of 0 or more")
    global _TORCH_VERSION, _LAGS, _PIPELINE_OUTPUTS
    _TORCH_VERSION, _LAGS = args.torch_version, tuple(args.lags)
    _PIPELINE_OUTPUTS = args.pipeline_outputs
    global _RANKS
    _RANKS = tuple(args.ranks)
    if _RANKS and not args.stages:
        parser.error("--ranks picks pipeline stages: add --stages")
    if args.float8_precompute and not args.float8_all_gather:
        parser.error("--float8-precompute precomputes float8 all-gather's scales: add "
                     "--float8-all-gather")
    if args.float8_all_gather:
        global _FLOAT8
        _FLOAT8 = _FLOAT8_PRECOMPUTE if args.float8_precompute else _FLOAT8_ALL_GATHER
    from oomkit.errors import OomkitError

    def predict(row: dict) -> dict:
        if args.stages and row["layout"].get("pp", 1) > 1:
            return _predict_stages(row, args.loss)
        return _predict_row(row, args.loss)

    data = json.loads((HERE / "data" / "torchtitan_published.json").read_text())
    rows = [r for r in data["rows"] if not args.rows or r["id"] in args.rows]
    results = []
    timed_parts: dict[tuple, tuple[str, dict]] = {}
    load_before = os.getloadavg()
    for row in rows:
        out: dict = {"id": row["id"], "measured_gib": row["measured_gib"]}
        if args.eager_part:
            part = _eager_part(row)
            key = (part["model"], _overrides(part), part["gpus"])
            if key in timed_parts:  # the same job as an earlier row's part
                timed = {**timed_parts[key][1], "same_as": timed_parts[key][0]}
            else:
                try:
                    timed = predict(part)
                except OomkitError as exc:  # torchtitan's own refusal of the part, kept
                    timed = {"refused": str(exc)}
                timed_parts[key] = (row["id"], timed)
            out["eager_part"] = {
                "world_size": part["gpus"], **timed,
                "note": "a different job (eager, no async TP): "
                        "its error is against the row's measured peak",
            }
        else:
            try:
                out["torchtitan_route"] = predict(row)
            except OomkitError as exc:  # the route's refusal, kept
                out["refused"] = str(exc)
            if args.preset and row["model"] == "8B":
                out["preset_route"] = _preset_row(row)
        results.append(out)
        got = out.get("torchtitan_route") or out.get("eager_part") or {}
        if "refused" in out or "refused" in got:
            refusal = out.get("refused") or got["refused"]
            print(f"{row['id']:34} measured {row['measured_gib']:6.1f} GiB  refused: {refusal[:150]}")
            continue
        what = "eager part" if args.eager_part else "torchtitan route"
        fits = "" if got["fits_96gib"] else " (does not fit 96 GiB)"
        line = (
            f"{row['id']:34} measured {row['measured_gib']:6.1f} GiB  {what} "
            f"{got['predicted_reserved_gib']:6.2f} GiB ({got['error_pct']:+.1f}%){fits} in "
            f"{got['wall_s']:.0f} s ({got['cpu_s']:.0f} s of CPU)"
        )
        span = got.get("gpu_timing", {}).get("reserved_range_gib")
        if span:
            line += f"  GPU timing {span[0]:.2f}-{span[1]:.2f} GiB"
        if "preset_route" in out:
            pre = out["preset_route"]
            line += f"  preset route {pre['predicted_reserved_gib']:.2f} GiB ({pre['error_pct']:+.1f}%)"
        print(line, flush=True)
    report = {
        "benchmark": "torchtitan_rows",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "source": data["source"],
        "loss": args.loss,
        "eager_part": args.eager_part,
        "stages": args.stages,
        "float8_all_gather": args.float8_all_gather,
        "float8_precompute": args.float8_precompute,
        "torch_version": args.torch_version,
        "lags": list(args.lags),
        "pipeline_outputs": args.pipeline_outputs,
        "ranks": list(args.ranks),
        "machine": {
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_before": load_before, "load_after": os.getloadavg(),
        },
        "rows": results,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
