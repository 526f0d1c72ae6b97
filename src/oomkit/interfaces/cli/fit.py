"""``oomkit fit PRESET|file.py:function --gpu NAME``: the largest batch that fits, without a GPU.

Searches over batch size with the predictor (``oomkit.plan.batch_search.max_batch_size``):
doubling, then bisection, one trace per size. ``--batch N --smallest-gpu`` answers the reverse
question: the smallest catalog GPU that batch fits on. ``--fsdp N``, ``--tp N`` and ``--dp N``
search rank 0's per-rank batch of every layout ``oomkit predict`` predicts (FSDP2, DDP, HSDP,
TP, FSDP2 x TP; recorded on a fake process group, as ``oomkit predict --fsdp/--tp/--dp``), and
``--smallest-gpu --global-batch B`` tabulates GPU counts 1, 2, 4, ... (up to
``--max-gpus``) x catalog GPUs for a global batch B: how many GPUs of which kind. ``--compile``
records every batch tried (and ``--lengths``' every length) with ``torch.compile`` compiled, as
``oomkit predict --compile``: each its own compile, dynamo's caches reset per recording.

Exit codes: 0 a batch was found (or, with ``--smallest-gpu``, a GPU), 1 not even batch 1 fits
(no GPU of the catalog fits), 2 bad input, 3 torch is not installed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from oomkit.errors import NoFeasibleBatchSizeError, OomkitError, UserCodeError
from oomkit.interfaces.cli._common import (
    add_json_flag,
    print_json,
    size_arg,
    stderr_console,
    stdout_console,
)
from oomkit.interfaces.cli._compile_flag import add_compile_flag
from oomkit.interfaces.cli._data_parallel import add_ddp_flags, ddp_bucket_cap_mb
from oomkit.interfaces.cli._envelope import add_lengths_flags, run_fit_envelope
from oomkit.interfaces.cli._progress import (
    add_jobs_flag,
    progress_bar,
    progress_enabled,
    tracing_jobs,
)
from oomkit.interfaces.cli._target import add_parallel_flags
from oomkit.interfaces.cli._workload import (
    Workload,
    add_gpu_flags,
    add_workload_flags,
    build_workload,
    catalog_epilog,
    positive_int,
    require_target,
    user_errors,
    user_output_to_stderr,
    user_values,
    user_workload_spec,
)
from oomkit.plan.batch_probe import RecordingBuilder

if TYPE_CHECKING:
    from oomkit.core.target import ParallelLayout, Target
    from oomkit.interfaces.cli._sharded import ShardedWorkload

__all__ = ["add_parser", "run", "progress_enabled"]

# A model's batch is fixed by its training setup; the default bound of the search.
DEFAULT_MAX_BATCH = 65536
# The largest GPU count --smallest-gpu --global-batch tabulates by default.
DEFAULT_MAX_GPUS = 64


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "fit",
        help="find the largest batch that fits on a GPU, without a GPU",
        description="Search over batch size with the predictor (double, then bisect; one "
        "trace per size, no GPU, no OOMs) for the largest batch whose training step fits on "
        "--gpu with --margin to spare. Every recorded step counts (the first optimizer step "
        "too), and --seq is taken as the longest sequence the run will see. With --batch N "
        "--smallest-gpu, name the smallest catalog GPU that batch fits on instead. Exit code 0 "
        "when found, 1 when not even batch 1 fits (or no GPU does).",
        epilog=catalog_epilog(),
    )
    add_workload_flags(parser, modes=("train", "inference"))
    add_compile_flag(parser)
    add_gpu_flags(parser)
    add_parallel_flags(parser)
    add_ddp_flags(parser)
    parser.add_argument(
        "--global-batch",
        type=positive_int,
        metavar="B",
        help="with --smallest-gpu: the batch over all GPUs; tabulate GPU counts 1, 2, 4, ... "
        "(per-rank batch B / N, FSDP2 for N > 1) x catalog GPUs",
    )
    parser.add_argument(
        "--max-gpus",
        type=positive_int,
        default=DEFAULT_MAX_GPUS,
        metavar="N",
        help=f"with --global-batch: the largest GPU count tried (default {DEFAULT_MAX_GPUS})",
    )
    parser.add_argument(
        "--margin",
        type=size_arg,
        metavar="SIZE",
        help="memory to leave unreserved, e.g. 512MiB (default: 2%% of usable, at least 256 MiB)",
    )
    parser.add_argument(
        "--max-batch",
        type=positive_int,
        default=DEFAULT_MAX_BATCH,
        metavar="N",
        help=f"largest batch to try (default {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        metavar="N",
        help="with --smallest-gpu: the batch to check; otherwise the first batch tried",
    )
    parser.add_argument(
        "--smallest-gpu",
        action="store_true",
        help="check --batch on every catalog GPU and name the smallest it fits on",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        metavar="N",
        help="training steps recorded per size (default 2: first optimizer step + steady state); "
        "with --lengths, steps of the run (default: one pass over the file)",
    )
    parser.add_argument(
        "--eval",
        metavar="FILE.PY:FUNCTION",
        help="an evaluation step (same contract as TARGET) that must fit at the same batch",
    )
    add_jobs_flag(
        parser,
        what="batch sizes (the sizes the search traces next, ahead of it; with --lengths a "
        "probe's lengths, with --smallest-gpu the GPUs' compute capabilities, with "
        "--global-batch the GPU counts)",
        verb="trace",
        default="one per CPU core for a preset or --hf model on Linux; 1 for a file.py:function, "
        "which may write files or hold threads, with --compile, and off Linux",
    )
    add_lengths_flags(parser)
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


class _Builders:
    """Batch size -> step for TARGET and --eval, keeping what the user's code raised."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args
        # The last step built (it is traced before the next is built): its target, and the
        # workload whose step appends what it raises to its ``raised`` (a sharded one sets
        # that list while it is recorded, so it is read when an error arrives).
        self.target: str | None = args.target
        self._built: Workload | ShardedWorkload | None = None

    @property
    def raised(self) -> list[BaseException]:
        """What the last step built raised from the user's code."""
        return [] if self._built is None else self._built.raised

    def _keep(self, target: str | None, workload: Any) -> Any:
        self.target, self._built = target, workload
        return workload

    def parallel(self, layout: ParallelLayout, batch_size: int) -> ShardedWorkload:
        """TARGET under ``layout`` at the per-rank ``batch_size`` (as ``predict --fsdp/--tp/--dp``)."""
        from oomkit.interfaces.cli._sharded import parallel_workload

        return self._keep(self._args.target, parallel_workload(self._args, layout, batch_size))

    def train(self, batch_size: int) -> Workload:
        workload = build_workload(self._args, batch_size, "fit")
        _check_takes_batch(self._args.target, workload)
        return self._keep(self._args.target, workload)

    def evaluation(self, batch_size: int) -> Workload:
        from oomkit.interfaces.cli._user_function import load_user_step

        args = self._args
        user = load_user_step(
            args.eval, batch_size=batch_size, seq_len=args.seq, image_size=args.image_size
        )
        spec = user_workload_spec(args.eval, user, 1)
        workload = Workload(user.step_fn, user.track, user.description, user.raised, spec)
        _check_takes_batch(args.eval, workload)
        return self._keep(args.eval, workload)


