"""What ``oomkit predict`` and ``oomkit fit`` share: naming a workload and building its step.

A workload is a built-in preset, ``path/to/file.py:function`` (see ``_user_function``) or a
Hugging Face model (``--hf``), shaped by ``--seq``, ``--image-size``, ``--precision``,
``--optimizer``, ``--checkpointing`` and ``--mode``. ``build_workload`` builds its step at one
batch size; ``fit`` calls it once per batch size tried.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from oomkit.errors import OomkitError, UserCodeError
from oomkit.interfaces.cli._common import (
    add_alloc_conf_flag,
    add_gpu_flag,
    add_torch_version_flag,
    positive_int,
    size_arg,
)
from oomkit.interfaces.cli._finetune_flags import (
    FINETUNE_OPTION_FLAGS,
    add_lora_flags,
    add_quantize_flags,
    add_trainer_flags,
    lora_options,
    trainer_fields,
)
from oomkit.interfaces.cli._target import add_cuda_version_flag
from oomkit.prediction.workload import WorkloadKind, WorkloadSpec

__all__ = [
    "MODES",
    "OPTIMIZERS",
    "PRECISIONS",
    "PRESET_NAMES",
    "VISION_PRESETS",
    "Workload",
    "add_gpu_flags",
    "add_workload_flags",
    "build_workload",
    "catalog_epilog",
    "positive_int",
    "require_target",
    "stated_value",
    "step_options",
    "user_code_error",
    "user_errors",
    "user_output_to_stderr",
    "user_values",
    "user_workload_spec",
]

# The StepOptions vocabulary of oomkit.prediction.models (docs/CONTRACTS.md, "Issue 3").
PRECISIONS = ("fp32", "fp16-mixed", "bf16-mixed", "bf16")
OPTIMIZERS = ("adamw", "adam", "sgd", "adamw8bit", "paged-adamw8bit", "adafactor", "torch-adafactor")
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")
MODES = ("train", "inference", "generate")
# oomkit.prediction.models.PRESETS' names, for --help without importing torch (a test pins them
# to the presets' own); the vision ones take --image-size, the others --seq.
PRESET_NAMES = (
    "gpt2-124m",
    "gpt2-355m",
    "gpt2-774m",
    "gpt2-1.5b",
    "llama-1b",
    "llama-3b",
    "llama-8b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "llama-13b",
    "bert-base",
    "bert-large",
    "vit-b16",
    "resnet50",
)
VISION_PRESETS = ("vit-b16", "resnet50")


def catalog_epilog() -> str:
    """The presets and catalog GPUs, for the end of ``predict --help`` and ``fit --help``."""
    from oomkit.core.gpus import CATALOG

    gpus = ", ".join(spec.aliases[0] if spec.aliases else spec.name for spec in CATALOG)
    return (
        f"Presets: {', '.join(PRESET_NAMES)} (`oomkit presets` shows their sizes and defaults). "
        f"GPUs: {gpus}, or a size such as 24GiB (`oomkit gpus` shows their memory)."
    )


def add_workload_flags(parser: argparse.ArgumentParser, *, modes: tuple[str, ...] = MODES) -> None:
    """TARGET, the shape flags (--seq, --image-size), precision, optimizer, mode and --hf."""
    parser.add_argument("target", nargs="?", metavar="TARGET", help="PRESET or file.py:function")
    parser.add_argument(
        "--seq",
        type=positive_int,
        metavar="N",
        help="sequence length of a text model (default: the preset's, 1024 for GPT-2, 2048 "
        "for Llama, 512 for BERT)",
    )
    parser.add_argument(
        "--image-size",
        type=positive_int,
        metavar="N",
        help=f"image size of a vision model ({', '.join(VISION_PRESETS)}; default 224)",
    )
    # Defaults None: a file.py:function target refuses these flags when given (presets get their
    # own default precision, --hf the config's torch_dtype; both adamw, train).
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="presets and --hf (default: bf16-mixed for the GPT-2 and Llama presets, fp32 for "
        "the others; for --hf the config's torch_dtype)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="presets and --hf (default adamw); adamw8bit / paged-adamw8bit: bitsandbytes' "
        "8-bit states (emulated; paged states are unified memory, not counted on the GPU); "
        "adafactor: transformers' Adafactor as the HF Trainer sets it up; torch-adafactor: "
        "torch.optim.Adafactor (foreach, or --optimizer-impl for-loop)",
    )
    parser.add_argument(
        "--optimizer-impl",
        choices=OPTIMIZER_IMPLS,
        help="torch.optim's kernels: foreach (default, as on CUDA), fused (adamw, adam) or "
        "for-loop (adamw, adam, sgd, torch-adafactor)",
    )
    add_lora_flags(parser)
    add_quantize_flags(parser)
    add_trainer_flags(parser)
    parser.add_argument(
        "--checkpointing",
        nargs="?",
        const="full",
        default=None,
        choices=("none", "full", "selective-op"),
        help="activation checkpointing of each block (presets, --hf): none (default), full "
        "(a bare --checkpointing) or selective-op (torchtitan's per-op policy)",
    )
    parser.add_argument("--mode", choices=modes, help="presets and --hf (default train)")
    parser.add_argument(
        "--hf", metavar="NAME_OR_PATH", help="a Hugging Face model (config only, no weights)"
    )
    parser.add_argument(
        "--value",
        type=stated_value,
        action="append",
        metavar="FILE:LINE=NUMBER",
        help="the value a tensor read (.item(), bool(), int()) at FILE:LINE returns while "
        "tracing, e.g. --value train.py:42=1024 (repeatable)",
    )


def stated_value(text: str) -> tuple[str, float]:
    """``--value FILE:LINE=NUMBER`` -> ``("FILE:LINE", NUMBER)`` (an int when it is one)."""
    key, sep, number = text.rpartition("=")
    path, colon, line = key.rpartition(":")
    if not sep or not colon or not path or not line.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected FILE:LINE=NUMBER, the line that reads the value and the value; got "
            f"{text!r}. Example: --value train.py:42=1024"
        )
    try:
        value: float = int(number)
    except ValueError:
        try:
            value = float(number)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"the value in {text!r} is not a number. Example: --value train.py:42=1024"
            ) from None
    return key, value


def user_values(args: argparse.Namespace) -> contextlib.AbstractContextManager[Any]:
    """While open (around building and tracing the step), tensor values are followed and
    reads answered, stated (``--value``) or given stand-ins (``value_reads.value_tracking``);
    a no-op where torch is not installed (the step then fails to load first)."""
    try:
        from oomkit.prediction.tracing import value_tracking
    except ImportError:
        return contextlib.nullcontext()
    return value_tracking(dict(getattr(args, "value", None) or ()))


def add_gpu_flags(parser: argparse.ArgumentParser) -> None:
    """--gpu, --alloc-conf, --torch-version, --context-overhead, --cudnn-version and
    --cuda-version: the target machine (``interfaces/cli/_target.py`` reads them by these dest
    names)."""
    add_gpu_flag(
        parser,
        default="h100",
        help="a catalog GPU (e.g. rtx4090) or its total memory (e.g. 24GiB); the allocator may "
        "reserve that less --context-overhead (default h100)",
    )
    add_alloc_conf_flag(parser)
    add_torch_version_flag(parser, default="the installed torch's, which records the step")
    parser.add_argument(
        "--context-overhead",
        type=size_arg,
        metavar="SIZE",
        help="memory outside PyTorch (CUDA context), e.g. 500MiB (default: the GPU's figure)",
    )
    parser.add_argument(
        "--cudnn-version",
        type=positive_int,
        metavar="N",
        help="the target's torch.backends.cudnn.version(), e.g. 91002 for 9.10.2: from 9.15.1 "
        "on, H100/B200 run cuDNN attention (default: this torch build's cuDNN, else the one "
        "this torch version's default PyPI Linux wheel pins, e.g. 92000 for torch 2.13)",
    )
    add_cuda_version_flag(parser)


def step_options(args: argparse.Namespace, batch_size: int | None, preset: Any = None) -> Any:
    """The ``StepOptions`` the flags name, at ``batch_size`` (``None``: the default).

    Args:
        args: the parsed flags.
        batch_size: the batch; ``None`` takes the preset's default batch (else StepOptions').
        preset: the ``ModelPreset`` built, whose default precision and batch apply where the
            flags name none; ``None`` (``--hf``) keeps StepOptions' defaults.
    """
    from oomkit.prediction.models import StepOptions

    fields: dict[str, Any] = {}
    for name, value in (
        ("checkpointing", args.checkpointing or None),
        ("grad_accum", getattr(args, "grad_accum", None)),
        ("precision", args.precision),
        ("optimizer", args.optimizer),
        ("mode", args.mode),
        ("batch_size", batch_size),
        ("seq_len", args.seq),
        ("image_size", args.image_size),
        ("new_tokens", getattr(args, "new_tokens", None)),
        ("optimizer_impl", getattr(args, "optimizer_impl", None)),
        ("lora", lora_options(args)),
        ("quantize", getattr(args, "quantize", None)),
        ("double_quant", getattr(args, "double_quant", False) or None),
        ("compute_dtype", getattr(args, "compute_dtype", None)),
        ("compile", getattr(args, "compile", False) or None),
    ):
        if value is not None:
            fields[name] = value
    if getattr(args, "trainer_args", None) is not None:  # its values, under the flags given
        fields = trainer_fields(args, fields, preset)
    elif preset is not None:
        fields.setdefault("precision", preset.default_precision)
        fields.setdefault("batch_size", preset.default_batch_size)
    try:
        return StepOptions(**fields)
    except ValueError as exc:  # a combination the flags' choices cannot rule out
        raise OomkitError(cli_wording(str(exc))) from exc


@dataclass(frozen=True)
class Workload:
    """One built step: what to record, and what the user's code raised while running.

    Attributes:
        step_fn: one step, to run under the tracer.
        track: objects recorded as allocated before the first step.
        description: what it is ("GPT-2 124M, batch 8, ...").
        raised: exceptions the user's own step raised (empty for presets).
        spec: the same as data (kind, name, batch size, mode...), saved with a prediction.
    """

    step_fn: Any
    track: tuple[Any, ...]
    description: str
    raised: list[BaseException] = field(default_factory=list)
    spec: WorkloadSpec | None = None


def _spec(kind: WorkloadKind, name: str, options: Any, steps: int | None, built: Any) -> WorkloadSpec:
    """A preset's or Hugging Face model's workload record: its StepOptions as built (defaults
    resolved: an HF model's precision from its config), field by field."""
    resolved = getattr(built, "options", None) or options
    return WorkloadSpec(
        kind,
        name,
        **dataclasses.asdict(resolved),
        steps=steps,
        precision_source=getattr(built, "precision_source", None),
    )


def user_workload_spec(target: str, user: Any, steps: int | None) -> WorkloadSpec:
    """A ``file.py:function``'s workload record: the sizes it was called with; its precision,
    optimizer and mode are its own, so not known."""
    arguments = dict(user.arguments)
    return WorkloadSpec(
        "function",
        target,
        batch_size=arguments.get("batch_size"),
        seq_len=arguments.get("seq_len"),
        image_size=arguments.get("image_size"),
        steps=steps,
    )


def build_workload(args: argparse.Namespace, batch_size: int | None, command: str) -> Workload:
    """Build the step that TARGET (or ``--hf``) names, at ``batch_size``, with its record
    (recording ``--steps`` steps).

    Raises:
        OomkitError: no target, both a target and --hf, or a preset option it rejects.
        UserCodeError: the user's function cannot be loaded or called.
    """
    from oomkit.interfaces.cli._user_function import is_user_target, load_user_step

    steps = getattr(args, "steps", None)
    if args.hf is not None:
        if args.target is not None:
            raise OomkitError(
                f"give either a TARGET or --hf, not both (got {args.target!r} and --hf {args.hf})."
            )
        try:
            from oomkit.prediction.models import build_hf_step
        except ImportError as exc:
            if "torch" in str(exc) or "transformers" in str(exc):
                raise
            raise OomkitError(
                "--hf is not available in this build of oomkit (oomkit.prediction.models has no "
                "build_hf_step); use a preset or path/to/file.py:function."
            ) from exc

        options = step_options(args, batch_size)
        built = _call_builder(build_hf_step, args.hf, options)
        spec = _spec("hf", args.hf, options, steps, built)
        return Workload(built.step_fn, tuple(built.track), built.description, spec=spec)
    require_target(args, command)
    if is_user_target(args.target):
        _refuse_preset_flags(args)
        user = load_user_step(
            args.target, batch_size=batch_size, seq_len=args.seq, image_size=args.image_size
        )
        spec = user_workload_spec(args.target, user, steps)
        return Workload(user.step_fn, user.track, user.description, user.raised, spec)
    from oomkit.prediction.models import build_preset_step

    options = _preset_options(args, batch_size)
    built = _call_builder(build_preset_step, args.target, options)
    spec = _spec("preset", args.target, options, steps, built)
    return Workload(built.step_fn, tuple(built.track), built.description, spec=spec)


def _refuse_preset_flags(args: argparse.Namespace) -> None:
    """A file.py:function step runs as written: the flags that change how a preset is built
    would be silently ignored, so they are refused, by name."""
    given = [
        flag
        for flag, value in (
            ("--precision", args.precision),
            ("--optimizer", args.optimizer),
            ("--checkpointing", args.checkpointing),
            ("--mode", args.mode),
            ("--new-tokens", getattr(args, "new_tokens", None)),
            ("--optimizer-impl", getattr(args, "optimizer_impl", None)),
            ("--lora", getattr(args, "lora", None)),
            *((flag, getattr(args, name, None)) for name, flag in FINETUNE_OPTION_FLAGS),
            ("--dora", getattr(args, "dora", False) or None),
            ("--quantize", getattr(args, "quantize", None)),
            ("--double-quant", getattr(args, "double_quant", False) or None),
            ("--compute-dtype", getattr(args, "compute_dtype", None)),
            ("--grad-accum", getattr(args, "grad_accum", None)),
            ("--trainer-args", getattr(args, "trainer_args", None)),
        )
        if value is not None
    ]
    if given:
        raise OomkitError(
            f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to presets and "
            f"--hf only: {args.target} runs your step "
            "as written. Set them in your builder instead (torch.autocast for precision, your "
            "optimizer, torch.utils.checkpoint, model.eval() / torch.no_grad()), then drop "
            f"{'it' if len(given) == 1 else 'them'}."
        )


def _preset_options(args: argparse.Namespace, batch_size: int | None) -> Any:
    """The StepOptions of TARGET (a preset) at ``batch_size``, its shape flags checked.

    Raises:
        OomkitError: an unknown preset, or a shape flag of the other kind of model.
    """
    from oomkit.prediction.models import get_preset

    try:
        preset = get_preset(args.target)
    except OomkitError:
        raise
    except ValueError as exc:
        raise OomkitError(str(exc)) from exc
    _refuse_shape_flags(args, preset)
    return step_options(args, batch_size, preset)


def _refuse_shape_flags(args: argparse.Namespace, preset: Any) -> None:
    """--seq on a vision preset and --image-size on a text one would change nothing: refused,
    by name (exit 2)."""
    vision = preset.task == "image_classification"
    flag, value = ("--seq", args.seq) if vision else ("--image-size", args.image_size)
    if value is None:
        return
    kind, other = ("a vision model", "--image-size") if vision else ("a text model", "--seq")
    raise OomkitError(
        f"{flag} does not apply to {preset.name}: {preset.title} is {kind}, so {flag} {value} "
        f"would change nothing. Use {other} instead, or drop {flag}."
    )


# A library message names the Python API (StepOptions(seq_len=...)); the CLI names its flags.
_CLI_FLAGS = {"seq_len": "--seq", "image_size": "--image-size", "new_tokens": "--new-tokens",
              "batch_size": "--batch", "lora": "--lora", "quantize": "--quantize",
              "double_quant": "--double-quant", "compute_dtype": "--compute-dtype",
              "grad_accum": "--grad-accum"}
_STEP_OPTIONS_RE = re.compile(r"StepOptions\((\w+)=([^)]*)\)")


def cli_wording(message: str) -> str:
    """``message`` with each ``StepOptions(field=value)`` written as the flag that sets it
    (``StepOptions(seq_len=...)`` -> ``--seq N``)."""

    def flag(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        if name not in _CLI_FLAGS:
            return match.group(0)
        return f"{_CLI_FLAGS[name]} {'N' if value == '...' else value.strip(chr(39))}"

    return _STEP_OPTIONS_RE.sub(flag, message)


def _call_builder(builder: Any, name: str, options: Any) -> Any:
    try:
        return builder(name, options)
    except OomkitError as exc:
        # Presets and Hugging Face models word their option errors for the Python API.
        worded = cli_wording(str(exc))
        if worded == str(exc):
            raise  # kept as it is (TorchRequiredError must still exit 3)
        raise OomkitError(worded) from exc
    except ValueError as exc:
        # UnknownPresetError and option checks are ValueErrors with a message that says what to do.
        raise OomkitError(cli_wording(str(exc))) from exc


def user_output_to_stderr() -> contextlib.AbstractContextManager[Any]:
    """While the user's code runs (import, builder, steps), its prints go to stderr.

    stdout is oomkit's: `--json` must stay one JSON object, and a report one report, whatever
    the script prints while it builds (nanoGPT prints its parameter count).
    """
    return contextlib.redirect_stdout(sys.stderr)


@contextlib.contextmanager
def user_errors(
    culprit: Callable[[], tuple[str | None, list[BaseException]]],
) -> Iterator[None]:
    """Turn an exception the user's own step raised into a one-line ``UserCodeError``; oomkit's
    errors and anything else pass through unchanged.

    Args:
        culprit: returns the target and what its step raised, read when an exception arrives
            (``fit`` builds a new step per batch size, so both change while the block runs).
    """
    try:
        yield
    except OomkitError as exc:
        target, raised = culprit()
        mine = any(exc is e or exc.__cause__ is e for e in raised)
        if target is None or not mine or str(exc).startswith(target):
            raise
        # Raised inside the user's step (a value it reads, an op meta cannot run): say whose.
        raise type(exc)(f"{target}: {exc}") from exc
    except Exception as exc:
        target, raised = culprit()
        error = user_code_error(target, exc, raised)
        if error is None:
            raise
        raise error from exc


def user_code_error(
    target: str | None, exc: BaseException, raised: list[BaseException]
) -> UserCodeError | None:
    """A one-line ``UserCodeError`` when ``exc`` came from the user's own step, else ``None``:
    the user's line, the library line below it, and advice that fits the failure."""
    if not any(exc is e for e in raised):
        return None
    from oomkit.prediction.tracing.step_failure import failure_text

    return UserCodeError(f"{target}: {failure_text(exc)}")


def require_target(args: argparse.Namespace, command: str) -> None:
    """Refuse a command line that names nothing to ``command`` (no TARGET, no --hf)."""
    if args.target is None and getattr(args, "hf", None) is None:
        raise OomkitError(
            f"name what to {command}: a preset (e.g. `oomkit {command} gpt2-124m --gpu rtx4090`), "
            "path/to/file.py:function, or --hf NAME_OR_PATH."
        )
