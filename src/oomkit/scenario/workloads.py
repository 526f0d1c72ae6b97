"""A scenario's ``model`` built into a step to record, at one batch size.

The model is a preset, a Hugging Face model or the user's ``file.py:function``; ``fit`` builds
one per batch size tried.

What the user's code raises is kept with the workload, so that an error from their step is
reported as theirs (``user_errors``), and tensor values their code reads are followed while it
is built and traced (``user_values``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oomkit.errors import OomkitError, UserCodeError
from oomkit.prediction.workload import WorkloadKind, WorkloadSpec
from oomkit.scenario.options import ResolvedStep, field_wording, step_options

if TYPE_CHECKING:
    from oomkit.core.gpus import GpuSpec
    from oomkit.scenario.model import Scenario

__all__ = [
    "VISION_PRESETS",
    "Workload",
    "build_workload",
    "call_builder",
    "preset_step",
    "user_code_error",
    "user_errors",
    "user_values",
    "user_workload_spec",
    "workload_spec",
]

# The presets that take --image-size (the others take --seq); a test pins them to the presets'.
VISION_PRESETS = ("vit-b16", "resnet50")
# The smallest image the vision presets take: ResNet-50 halves its input five times (stride-2
# conv, max pool, three stride-2 stages: torchvision/models/resnet.py) before its 1x1 adaptive
# pool, and ViT-B/16 needs at least one 16x16 patch (torchvision/models/vision_transformer.py
# asserts the size divides by the patch).
_MIN_IMAGE = {"resnet50": 32, "vit-b16": 16}


@dataclass(frozen=True)
class Workload:
    """One built step: what to record, and what the user's code raised while running.

    Attributes:
        step_fn: one step, to run under the tracer.
        track: objects recorded as allocated before the first step.
        description: what it is ("GPT-2 124M, batch 8, ...").
        raised: exceptions the user's own step raised (empty for presets).
        spec: the same as data (kind, name, batch size, mode...), saved with a prediction.
        defaults: the defaults chosen for it, in words (``ResolvedStep.defaults``).
        trainer_notes: what ``model.trainer_args`` was read as.
    """

    step_fn: Any
    track: tuple[Any, ...]
    description: str
    raised: list[BaseException] = field(default_factory=list)
    spec: WorkloadSpec | None = None
    defaults: Mapping[str, str] = field(default_factory=dict)
    trainer_notes: Mapping[str, str] = field(default_factory=dict)


def workload_spec(
    kind: WorkloadKind, name: str, options: Any, steps: int | None, built: Any
) -> WorkloadSpec:
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


def preset_step(scenario: Scenario, batch_size: int | None, gpu: GpuSpec) -> ResolvedStep:
    """The resolved step of ``model.preset`` at ``batch_size``, its shape fields checked.

    Raises:
        OomkitError: an unknown preset, or a shape field of the other kind of model.
    """
    from oomkit.prediction.models import get_preset

    name = scenario.model.preset
    assert name is not None
    try:
        preset = get_preset(name)
    except OomkitError:
        raise
    except ValueError as exc:
        raise OomkitError(str(exc)) from exc
    _check_shape(scenario, preset)
    return step_options(scenario, batch_size, preset, gpu)


def _check_shape(scenario: Scenario, preset: Any) -> None:
    """--seq on a vision preset and --image-size on a text one would change nothing; an image
    below what the model's strides take fails deep in torch: each is refused, by name."""
    vision = preset.task == "image_classification"
    step = scenario.step
    flag, value = ("--seq", step.seq) if vision else ("--image-size", step.image_size)
    if value is not None:
        kind, other = ("a vision model", "--image-size") if vision else ("a text model", "--seq")
        raise OomkitError(
            f"{flag} does not apply to {preset.name}: {preset.title} is {kind}, so {flag} "
            f"{value} would change nothing. Use {other} instead, or drop {flag}."
        )
    smallest = _MIN_IMAGE.get(preset.name)
    if vision and smallest is not None and step.image_size is not None:
        if step.image_size < smallest or (
            preset.name == "vit-b16" and step.image_size % smallest
        ):
            rule = "a multiple of 16 (its patch size)" if preset.name == "vit-b16" else (
                f"at least {smallest} (it halves the image five times)"
            )
            raise OomkitError(
                f"--image-size {step.image_size} is too small for {preset.name}: the size must "
                f"be {rule}. Example: --image-size 224"
            )


