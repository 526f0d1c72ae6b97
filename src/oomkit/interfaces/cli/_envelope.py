"""``predict --lengths FILE``: the epoch envelope of a run of variable-length steps."""

from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._common import positive_int, print_json, stderr_console, stdout_console

if TYPE_CHECKING:
    from oomkit.core.target import Target

__all__ = [
    "COMPILED_LENGTHS",
    "add_envelope_flags",
    "add_lengths_flags",
    "run_envelope",
    "run_fit_envelope",
]

# What --compile with --lengths assumes, said in the envelope's assumptions. A real run's
# torch.compile (dynamic=None, the default) compiles the first length static; at the second
# length a guard on that size fails and, with torch/_dynamo/config.py
# automatic_dynamic_shapes (True by default), dynamo recompiles once with the sequence
# dimension symbolic, a graph every later length runs. oomkit's Inductor emulation plans
# static sizes, so each distinct length is recorded with its own static compile (dynamo's
# caches reset per length: prediction/tracing/compiled.py compiled_code_recorded), as
# torch.compile(dynamic=False) runs each length (up to recompile_limit, 8 distinct lengths).
COMPILED_LENGTHS = (
    "each distinct length recorded with its own static compile (as torch.compile("
    "dynamic=False) runs it); a default run (automatic_dynamic_shapes) runs every length after "
    "the second shape in one dynamic-shape graph instead, which may differ where Inductor's "
    "buffer reuse compares symbolic sizes (codegen/wrapper.py buffer_reuse_key: two buffers of "
    "equal size but different size expressions are not reused) and where the min-cut "
    "partitioner weighs tensors by the size hints of the length it compiled at; with "
    "dynamic=False, lengths beyond the 8th distinct one (recompile_limit) run eagerly"
)


def add_envelope_flags(parser: argparse.ArgumentParser) -> None:
    """--lengths, --pad-to, --seed, --html (the envelope page) and --jobs (its remedies)."""
    from oomkit.interfaces.cli._progress import add_jobs_flag

    add_lengths_flags(parser)
    parser.add_argument(
        "--html", type=Path, metavar="OUT", help="with --lengths: also write the envelope page"
    )
    add_jobs_flag(
        parser,
        what="remedies of --lengths (each a replay of the whole run), and record its lengths as "
        "many at once",
        default="one per CPU core; the lengths one at a time for a file.py:function, with "
        "--compile, and off Linux",
    )


def add_lengths_flags(parser: argparse.ArgumentParser) -> None:
    """--lengths, --pad-to and --seed (``predict`` and ``fit``)."""
    parser.add_argument(
        "--lengths",
        type=Path,
        metavar="FILE",
        help="per-step sequence lengths (one a line, 'length,count' rows, or a JSON list): "
        "replay the whole run, so the cache carries across steps as on a GPU (the epoch envelope)",
    )
    parser.add_argument(
        "--pad-to", type=positive_int, default=1, metavar="N",
        help="with --lengths: pad each length up to a multiple of N (default 1: no padding)",
    )
    parser.add_argument(
        "--seed", type=int, metavar="N",
        help="with --lengths: shuffle the steps with this seed (default: the file's order)",
    )


def run_envelope(args: argparse.Namespace, target: object) -> int:
    """Record each distinct length once, replay the run, print the envelope; 1 if it OOMs."""
    from oomkit.core.target import Target
    from oomkit.interfaces.cli._progress import tracing_jobs
    from oomkit.interfaces.cli._workload import user_errors
    from oomkit.interfaces.reports.envelope import (
        envelope_to_json,
        render_envelope,
        write_envelope_html,
    )
    from oomkit.interfaces.reports.prediction import prediction_to_json
    from oomkit.prediction.envelope import predict_envelope
    from oomkit.prediction.lengths import read_lengths

    assert isinstance(target, Target)
    _refuse_shape_flags(args)
    if args.html is not None and args.html.resolve() == args.lengths.resolve():
        raise OomkitError(f"--html {args.html} is the lengths file; choose another path")
    lengths = read_lengths(args.lengths)
    description = ""
    raised: list[BaseException] = []

    record_at = _recorder(args, target, "predict", raised)

    def record(length: int):  # noqa: ANN202 - a TraceRecording
        nonlocal description
        recording, description = record_at(args.batch, length)
        return recording

    with user_errors(lambda: (args.target, raised)):
        env = predict_envelope(
            record,
            lengths,
            target,
            description=lambda: description,
            jobs=args.jobs,
            record_jobs=tracing_jobs(args),
            **_run_options(args),
        )
    if args.html is not None:
        write_envelope_html(args.html, env)
    if args.json:
        out = prediction_to_json(env.prediction)
        out["envelope"] = envelope_to_json(env)
        print_json(out)
    else:
        render_envelope(env, stdout_console())
    return 1 if env.first_oom_step is not None else 0


