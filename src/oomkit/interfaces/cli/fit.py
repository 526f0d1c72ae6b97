"""``oomkit fit TARGET --gpu NAME``: the largest batch that fits, without a GPU.

parse -> ``Scenario`` -> ``oomkit.scenario.fit`` -> render. ``--batch N --smallest-gpu``
answers the reverse question (the smallest catalog GPU that batch fits on), ``--global-batch``
tabulates GPU counts, ``--fsdp/--tp/--dp`` search rank 0's per-rank batch, ``--lengths`` the
batch whose whole run fits (``oomkit.scenario.fitting``).

Exit codes: 0 a batch was found (or, with ``--smallest-gpu``, a GPU), 1 not even batch 1 fits
(no GPU of the catalog fits), 2 bad input, 3 torch is not installed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from oomkit.errors import NoFeasibleBatchSizeError
from oomkit.interfaces.cli._common import (
    add_json_flag,
    print_json,
    stderr_console,
    stdout_console,
    user_output_to_stderr,
)
from oomkit.interfaces.cli._progress import progress_bar, progress_enabled
from oomkit.interfaces.cli._scenario_flags import (
    CompactHelp,
    add_scenario_flags,
    catalog_epilog,
)

__all__ = ["add_parser", "run", "progress_enabled"]

EPILOG = """\
TARGET is a preset, --hf NAME_OR_PATH, file.py:function taking batch_size, or train.py
  run at each batch through its batch argument (after --, or --batch-arg NAME).

examples:
  oomkit fit gpt2-124m --seq 1024 --gpu rtx4090
  oomkit fit llama-8b --lora 16 --quantize nf4 --seq 2048 --gpu rtx4090 --json
  oomkit fit llama3-8b --fsdp 8 --seq 8192 --gpu h100
  oomkit fit gpt2-124m --batch 16 --smallest-gpu
  oomkit fit train.py:build --lengths lengths.txt --gpu a100-80gb
  oomkit fit train.py --gpu rtx4090 -- config/train_gpt2.py --batch_size=8
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "fit",
        help="find the largest batch that fits on a GPU, without a GPU",
        description="Search the largest batch whose step fits on --gpu with --margin to spare\n"
        "(double, then bisect; one trace per size; no GPU, no OOMs). Exit 0 found, 1 not even\n"
        "batch 1 fits (or no GPU does), 2 bad input, 3 torch missing.",
        usage="oomkit fit [TARGET] [options]",
        epilog=EPILOG + "\n" + catalog_epilog(),
    )
    groups = add_scenario_flags(parser, "fit")
    add_json_flag(groups["output"])
    parser.formatter_class = CompactHelp
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.interfaces.cli._scenario_flags import scenario_from_args
    from oomkit.scenario.fitting import check_fit, fit

    scenario = scenario_from_args(args, "fit", script_args=getattr(args, "script_args", ()))
    if args.dump_config:
        from oomkit.scenario.files import scenario_to_toml

        sys.stdout.write(scenario_to_toml(scenario))
        return 0
    check_fit(scenario)  # cheap checks and torch, before the search says what it searches
    if not args.json:
        stderr_console().print(_announcement(scenario), markup=False, highlight=False)
    lines = None if args.json else (lambda line: stderr_console().print(line, markup=False))
    what = "tracing batch sizes"
    if scenario.search.global_batch is not None:
        what = "recording per GPU count"
    elif scenario.search.smallest_gpu:
        what = "tracing per compute capability"
    enabled = progress_enabled(args, sys.stderr) and scenario.lengths is None
    try:
        with (
            progress_bar(enabled, what) as progress,
            user_output_to_stderr(),
        ):
            answer = fit(scenario, progress=progress, lines=lines)
    except NoFeasibleBatchSizeError as exc:
        return _infeasible(args, scenario, exc)
    return _render(args, answer)


def _infeasible(args: argparse.Namespace, scenario: Any, exc: NoFeasibleBatchSizeError) -> int:
    """Not even batch 1 fits: why, then the largest batch with each change that applies,
    searched again (``oomkit.scenario.alternatives``); exit 1."""
    from oomkit.interfaces.reports.batch_search import infeasible_to_json, render_alternatives
    from oomkit.scenario.alternatives import fit_alternatives, searches_alternatives
    from oomkit.scenario.run import scenario_target

    target = scenario_target(scenario)
    # The default margin above a small GPU fails before a trace: no change can make room.
    nothing_left = (
        exc.margin_bytes is not None and exc.usable_bytes is not None
        and exc.margin_bytes >= exc.usable_bytes
    )
    searched = searches_alternatives(scenario) and not nothing_left
    if not args.json:
        shown = exc.reason if searched else str(exc)
        stderr_console().print(f"[bold red]{_escaped(shown)}[/]", soft_wrap=True)
    alternatives: tuple[Any, ...] = ()
    if searched:
        if not args.json:
            stderr_console().print(
                "searching again with each change that applies (precision, checkpointing, "
                "optimizer, LoRA, QLoRA) ...", markup=False, highlight=False, soft_wrap=True,
            )
        with (
            progress_bar(progress_enabled(args, sys.stderr), "searching with each change")
            as progress,
            user_output_to_stderr(),
        ):
            alternatives = fit_alternatives(scenario, progress=progress)
    if args.json:
        print_json(infeasible_to_json(exc, target.gpu.name, alternatives))
    elif alternatives:
        render_alternatives(
            exc, alternatives, stdout_console(), sharded=target.parallel is not None
        )
    elif searched:  # nothing applied: the advice the message would have given
        stderr_console().print(f"[bold red]{_escaped(exc)}[/]", soft_wrap=True)
    return 1