def build_workload(
    scenario: Scenario, batch_size: int | None, gpu: GpuSpec, *, steps: int | None = None
) -> Workload:
    """Build the step the scenario's ``model`` names, at ``batch_size``.

    Args:
        scenario: the request (its ``model`` names a preset, a Hugging Face model or a
            ``file.py:function``).
        batch_size: the batch; ``None``: ``step.batch``, else the default.
        gpu: the target GPU (its bf16 support picks default precisions).
        steps: steps that will be recorded (kept in the workload record).

    Raises:
        OomkitError: nothing named, or a preset option it rejects.
        UserCodeError: the user's function cannot be loaded or called.
    """
    model = scenario.model
    if model.hf is not None:
        return _hf_workload(scenario, batch_size, gpu, steps)
    if model.function is not None:
        return _function_workload(scenario, model.function, batch_size, steps, gpu)
    if model.preset is None:
        raise OomkitError(
            "name what to run: a preset (e.g. `oomkit predict gpt2-124m --gpu rtx4090`), "
            "path/to/file.py:function, or --hf NAME_OR_PATH (model.preset, model.function, "
            "model.hf)."
        )
    from oomkit.prediction.models import build_preset_step

    resolved = preset_step(scenario, batch_size, gpu)
    built = call_builder(build_preset_step, model.preset, resolved.options)
    spec = workload_spec("preset", model.preset, resolved.options, steps, built)
    return Workload(
        built.step_fn, tuple(built.track), built.description, spec=spec,
        defaults=resolved.defaults, trainer_notes=resolved.trainer_notes,
    )


def _hf_workload(
    scenario: Scenario, batch_size: int | None, gpu: GpuSpec, steps: int | None
) -> Workload:
    try:
        from oomkit.prediction.models import build_hf_step
    except ImportError as exc:
        if "torch" in str(exc) or "transformers" in str(exc):
            raise
        raise OomkitError(
            "--hf is not available in this build of oomkit (oomkit.prediction.models has no "
            "build_hf_step); use a preset or path/to/file.py:function."
        ) from exc
    name = scenario.model.hf
    assert name is not None
    resolved = step_options(scenario, batch_size, None, gpu)
    built = call_builder(build_hf_step, name, resolved.options)
    spec = workload_spec("hf", name, resolved.options, steps, built)
    return Workload(
        built.step_fn, tuple(built.track), built.description, spec=spec,
        defaults=resolved.defaults, trainer_notes=resolved.trainer_notes,
    )


def _function_workload(
    scenario: Scenario, target: str, batch_size: int | None, steps: int | None, gpu: GpuSpec
) -> Workload:
    from oomkit.scenario.user_function import load_user_step

    step = scenario.step
    user = load_user_step(
        target,
        batch_size=batch_size if batch_size is not None else step.batch,
        seq_len=step.seq,
        image_size=step.image_size,
        gpu=gpu,  # torch.cuda answers for the target while the file imports and builds
    )
    spec = user_workload_spec(target, user, steps)
    return Workload(user.step_fn, user.track, user.description, user.raised, spec)


def call_builder(builder: Any, name: str, options: Any) -> Any:
    """``builder(name, options)``, its option errors worded with the scenario's flags."""
    try:
        return builder(name, options)
    except OomkitError as exc:
        # Presets and Hugging Face models word their option errors for the Python API.
        worded = field_wording(str(exc))
        if worded == str(exc):
            raise  # kept as it is (TorchRequiredError must still exit 3)
        raise OomkitError(worded) from exc
    except ValueError as exc:
        # UnknownPresetError and option checks are ValueErrors with a message that says what to do.
        raise OomkitError(field_wording(str(exc))) from exc


def user_values(values: Mapping[str, float]) -> contextlib.AbstractContextManager[Any]:
    """While open (around building and tracing the step), tensor values are followed and
    reads answered, stated (``step.values``, ``--value``) or given stand-ins
    (``value_reads.value_tracking``); a no-op where torch is not installed (the step then fails
    to load first)."""
    try:
        from oomkit.prediction.tracing import value_tracking
    except ImportError:
        return contextlib.nullcontext()
    return value_tracking(dict(values))


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
