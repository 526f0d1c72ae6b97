"""``oomkit predict TARGET``: peak GPU memory of a step, without a GPU.

parse -> ``Scenario`` -> ``oomkit.scenario.predict`` -> render. The flags are the scenario's
fields (``_scenario_flags.py``); ``--config``, ``--set`` and ``--dump-config`` reach every field.

Exit codes: 0 it fits (and is within ``--budget``), 1 it would OOM or exceeds the budget,
2 bad input (a step that allocated nothing on the traced device included: nothing was
predicted), 3 torch (or transformers, for ``--hf``) is not installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._common import (
    add_json_flag,
    print_json,
    stderr_console,
    stdout_console,
    user_output_to_stderr,
)
from oomkit.interfaces.cli._scenario_flags import (
    CompactHelp,
    add_scenario_flags,
    catalog_epilog,
)

__all__ = ["add_parser", "run", "EPILOG"]

# The file.py:function contract in a few lines, and examples (predict --help's end).
EPILOG = """\
TARGET file.py:function(batch_size, seq_len, ...) returns step_fn or (step_fn, (model, optimizer,
  inputs)); TARGET train.py runs as `python train.py ARGS` (ARGS after --). Both may use "cuda".

examples:
  oomkit predict gpt2-124m --batch 8 --seq 1024 --gpu rtx4090
  oomkit predict train.py --gpu rtx4090 -- config/train_shakespeare_char.py
  oomkit predict llama-8b --lora 16 --quantize nf4 --batch 4 --seq 2048 --gpu rtx4090
  oomkit predict --torchtitan llama3:llama3_8b --world-size 8 -- --training.local_batch_size 2
  oomkit predict --config run.toml --set target.gpu=h100 --dump-config
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "predict",
        help="predict a step's peak GPU memory on a named GPU, without a GPU",
        description="Record a training or inference step on the meta device (no GPU, no\n"
        "weights) and replay it through the simulated CUDA caching allocator of a GPU.\n"
        "Exit 0 fits, 1 would OOM or exceed --budget, 2 bad input, 3 torch missing.",
        usage="oomkit predict [TARGET] [options] [-- SCRIPT_ARGS]",
        epilog=EPILOG + "\n" + catalog_epilog(),
    )
    groups = add_scenario_flags(parser, "predict")
    output = groups["output"]
    output.add_argument(
        "--html", type=Path, metavar="OUT", help="with --lengths: also write the envelope page"
    )
    add_json_flag(output)
    parser.formatter_class = CompactHelp
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.interfaces.cli._scenario_flags import scenario_from_args

    scenario = scenario_from_args(args, "predict", script_args=getattr(args, "script_args", ()))
    if args.dump_config:
        from oomkit.scenario.files import scenario_to_toml

        sys.stdout.write(scenario_to_toml(scenario))
        return 0
    if scenario.lengths is None and args.html is not None:
        raise OomkitError("--html goes with --lengths FILE (the epoch envelope page)")
    if scenario.lengths is not None:
        return _run_lengths(args, scenario)
    return _run_step(args, scenario)


def _run_step(args: argparse.Namespace, scenario: Any) -> int:
    from oomkit.scenario.recording_reuse import cache_key, cached_prediction

    # The cache is asked before anything imports torch: a hit replays without it.
    key = cache_key(scenario) if scenario.run.cache else None
    hit = None if key is None else cached_prediction(scenario, key)
    if hit is not None:
        if not args.json:
            stderr_console().print(
                f"replaying the cached recording of {hit.description} (--set run.cache=false "
                "records it again) ...",
                markup=False,
                highlight=False,
            )
        with user_output_to_stderr():
            remedies = _remedies(args, scenario, hit)
        return _output(args, hit, remedies)
    return _record_step(args, scenario, key)


def _record_step(args: argparse.Namespace, scenario: Any, key: str | None) -> int:
    from oomkit.interfaces.cli._progress import progress_enabled, step_progress
    from oomkit.scenario.recording_reuse import record_and_keep
    from oomkit.scenario.run import predicting

    # stdout is oomkit's (--json must stay one object): the user's prints go to stderr.
    with user_output_to_stderr(), predicting(scenario) as run:
        if not args.json:
            layout = run.layout_words()
            from oomkit.scenario.ranks import rank_words

            if layout is not None and run.target.parallel is not None:
                where = (
                    f"{rank_words(scenario)} of {run.target.parallel.world_size} ({layout}) on a "
                    "fake process group"
                )
            elif scenario.model.script_world_size is not None:  # a torchrun script
                model = scenario.model
                ranks = (f"each of its {model.script_world_size} ranks in turn"
                         if model.script_all_ranks else f"rank {model.script_rank or 0}")
                where = f"{run.description} as {ranks}, on a fake process group"
            else:
                where = f"{run.description} on the meta device"
            stderr_console().print(f"recording {where} ...", markup=False, highlight=False)
        enabled = progress_enabled(args, sys.stderr) and run.target.parallel is None
        with step_progress(enabled, run.steps, run.new_tokens) as progress:
            prediction = record_and_keep(run, key, progress)
        remedies = _remedies(args, scenario, prediction)
    return _output(args, prediction, remedies)