def _escaped(exc: BaseException | str) -> str:
    from rich.markup import escape

    return escape(str(exc))


def _announcement(scenario: Any) -> str:
    """What the search does, on stderr before it starts."""
    from oomkit.core.gpus import CATALOG
    from oomkit.scenario.run import scenario_target

    what = scenario.model.name or "the step"
    search = scenario.search
    batch = "batch"
    if scenario.model.script is not None:  # the script's own argument (script_batch.py)
        from oomkit.scenario.script_batch import batch_arg_of

        batch = batch_arg_of(what, scenario.model.script_args, scenario.model.script_batch_arg)
    if search.global_batch is not None:
        return (
            f"global batch {search.global_batch} of {what}: recording rank 0 at each GPU count "
            f"up to {search.max_gpus}, replaying on {len(CATALOG)} GPUs ..."
        )
    if search.smallest_gpu:
        return f"checking {batch} {scenario.step.batch} of {what} on {len(CATALOG)} GPUs ..."
    gpu = scenario_target(scenario).gpu.name
    if scenario.lengths is not None:
        return f"searching the largest batch of {what} whose whole run fits on {gpu} ..."
    return f"searching the largest {batch} of {what} that fits on {gpu} ..."


def _render(args: argparse.Namespace, answer: Any) -> int:
    console = stdout_console()
    if answer.kind == "lengths":
        return _render_lengths(args, answer)
    if answer.kind == "gpu_count":
        from oomkit.interfaces.reports.gpu_count import gpu_count_to_json, render_gpu_count

        if args.json:
            print_json(gpu_count_to_json(answer.result))
        else:
            render_gpu_count(answer.result, console)
        return 0 if answer.result.least_memory is not None else 1
    if answer.kind == "smallest_gpu":
        from oomkit.interfaces.reports.batch_search import (
            render_smallest_gpu,
            smallest_gpu_to_json,
        )

        if args.json:
            found = smallest_gpu_to_json(answer.result)
            if answer.batch_arg is not None:  # the script's own argument, at --batch
                found["batch_arg"] = answer.batch_arg
            print_json(found)
        else:
            render_smallest_gpu(answer.result, console)
        return 0 if answer.result.smallest is not None else 1
    from oomkit.interfaces.reports.batch_search import batch_search_to_json, render_batch_search
    from oomkit.scenario.files import scenario_to_data

    result, per_rank = answer.result, answer.per_rank
    if args.json:
        out = batch_search_to_json(result)
        if answer.scenario.step.compile:  # what the compiled recording rests on
            out["assumptions"] = dict(result.answer.train.assumptions)
        if per_rank is not None:
            out["parallel"] = per_rank
            out["verdict"] += f"; {_per_rank_words(per_rank, result.batch_size)}"
        if answer.batch_arg is not None:  # the script's own argument varied
            out["batch_arg"] = answer.batch_arg
        out["scenario"] = scenario_to_data(answer.scenario)
        print_json(out)
    else:
        render_batch_search(result, console)
        if per_rank is not None:
            console.print(_per_rank_words(per_rank, result.batch_size), style="bold green")
    return 0


def _per_rank_words(per_rank: dict[str, Any], batch_size: int) -> str:
    """``batch 8 is per rank (rank 0 of 4: FSDP2 2 x TP 2); global batch 16 over 2
    data-parallel ranks``."""
    ranks = per_rank["data_parallel_ranks"]
    return (
        f"batch {batch_size} is per rank (rank 0 of "
        f"{per_rank['world_size']}: {per_rank['layout']}); global batch "
        f"{per_rank['global_batch_size']} over {ranks} data-parallel rank{'s' if ranks != 1 else ''}"
    )


def _render_lengths(args: argparse.Namespace, answer: Any) -> int:
    """``fit --lengths``: the largest batch whose whole run fits."""
    from oomkit.interfaces.reports.envelope import envelope_to_json, envelope_verdict
    from oomkit.units import format_bytes

    found, target = answer.result, answer.target
    assumptions = found.envelope.prediction.assumptions
    compiled = answer.scenario.step.compile
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
                **({"assumptions": dict(assumptions)} if compiled else {}),
            }
        )
        return 0
    console = stdout_console()
    if compiled:
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