def _check_takes_batch(target: str | None, workload: Workload | ShardedWorkload) -> None:
    from oomkit.interfaces.cli._user_function import is_user_target

    # A function that declares no batch_size was called without one.
    takes_batch = workload.spec is not None and workload.spec.batch_size is not None
    if target is not None and is_user_target(target) and not takes_batch:
        raise UserCodeError(
            f"{target}: the function has no batch_size parameter, so oomkit fit cannot vary the "
            "batch. Add one: def build(batch_size, seq_len=1024): ..."
        )


def _validate(args: argparse.Namespace) -> Target:
    """Cheap checks before any model is built; returns the target searched for."""
    from oomkit.interfaces.cli._target import installed_torch_version, target_from_args
    from oomkit.interfaces.cli._user_function import is_user_target

    require_target(args, "fit")  # before the search says what it searches
    target = target_from_args(args, default_torch_version=installed_torch_version())
    ddp_bucket_cap_mb(args)  # the DDP flags need --dp
    if args.compile and (target.parallel is not None or args.global_batch is not None):
        raise OomkitError(
            "--compile is not modelled for sharded steps (--fsdp, --tp, --dp, and --global-batch, "
            "whose GPU counts above 1 are FSDP2): the recorder of a fake process group runs "
            "compiled code eagerly. Search one GPU's compiled batch (drop --fsdp/--tp/--dp/"
            "--global-batch), or the sharded batch eagerly (drop --compile)"
        )
    if args.global_batch is not None:
        if not args.smallest_gpu or target.parallel is not None or args.batch is not None:
            raise OomkitError(
                "--global-batch goes with --smallest-gpu alone (it tries GPU counts itself, with "
                "per-rank batch B / N): e.g. `oomkit fit llama3-8b --smallest-gpu --global-batch "
                "64`; drop --fsdp/--tp/--dp and --batch"
            )
        return target
    if target.parallel is not None:
        from oomkit.interfaces.cli._sharded import refuse_layout

        refuse_layout(args, target.parallel, "fit")
        if args.smallest_gpu or args.eval is not None or args.lengths is not None:
            raise OomkitError(
                "--fsdp/--tp/--dp search rank 0's per-rank batch of one --seq: for how many GPUs "
                "of which kind use --smallest-gpu --global-batch B (without --fsdp/--tp/--dp); "
                "--eval is not sharded, and --lengths is not searched sharded yet (give the "
                "longest length as --seq)"
            )
    if args.smallest_gpu and args.batch is None:
        raise OomkitError(
            "--smallest-gpu checks one batch size: give it with --batch N, e.g. "
            "`oomkit fit gpt2-124m --batch 16 --smallest-gpu`."
        )
    if not args.smallest_gpu and args.batch is not None and args.batch > args.max_batch:
        raise OomkitError(
            f"--batch {args.batch} (the first batch tried) is above --max-batch {args.max_batch}; "
            "lower --batch or raise --max-batch."
        )
    if args.eval is not None and not is_user_target(args.eval):
        raise OomkitError(
            f"--eval takes path/to/file.py:function (got {args.eval!r}); the function builds "
            "the evaluation step as TARGET's builds the training step."
        )
    return target


