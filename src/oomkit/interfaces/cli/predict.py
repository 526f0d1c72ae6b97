"""``oomkit predict PRESET|file.py:function``: peak GPU memory of a step, without a GPU.

Exit codes: 0 it fits (and is within ``--budget``), 1 it would OOM or exceeds the budget,
2 bad input (a step that allocated nothing on the traced device included: nothing was
predicted), 3 torch (or transformers, for ``--hf``) is not installed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from oomkit.errors import OomkitError
from oomkit.interfaces.cli._common import (
    add_json_flag,
    print_json,
    size_arg,
    stderr_console,
    stdout_console,
)
from oomkit.interfaces.cli._compile_flag import add_compile_flag
from oomkit.interfaces.cli._data_parallel import add_ddp_flags, ddp_bucket_cap_mb
from oomkit.interfaces.cli._envelope import add_envelope_flags, run_envelope
from oomkit.interfaces.cli._progress import progress_enabled, step_progress
from oomkit.interfaces.cli._target import add_parallel_flags
from oomkit.interfaces.cli._workload import (
    MODES,
    OPTIMIZERS,
    PRECISIONS,
    add_gpu_flags,
    add_workload_flags,
    build_workload,
    catalog_epilog,
    positive_int,
    user_errors,
    user_output_to_stderr,
    user_values,
)

__all__ = ["add_parser", "run", "PRECISIONS", "OPTIMIZERS", "MODES"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "predict",
        help="predict a step's peak GPU memory on a named GPU, without a GPU",
        description="Record one training or inference step on the meta device (no GPU, no "
        "weights) and replay it through the simulated CUDA caching allocator of a GPU. TARGET "
        "is a built-in preset (gpt2-124m, llama-8b, bert-base, vit-b16, resnet50, ...) or "
        "path/to/file.py:function (see the README for that function's contract). Without "
        "flags a preset runs one training step (AdamW) at its defaults: batch 8 (4 for Llama), "
        "bf16-mixed for GPT-2 and Llama (fp32 for the others), on an H100. Exit code 0 "
        "when it fits, 1 when it would OOM or exceed --budget, 2 bad input, 3 torch missing.",
        epilog=catalog_epilog(),
    )
    add_workload_flags(parser)
    add_compile_flag(parser)
    parser.add_argument(
        "--batch",
        type=positive_int,
        metavar="N",
        help="batch size (default: 8 for a preset or --hf, 4 for the Llama presets)",
    )
    parser.add_argument(
        "--new-tokens",
        type=positive_int,
        metavar="N",
        help="tokens generated (--mode generate; default 128)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        metavar="N",
        help="steps to record (default 3); with --lengths, steps to run (default: one pass)",
    )
    add_gpu_flags(parser)
    add_parallel_flags(parser)
    add_ddp_flags(parser)
    parser.add_argument(
        "--budget", type=size_arg, metavar="SIZE", help="exit 1 when peak reserved exceeds SIZE"
    )
    add_envelope_flags(parser)
    add_json_flag(parser)
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from oomkit.interfaces.cli._target import installed_torch_version, target_from_args
    from oomkit.interfaces.cli._torch import require_torch
    from oomkit.interfaces.reports.prediction import prediction_to_json, render_prediction

    # Cheap checks first, so a typo fails before any model is built.
    target = target_from_args(args, default_torch_version=installed_torch_version())
    if args.hf is not None:
        require_torch("oomkit predict --hf", extra="hf")
    else:
        require_torch("oomkit predict")
    if args.lengths is None and (
        args.html is not None or args.seed is not None or args.pad_to != 1 or args.jobs is not None
    ):
        raise OomkitError(
            "--html, --seed, --pad-to and --jobs go with --lengths FILE (the epoch envelope)"
        )
    if args.compile and target.parallel is not None:
        raise OomkitError(
            "--compile is not modelled for sharded steps (--fsdp, --tp, --dp): the recorder of "
            "a fake process group runs compiled code eagerly. Predict one GPU's compiled step "
            "(drop --fsdp/--tp/--dp), or the sharded step eagerly (drop --compile)"
        )
    if args.compile and args.mode == "generate":
        from oomkit.prediction.models.options import GENERATE_COMPILE_REASON

        raise OomkitError(
            f"--compile with --mode generate is not modelled: {GENERATE_COMPILE_REASON}. Drop "
            "--compile to predict the generate step eagerly, or predict the compiled forward "
            "at the longest length: --mode inference --compile --seq PROMPT+NEW_TOKENS"
        )
    if args.lengths is not None and target.parallel is not None:
        raise OomkitError(
            "--fsdp and --dp do not go with --lengths yet: predict one length at a time"
        )
    # Values are followed from the import and the builder on (a mask made there with
    # torch.ones is known when the step reads it), and --value states the others.
    with user_values(args):
        if args.lengths is not None:
            return run_envelope(args, target)
        if args.steps is None:
            args.steps = 3
        ddp_bucket_cap_mb(args)  # the DDP flags need --dp
        if target.parallel is not None:
            prediction = _predict_sharded(args, target)
            if args.json:
                print_json(prediction_to_json(prediction))
            else:
                render_prediction(prediction, stdout_console())
            return 0 if prediction.fits and prediction.within_budget is not False else 1
        from oomkit.prediction.predictor import predict
        from oomkit.prediction.summary import nothing_recorded

        with user_output_to_stderr():
            workload = build_workload(args, args.batch, "predict")
        if not args.json:
            stderr_console().print(f"recording {workload.description} on the meta device ...")
        # A generate step runs one forward of the model per new token: the bar counts them.
        spec = workload.spec
        generating = spec is not None and spec.mode == "generate" and bool(workload.track)
        tokens = spec.new_tokens if generating and spec is not None else None
        model = workload.track[0] if generating else None
        with (
            step_progress(progress_enabled(args, sys.stderr), args.steps, tokens) as progress,
            progress.count_forwards(model),
            user_errors(lambda: (args.target, workload.raised)),
            user_output_to_stderr(),
        ):
            prediction = predict(
                progress.wrap(workload.step_fn),
                target=target,
                steps=args.steps,
                budget_bytes=args.budget,
                track=workload.track,
                description=workload.description,
                workload=workload.spec,
                compile=args.compile,
            )
    notes = getattr(args, "trainer_notes", None)
    if notes:  # --trainer-args: what was read from it, overridden and ignored
        import dataclasses

        assumptions = {**prediction.assumptions, **notes}
        prediction = dataclasses.replace(prediction, assumptions=assumptions)
    if args.json:
        print_json(prediction_to_json(prediction))
    else:
        render_prediction(prediction, stdout_console())
    if nothing_recorded(prediction):
        return 2  # nothing was predicted (a model left on the CPU?): the verdict says so
    ok = prediction.fits and prediction.within_budget is not False
    return 0 if ok else 1


def _predict_sharded(args: argparse.Namespace, target: Any) -> Any:
    """``--fsdp``/``--tp``/``--dp``: rank 0 of the preset (FSDP2, HSDP, TP, DDP) recorded on a
    fake process group."""
    import dataclasses

    from oomkit.interfaces.cli._sharded import (
        layout_words,
        parallel_workload,
        record_rank_0,
        refuse_layout,
    )
    from oomkit.prediction.predictor import predict_recording
    from oomkit.prediction.tracing.emulations import current_sdpa_settings

    layout = target.parallel
    refuse_layout(args, layout, "predict")
    workload = parallel_workload(args, layout, args.batch)
    if not args.json:
        stderr_console().print(
            f"recording rank 0 of {layout.world_size} ({layout_words(args, layout)}) on a fake "
            "process group ..."
        )
    with user_errors(lambda: (args.target, workload.raised)), user_output_to_stderr():
        recording = record_rank_0(workload, layout, steps=args.steps, target=target)
    if target.cudnn_version is None:
        # Not stated: the tracer used the settings in effect; the result names that version.
        target = dataclasses.replace(target, cudnn_version=current_sdpa_settings().cudnn_version)
    return predict_recording(
        recording,
        target=target,
        budget_bytes=args.budget,
        description=workload.description,
        workload=workload.spec,
    )