def _recorder(args: argparse.Namespace, target: Target, command: str, raised: list) -> Any:
    """``(batch, length) -> (two-step recording, description)`` of TARGET; what the user's code
    raised is kept in ``raised`` for the error message."""
    from oomkit.interfaces.cli._workload import build_workload, user_output_to_stderr
    from oomkit.plan.batch_probe import new_model_cache
    from oomkit.prediction.tracing import trace_step

    # One model for every length and batch recorded (model_cache.py: its key leaves both out).
    models = new_model_cache()

    def record(batch: int | None, length: int) -> tuple[Any, str]:
        shaped = copy.copy(args)
        shaped.seq = length
        with user_output_to_stderr(), models.active():
            workload = build_workload(shaped, batch, command)
        raised[:] = workload.raised
        step_fn = workload.step_fn

        def step(*_tracked: object) -> object:
            return step_fn()  # the tracked objects are passed only to be recorded (as predict)

        compiled = bool(getattr(args, "compile", False))
        with user_output_to_stderr():
            recording = trace_step(
                step, *workload.track, steps=2, target=target, compile=compiled
            )
        if compiled:
            assumptions = {**recording.assumptions, "torch.compile lengths": COMPILED_LENGTHS}
            recording = dataclasses.replace(recording, assumptions=assumptions)
        return recording, workload.description.replace(f"seq {length}", "variable seq")

    return record


def _run_options(args: argparse.Namespace) -> dict[str, Any]:
    """What both runs over --lengths (``predict_envelope``, ``max_batch_for_run``) take from the
    flags: the steps, their padding and order, the longest length allowed, and the progress lines
    (to stderr, none with --json)."""
    return {
        "steps": args.steps,
        "pad_to": args.pad_to,
        "seed": args.seed,
        "max_length": _max_length(args),
        "progress": (lambda line: stderr_console().print(line)) if not args.json else None,
    }


def _max_length(args: argparse.Namespace) -> int | None:
    """A preset's positions (the longest sequence it takes), to refuse a longer length before
    anything is recorded; None for --hf and file.py:function targets (their builders check)."""
    from oomkit.interfaces.cli._user_function import is_user_target

    if args.hf is not None or args.target is None or is_user_target(args.target):
        return None
    from oomkit.prediction.models import get_preset

    try:
        shape = get_preset(args.target).shape
    except ValueError:
        return None  # an unknown preset: build_workload says so
    positions = getattr(shape, "positions", None)
    return positions if isinstance(positions, int) else None


def _refuse_shape_flags(args: argparse.Namespace) -> None:
    if args.hf is None and args.target in ("resnet50", "vit-b16"):
        raise OomkitError(f"--lengths varies the sequence length; {args.target} takes images")
    if args.seq is not None:
        raise OomkitError("give --lengths or --seq, not both: --lengths sets every step's length")


def run_fit_envelope(args: argparse.Namespace, target: object, jobs: int | None = 1) -> int:
    """``fit --lengths``: the largest batch whose whole run fits; 1 if not even batch 1 does.
    ``jobs``: processes that trace a probe's lengths at once (``fit --jobs``)."""
    from oomkit.core.target import Target
    from oomkit.errors import NoFeasibleBatchSizeError
    from oomkit.interfaces.cli._workload import user_errors
    from oomkit.interfaces.reports.envelope import envelope_to_json, envelope_verdict
    from oomkit.plan.envelope_fit import max_batch_for_run
    from oomkit.prediction.lengths import read_lengths
    from oomkit.units import format_bytes

    assert isinstance(target, Target)
    _refuse_shape_flags(args)
    lengths = read_lengths(args.lengths)
    raised: list[BaseException] = []

    record_at = _recorder(args, target, "fit", raised)

    def record(batch: int, length: int):  # noqa: ANN202 - a TraceRecording
        return record_at(batch, length)[0]

    try:
        with user_errors(lambda: (args.target, raised)):
            found = max_batch_for_run(
                record,
                lengths,
                target,
                margin_bytes=args.margin,
                start_batch=args.batch or 1,
                max_batch=args.max_batch,
                jobs=jobs,
                **_run_options(args),
            )
    except NoFeasibleBatchSizeError as exc:
        if args.json:
            from oomkit.interfaces.reports.batch_search import infeasible_to_json

            print_json(infeasible_to_json(exc, target.gpu.name))
        else:
            stderr_console().print(f"[bold red]{exc}[/]", soft_wrap=True)
        return 1
    assumptions = found.envelope.prediction.assumptions
    if args.json:
        print_json(
            {
                "batch_size": found.batch_size,
                "gpu": target.gpu.name,
                "margin_bytes": found.margin_bytes,
                "probes": [
                    {
                        "batch_size": p.batch_size,
                        "fits": p.fits,
                        "worst_peak_reserved_bytes": p.worst_peak_reserved_bytes,
                        "first_oom_step": p.first_oom_step,
                        "synthesized": p.synthesized,
                    }
                    for p in found.probes
                ],
                # recordings (one batch at one length): traced, and synthesized instead
                "traces": found.traces,
                "synthesized": found.synthesized,
                "envelope": envelope_to_json(found.envelope),
                # as predict --compile's JSON: what the compiled recordings rest on
                **({"assumptions": dict(assumptions)} if args.compile else {}),
            }
        )
        return 0
    console = stdout_console()
    if args.compile:
        for name in ("torch.compile", "torch.compile lengths"):
            if name in assumptions:
                console.print(f"{name}: {assumptions[name]}", markup=False)
    for p in found.probes:
        state = "fits" if p.fits else (
            f"OOM at step {p.first_oom_step}" if p.first_oom_step else "over the margin"
        )
        console.print(
            f"batch {p.batch_size}: worst step {format_bytes(p.worst_peak_reserved_bytes)} "
            f"reserved, {state}"
        )
    interpolated = f", {found.synthesized} interpolated" if found.synthesized else ""
    console.print(
        f"largest batch whose whole run of {found.envelope.steps} steps fits on "
        f"{target.gpu.name}: {found.batch_size} ({envelope_verdict(found.envelope)}; "
        f"{found.traces} recordings traced{interpolated})",
        markup=False,
    )
    return 0