def run(args: argparse.Namespace) -> int:
    from oomkit.interfaces.cli._torch import require_torch

    target = _validate(args)
    require_torch("oomkit fit", extra="torch" if args.hf is None else "hf")
    builders = _Builders(args)
    train: Any = builders.train
    eval_step: Any = None if args.eval is None else builders.evaluation
    if args.compile:  # every probe recorded with its torch.compile regions compiled
        train = _compiled_recorder(train)
        eval_step = None if eval_step is None else _compiled_recorder(eval_step)
    with user_errors(lambda: (builders.target, builders.raised)), user_values(args):
        if args.lengths is not None:
            if args.smallest_gpu or args.eval is not None:
                raise OomkitError("--lengths searches the batch of one run: drop --smallest-gpu/--eval")
            return run_fit_envelope(args, target, jobs=tracing_jobs(args))
        if args.seed is not None or args.pad_to != 1:
            raise OomkitError("--seed and --pad-to go with --lengths FILE (the epoch envelope)")
        if args.steps is None:
            args.steps = 2
        if args.global_batch is not None:
            return _run_gpu_counts(args, target, builders)
        if args.smallest_gpu:
            return _run_smallest(args, target, builders, eval_step)
        if target.parallel is not None:
            recorder = _parallel_recorder(target.parallel, builders)
            return _run_search(args, target, recorder, None)
        return _run_search(args, target, train, eval_step)


