"""``oomkit predict PRESET|file.py:function``: peak GPU memory of a step, without a GPU.

Exit codes: 0 it fits (and is within ``--budget``), 1 it would OOM or exceeds the budget,
2 bad input (a step that allocated nothing on the traced device included: nothing was
predicted), 3 torch (or transformers, for ``--hf``) is not installed.
"""

from __future__ import annotations

import argparse

from oomkit.interfaces.cli._common import (
    add_json_flag,
    print_json,
    size_arg,
    stderr_console,
    stdout_console,
)
from oomkit.interfaces.cli._workload import (
    MODES,
    OPTIMIZERS,
    PRECISIONS,
    add_gpu_flags,
    add_workload_flags,
    build_workload,
    positive_int,
    user_errors,
    user_output_to_stderr,
)

__all__ = ["add_parser", "run", "PRECISIONS", "OPTIMIZERS", "MODES"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "predict",
        help="predict a step's peak GPU memory on a named GPU, without a GPU",
        description="Record one training or inference step on the meta device (no GPU, no "
        "weights) and replay it through the simulated CUDA caching allocator of a GPU. TARGET "
        "is a built-in preset (gpt2-124m, llama-8b, bert-base, vit-b16, resnet50, ...) or "
        "path/to/file.py:function (see the README for that function's contract). Exit code 0 "
        "when it fits, 1 when it would OOM or exceed --budget.",
    )
    add_workload_flags(parser)
    parser.add_argument("--batch", type=positive_int, metavar="N", help="batch size")
    parser.add_argument(
        "--new-tokens", type=positive_int, metavar="N", help="tokens generated (--mode generate)"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=3, metavar="N", help="steps to record (default 3)"
    )
    add_gpu_flags(parser)
    parser.add_argument(
        "--budget", type=size_arg, metavar="SIZE", help="exit 1 when peak reserved exceeds SIZE"
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.interfaces.cli._target import target_from_args
    from oomkit.interfaces.reports.prediction import prediction_to_json, render_prediction
    from oomkit.prediction.predictor import predict
    from oomkit.prediction.summary import nothing_recorded

    # Cheap checks first, so a typo fails before any model is built.
    target = target_from_args(args)
    with user_output_to_stderr():
        workload = build_workload(args, args.batch, "predict")
    if not args.json:
        stderr_console().print(f"recording {workload.description} on the meta device ...")
    with user_errors(lambda: (args.target, workload.raised)), user_output_to_stderr():
        prediction = predict(
            workload.step_fn,
            target=target,
            steps=args.steps,
            budget_bytes=args.budget,
            track=workload.track,
            description=workload.description,
            workload=workload.spec,
        )
    if args.json:
        print_json(prediction_to_json(prediction))
    else:
        render_prediction(prediction, stdout_console())
    if nothing_recorded(prediction):
        return 2  # nothing was predicted (a model left on the CPU?): the verdict says so
    ok = prediction.fits and prediction.within_budget is not False
    return 0 if ok else 1