def _output(args: argparse.Namespace, prediction: Any, remedies: tuple[Any, ...]) -> int:
    """Print the prediction (``--json``: one object) and return the exit code."""
    from oomkit.interfaces.reports.prediction import prediction_to_json, render_prediction
    from oomkit.prediction.summary import nothing_recorded

    if args.json:
        print_json(prediction_to_json(prediction, remedies=remedies))
    else:
        render_prediction(prediction, stdout_console(), remedies=remedies)
    if nothing_recorded(prediction):
        return 2  # nothing was predicted (a model left on the CPU?): the verdict says so
    return 0 if prediction.fits and prediction.within_budget is not False else 1


def _remedies(args: argparse.Namespace, scenario: Any, prediction: Any) -> tuple[Any, ...]:
    """The top three remedies of a step that does not fit, each measured by re-predicting the
    step with it (``--no-remedies``: none); a preset or ``--hf`` model (another step cannot
    be rebuilt with a change), or a whole script's batch argument, smaller
    (``script_remedies``)."""
    from oomkit.interfaces.cli._progress import progress_bar, progress_enabled

    if prediction.fits or scenario.run.no_remedies or prediction.oom is None:
        return ()
    show = progress_enabled(args, sys.stderr)
    if scenario.model.script is not None:  # its own batch argument, smaller
        from oomkit.scenario.run import predict
        from oomkit.scenario.script_remedies import script_batch_remedy

        with user_output_to_stderr(), progress_bar(
            show, "measuring a smaller batch by predicting the script again (--no-remedies to skip)"
        ) as bar:
            remedy = script_batch_remedy(scenario, prediction, predict, bar)
        return () if remedy is None else (remedy,)
    workload = prediction.workload
    if workload is None or workload.kind not in ("preset", "hf"):
        return ()
    from oomkit.diagnose.remedy_measurement import prediction_remedies
    from oomkit.scenario.run import tracing_jobs

    with progress_bar(show, "measuring remedies by re-predicting (--no-remedies to skip)") as bar:
        # The single changes re-predicted --jobs at a time (oomkit's own builders: forked).
        return prediction_remedies(prediction, progress=bar, jobs=tracing_jobs(scenario))


def _run_lengths(args: argparse.Namespace, scenario: Any) -> int:
    """``--lengths FILE``: record each distinct length once, replay the run, print the
    envelope; 1 if it OOMs."""
    from oomkit.interfaces.reports.envelope import (
        envelope_to_json,
        render_envelope,
        write_envelope_html,
    )
    from oomkit.interfaces.reports.prediction import prediction_to_json
    from oomkit.scenario.lengths import predict_lengths
    from oomkit.scenario.run import require_torch_for, scenario_target, tracing_jobs
    from oomkit.scenario.workloads import user_errors, user_values

    assert scenario.lengths is not None
    if args.html is not None and args.html.resolve() == Path(scenario.lengths.file).resolve():
        raise OomkitError(f"--html {args.html} is the lengths file; choose another path")
    target = scenario_target(scenario)
    require_torch_for(scenario, "predict")
    raised: list[BaseException] = []
    lines = None if args.json else (lambda line: stderr_console().print(line, markup=False))
    with (
        user_output_to_stderr(),
        user_values(scenario.step.values),
        user_errors(lambda: (scenario.model.name, raised)),
    ):
        env = predict_lengths(
            scenario, target, raised, progress=lines, record_jobs=tracing_jobs(scenario)
        )
    if args.html is not None:
        write_envelope_html(args.html, env)
    if args.json:
        out = prediction_to_json(env.prediction)
        out["envelope"] = envelope_to_json(env)
        from oomkit.scenario.files import scenario_to_data

        out["scenario"] = scenario_to_data(scenario)
        print_json(out)
    else:
        render_envelope(env, stdout_console())
    return 1 if env.first_oom_step is not None else 0