def _compiled_recorder(builder: Any) -> RecordingBuilder:
    """``builder`` (batch size -> ``Workload``) as a ``RecordingBuilder`` whose recordings run
    ``torch.compile`` regions compiled (``trace_step(compile=True)``, as ``predict --compile``):
    each probe is built, then recorded with dynamo's caches reset (``compiled_code_recorded``),
    so each batch size gets its own compile, as a run at that batch does."""

    def record(batch_size: int, target: Target, steps: int) -> tuple[Any, str]:
        import torch

        from oomkit.prediction.tracing import trace_step

        meta = torch.device("meta")
        with meta:
            workload = builder(batch_size)
        step_fn = workload.step_fn

        def step(*_tracked: Any) -> Any:
            with meta:  # as record_step runs a built step
                return step_fn()

        recording = trace_step(step, *workload.track, steps=steps, target=target, compile=True)
        return recording, workload.description

    return RecordingBuilder(record)


def _parallel_recorder(layout: ParallelLayout, builders: _Builders) -> RecordingBuilder:
    """(per-rank batch, target, steps) -> rank 0's recording of TARGET under ``layout`` (FSDP2,
    DDP, HSDP, TP and their products) on a fake process group, as ``oomkit predict`` records it
    with the same flags, and its description."""

    def record(batch_size: int, target: Target, steps: int) -> tuple[Any, str]:
        from oomkit.interfaces.cli._sharded import record_rank_0

        workload = builders.parallel(layout, batch_size)
        recording = record_rank_0(workload, layout, steps=steps, target=target)
        # A file.py:function's spec is known once it was called on the mesh.
        _check_takes_batch(builders.target, workload)
        return recording, workload.description

    return RecordingBuilder(record)


def _run_gpu_counts(args: argparse.Namespace, target: Target, builders: _Builders) -> int:
    """``--smallest-gpu --global-batch B``: GPU counts x catalog GPUs, one recording per count."""
    from oomkit.core.gpus import CATALOG
    from oomkit.core.target import ParallelLayout
    from oomkit.interfaces.reports.gpu_count import gpu_count_to_json, render_gpu_count
    from oomkit.plan.batch_probe import record_step
    from oomkit.plan.smallest_gpu import gpu_counts, smallest_gpu_count

    candidates = CATALOG
    if args.context_overhead is not None:
        candidates = tuple(replace(g, context_overhead_bytes=args.context_overhead) for g in CATALOG)
    counts, _ = gpu_counts(args.global_batch, args.max_gpus)
    if not args.json:
        stderr_console().print(
            f"global batch {args.global_batch} of {args.hf or args.target}: recording rank 0 at "
            f"{len(counts)} GPU count(s) ({', '.join(map(str, counts))}), replaying on "
            f"{len(candidates)} GPUs ..."
        )

    def record(count: int, per_rank: int, on: Target) -> tuple[Any, str]:
        if count == 1:  # one GPU trains without FSDP
            return record_step(builders.train, "train step", per_rank, target=on, steps=args.steps)
        return _parallel_recorder(ParallelLayout(fsdp=count), builders).record(
            per_rank, on, args.steps
        )

    with (
        progress_bar(progress_enabled(args, sys.stderr), "recording per GPU count") as bar,
        user_output_to_stderr(),
    ):
        result = smallest_gpu_count(
            record,
            args.global_batch,
            max_gpus=args.max_gpus,
            candidates=candidates,
            margin_bytes=args.margin,
            target=target,
            progress=bar,
            jobs=tracing_jobs(args),
        )
    if args.json:
        print_json(gpu_count_to_json(result))
    else:
        render_gpu_count(result, stdout_console())
    return 0 if result.least_memory is not None else 1


