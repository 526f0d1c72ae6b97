"""``oomkit predict PRESET|file.py:function``: peak GPU memory of a step, without a GPU.

Exit codes: 0 it fits (and is within ``--budget``), 1 it would OOM or exceeds the budget,
2 bad input, 3 torch (or transformers, for ``--hf``) is not installed.
"""

from __future__ import annotations

import argparse
from typing import Any

from oomkit.cli._common import add_json_flag, print_json, size_arg, stderr_console, stdout_console
from oomkit.errors import OomkitError

__all__ = ["add_parser", "run", "PRECISIONS", "OPTIMIZERS", "MODES"]

# The StepOptions vocabulary of oomkit.models (docs/CONTRACTS.md, "Issue 3").
PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16")
OPTIMIZERS = ("adamw", "adam", "sgd")
MODES = ("train", "inference", "generate")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


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
    parser.add_argument("target", nargs="?", metavar="TARGET", help="PRESET or file.py:function")
    parser.add_argument("--batch", type=_positive_int, metavar="N", help="batch size")
    parser.add_argument("--seq", type=_positive_int, metavar="N", help="sequence length")
    parser.add_argument("--image-size", type=_positive_int, metavar="N", help="image size")
    parser.add_argument(
        "--gpu", default="h100", metavar="NAME|SIZE", help="GPU name or memory size (default h100)"
    )
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing (presets)"
    )
    parser.add_argument("--mode", choices=MODES, default="train")
    parser.add_argument(
        "--new-tokens", type=_positive_int, metavar="N", help="tokens generated (--mode generate)"
    )
    parser.add_argument(
        "--steps", type=_positive_int, default=3, metavar="N", help="steps to record (default 3)"
    )
    parser.add_argument(
        "--alloc-conf",
        metavar="STR",
        help="PYTORCH_CUDA_ALLOC_CONF value to simulate, e.g. expandable_segments:True",
    )
    parser.add_argument(
        "--context-overhead",
        type=size_arg,
        metavar="SIZE",
        help="memory outside PyTorch (CUDA context), e.g. 500MiB (default: the GPU's figure)",
    )
    parser.add_argument(
        "--budget", type=size_arg, metavar="SIZE", help="exit 1 when peak reserved exceeds SIZE"
    )
    parser.add_argument(
        "--hf", metavar="NAME_OR_PATH", help="a Hugging Face model (config only, no weights)"
    )
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def _step_options(args: argparse.Namespace) -> Any:
    from oomkit.models import StepOptions

    fields: dict[str, Any] = {
        "precision": args.precision,
        "optimizer": args.optimizer,
        "checkpointing": args.checkpointing,
        "mode": args.mode,
    }
    for name, value in (
        ("batch_size", args.batch),
        ("seq_len", args.seq),
        ("image_size", args.image_size),
        ("new_tokens", args.new_tokens),
    ):
        if value is not None:
            fields[name] = value
    return StepOptions(**fields)


def _build(args: argparse.Namespace) -> tuple[Any, tuple[Any, ...], str, list[BaseException]]:
    """The step to record: (step_fn, objects to track, description, what user code raised)."""
    from oomkit.cli._user_function import is_user_target, load_user_step

    if args.hf is not None:
        if args.target is not None:
            raise OomkitError(
                f"give either a TARGET or --hf, not both (got {args.target!r} and --hf {args.hf})."
            )
        try:
            from oomkit.models import build_hf_step
        except ImportError as exc:
            if "torch" in str(exc) or "transformers" in str(exc):
                raise
            raise OomkitError(
                "--hf is not available in this build of oomkit (oomkit.models has no "
                "build_hf_step); use a preset or path/to/file.py:function."
            ) from exc

        built = _call_builder(build_hf_step, args.hf, _step_options(args))
        return built.step_fn, tuple(built.track), built.description, []
    if args.target is None:
        raise OomkitError(
            "name what to predict: a preset (e.g. `oomkit predict gpt2-124m --gpu rtx4090`), "
            "path/to/file.py:function, or --hf NAME_OR_PATH."
        )
    if is_user_target(args.target):
        user = load_user_step(
            args.target, batch_size=args.batch, seq_len=args.seq, image_size=args.image_size
        )
        return user.step_fn, user.track, user.description, user.raised
    from oomkit.models import build_preset_step

    built = _call_builder(build_preset_step, args.target, _step_options(args))
    return built.step_fn, tuple(built.track), built.description, []


def _call_builder(builder: Any, name: str, options: Any) -> Any:
    try:
        return builder(name, options)
    except OomkitError:
        raise
    except ValueError as exc:
        # UnknownPresetError and option checks are ValueErrors with a message that says what to do.
        raise OomkitError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    from oomkit.allocator import AllocatorConfig
    from oomkit.analysis.prediction import predict
    from oomkit.errors import UserCodeError
    from oomkit.gpus import get_gpu
    from oomkit.reports.prediction import prediction_to_json, render_prediction

    # Cheap checks first, so a typo fails before any model is built.
    gpu = get_gpu(args.gpu, context_overhead_bytes=args.context_overhead)
    if args.alloc_conf is not None:
        AllocatorConfig.parse(args.alloc_conf)
    step_fn, track, description, user_raised = _build(args)
    if not args.json:
        stderr_console().print(f"recording {description} on the meta device ...")
    try:
        prediction = predict(
            step_fn,
            gpu=gpu,
            alloc_conf=args.alloc_conf,
            steps=args.steps,
            budget_bytes=args.budget,
            track=track,
            description=description,
        )
    except OomkitError:
        raise
    except Exception as exc:
        if not any(exc is e for e in user_raised):
            raise
        raise UserCodeError(
            f"{args.target}: the step raised {type(exc).__name__}: {exc}. It runs on the meta "
            "device: code that reads tensor values (.item(), data-dependent shapes) cannot run "
            "there."
        ) from exc
    if args.json:
        print_json(prediction_to_json(prediction))
    else:
        render_prediction(prediction, stdout_console())
    ok = prediction.fits and prediction.within_budget is not False
    return 0 if ok else 1
