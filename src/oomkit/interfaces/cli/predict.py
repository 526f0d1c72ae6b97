"""``oomkit predict PRESET|file.py:function``: peak GPU memory of a step, without a GPU.

Exit codes: 0 it fits (and is within ``--budget``), 1 it would OOM or exceeds the budget,
2 bad input, 3 torch (or transformers, for ``--hf``) is not installed.
"""

from __future__ import annotations

import argparse

from oomkit.interfaces.cli._common import add_json_flag, print_json, size_arg, stderr_console, stdout_console
from oomkit.interfaces.cli._workload import (
    MODES,
    OPTIMIZERS,
    PRECISIONS,
    add_gpu_flags,
    add_workload_flags,
    build_workload,
    kernel_settings,
    positive_int,
    step_options,
    user_errors,
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


def _workload_spec(args: argparse.Namespace) -> dict | None:
    """A built-in preset and its StepOptions, saved so `oomkit explain` can re-predict them."""
    import dataclasses

    from oomkit.interfaces.cli._user_function import is_user_target

    if args.hf is not None or args.target is None or is_user_target(args.target):
        return None
    options = dataclasses.asdict(step_options(args, args.batch))
    spec = {"preset": args.target, "options": options, "steps": args.steps}
    # Saved so re-predictions (`oomkit explain`) pick the same SDPA backend on any machine.
    version = args.cudnn_version
    if version is None:
        from oomkit.prediction.tracing.emulations import installed_cudnn_build

        version = installed_cudnn_build().version
    if version is not None:
        spec["cudnn_version"] = version
    return spec


def run(args: argparse.Namespace) -> int:
    from oomkit.core.allocator import AllocatorConfig
    from oomkit.prediction.predictor import predict
    from oomkit.core.gpus import get_gpu
    from oomkit.interfaces.reports.prediction import prediction_to_json, render_prediction

    # Cheap checks first, so a typo fails before any model is built.
    gpu = get_gpu(args.gpu, context_overhead_bytes=args.context_overhead)
    if args.alloc_conf is not None:
        AllocatorConfig.parse(args.alloc_conf, torch_version=args.torch_version)
    workload = build_workload(args, args.batch, "predict")
    if not args.json:
        stderr_console().print(f"recording {workload.description} on the meta device ...")
    with user_errors(lambda: (args.target, workload.raised)), kernel_settings(args):
        prediction = predict(
            workload.step_fn,
            gpu=gpu,
            alloc_conf=args.alloc_conf,
            torch_version=args.torch_version,
            steps=args.steps,
            budget_bytes=args.budget,
            track=workload.track,
            description=workload.description,
        )
    if args.json:
        print_json(prediction_to_json(prediction, _workload_spec(args)))
    else:
        render_prediction(prediction, stdout_console())
    ok = prediction.fits and prediction.within_budget is not False
    return 0 if ok else 1