def _run_search(
    args: argparse.Namespace, target: Target, train: Any, eval_step: Any
) -> int:
    from oomkit.interfaces.reports.batch_search import (
        batch_search_to_json,
        infeasible_to_json,
        render_batch_search,
    )
    from oomkit.plan.batch_search import max_batch_size

    gpu = target.gpu
    what = args.hf or args.target or "the step"
    if not args.json:
        stderr_console().print(f"searching the largest batch of {what} that fits on {gpu.name} ...")
    try:
        with (
            progress_bar(progress_enabled(args, sys.stderr), "tracing batch sizes") as progress,
            user_output_to_stderr(),
        ):
            result = max_batch_size(
                train,
                target=target,
                margin_bytes=args.margin,
                steps=args.steps,
                eval_step=eval_step,
                start_batch=args.batch or 1,
                max_batch=args.max_batch,
                progress=progress,
                jobs=tracing_jobs(args),
            )
    except NoFeasibleBatchSizeError as exc:
        if args.json:
            print_json(infeasible_to_json(exc, gpu.name))
        else:
            stderr_console().print(f"[bold red]{exc}[/]", soft_wrap=True)
        return 1
    per_rank = None if target.parallel is None else _per_rank(args, target.parallel, result.batch_size)
    if args.json:
        out = batch_search_to_json(result)
        if args.compile:  # as predict --compile's JSON: what the compiled recording rests on
            out["assumptions"] = dict(result.answer.train.assumptions)
        if per_rank is not None:
            out["parallel"] = per_rank
            out["verdict"] += f"; {_per_rank_words(per_rank, result.batch_size)}"
        print_json(out)
    else:
        render_batch_search(result, stdout_console())
        if per_rank is not None:
            stdout_console().print(f"[bold green]{_per_rank_words(per_rank, result.batch_size)}[/]")
    return 0


def _per_rank(args: argparse.Namespace, layout: ParallelLayout, batch_size: int) -> dict[str, Any]:
    """What a sharded search's batch is: rank 0's per-rank (local) batch under ``layout``.

    The global batch is the per-rank batch times the data-parallel ranks, the DDP (or HSDP)
    replicas times the FSDP2 shards; the TP ranks of a group read one batch (torchtitan
    docs/performance.md: "global batch size = local batch size 2 * number of FSDP ranks").
    """
    from oomkit.interfaces.cli._sharded import layout_words

    data_ranks = layout.dp * layout.fsdp
    return {
        "layout": layout_words(args, layout),
        "fsdp": layout.fsdp,
        "tp": layout.tp,
        "dp": layout.dp,
        "world_size": layout.world_size,
        "rank": 0,
        "batch_is_per_rank": True,
        "data_parallel_ranks": data_ranks,
        "global_batch_size": batch_size * data_ranks,
    }


def _per_rank_words(per_rank: dict[str, Any], batch_size: int) -> str:
    """``batch 8 is per rank (rank 0 of 4: FSDP2 2 x TP 2); global batch 16 over 2
    data-parallel ranks``."""
    ranks = per_rank["data_parallel_ranks"]
    return (
        f"batch {batch_size} is per rank (rank 0 of "
        f"{per_rank['world_size']}: {per_rank['layout']}); global batch "
        f"{per_rank['global_batch_size']} over {ranks} data-parallel rank{'s' if ranks != 1 else ''}"
    )


def _run_smallest(
    args: argparse.Namespace, target: Target, builders: _Builders, eval_step: Any
) -> int:
    from oomkit.core.gpus import CATALOG
    from oomkit.interfaces.reports.batch_search import render_smallest_gpu, smallest_gpu_to_json
    from oomkit.plan.batch_search import smallest_gpu

    candidates = CATALOG
    if args.context_overhead is not None:
        candidates = tuple(replace(g, context_overhead_bytes=args.context_overhead) for g in CATALOG)
    if not args.json:
        stderr_console().print(
            f"checking batch {args.batch} of {args.hf or args.target} on {len(candidates)} GPUs ..."
        )
    # The step is traced once per compute capability (kernels differ by architecture).
    traces = len({g.kernel_compute_capability for g in candidates})
    with (
        progress_bar(progress_enabled(args, sys.stderr), "tracing per compute capability") as bar,
        user_output_to_stderr(),
    ):
        built = 0

        def train(batch_size: int) -> Workload:
            nonlocal built
            built += 1
            if bar is not None:
                bar(built, max(built, traces))
            return builders.train(batch_size)

        result = smallest_gpu(
            _compiled_recorder(train) if args.compile else train,
            args.batch,
            candidates=candidates,
            target=target,
            margin_bytes=args.margin,
            steps=args.steps,
            eval_step=eval_step,
            jobs=tracing_jobs(args),
        )
    if args.json:
        print_json(smallest_gpu_to_json(result))
    else:
        render_smallest_gpu(result, stdout_console())
    return 0 if result.smallest is not None else 1
