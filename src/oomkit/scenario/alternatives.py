"""When not even batch 1 fits: the largest batch with each change that applies, measured.

``fit`` of a step that does not fit at batch 1 says why; this searches the batch again with
each change ``oomkit predict``'s remedies measure that applies to the step
(``diagnose.remedy_measurement.step_changes``: mixed precision, pure bf16, activation
checkpointing, SGD, LoRA adapters at peft's defaults, QLoRA, 8-bit AdamW), then with their
combinations (``combined_changes``: checkpointing with mixed or pure bf16, then with QLoRA),
stopping at the first combination that fits. (``predict``'s remedies try the combinations only
where no change fits alone: there the question is whether the step fits, here how large a
batch does.) Each answer is the batch search of that scenario, as ``oomkit fit`` with the
change's flags added runs it (with ``--lengths``, the largest batch whose whole run fits), so
the flags it prints give that batch. A LoRA or QLoRA change loads the base in bf16 (fp16 without bf16) where the step
kept fp32 weights, as peft users do, and its flags name the precision.

Only a preset or a ``--hf`` model's training step is searched: a ``file.py:function`` builds
its own step, whose precision and checkpointing are the user's code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from oomkit.errors import NoFeasibleBatchSizeError, OomkitError

if TYPE_CHECKING:
    from oomkit.diagnose.remedy_measurement import StepChange
    from oomkit.scenario.model import Scenario

__all__ = ["FitAlternative", "fit_alternatives", "searches_alternatives"]

# The step section's fields a searched change may set (StepOptions fields of the same name).
_STEP_FIELDS = frozenset({"precision", "checkpointing", "optimizer", "optimizer_impl"})
# StepOptions fields of the fine-tuning changes, set in the lora and quantize sections.
_FINETUNE_FIELDS = frozenset({"lora", "quantize", "double_quant", "compute_dtype"})


@dataclass(frozen=True)
class FitAlternative:
    """One change to the step, and the largest batch that fits with it.

    Attributes:
        title: the change in words ("activation checkpointing").
        flags: the options that apply it ("--checkpointing full").
        settings: the scenario fields it sets, as ``--set`` names them
            (``{"step.checkpointing": "full"}``, ``{"lora.rank": 8, "quantize.format":
            "nf4", "step.precision": "bf16-mixed"}``).
        batch_size: the largest batch that fits with it (with ``--lengths``: whose whole run
            fits); ``None``: not even batch 1 does.
        peak_reserved_bytes: what that batch needs reserved (with ``--lengths``: at the run's
            worst step); with ``batch_size`` ``None``, what batch 1 needs, or ``None`` where
            its run runs out of memory part-way.
        combined: several changes together, tried because none fits alone.
    """

    title: str
    flags: str
    settings: Mapping[str, object]
    batch_size: int | None
    peak_reserved_bytes: int | None
    combined: bool = False


def fit_alternatives(
    scenario: Scenario, *, progress: Callable[[int, int], None] | None = None
) -> tuple[FitAlternative, ...]:
    """The largest batch with each change that applies, for a scenario whose batch 1 does not
    fit (``fit`` raised ``NoFeasibleBatchSizeError``).

    Args:
        scenario: the request ``fit`` was given (a batch search, of one step or with
            ``lengths`` of a whole run: not ``smallest_gpu`` or ``global_batch``).
        progress: called as ``progress(done, total)`` after each search.

    Returns:
        One record per change searched, in the order tried (each change alone, then the
        combinations up to the first that fits). Empty when the step's
        options are not oomkit's to change (a ``file.py:function``, an inference step) or
        nothing applies.

    Raises:
        OomkitError: a single change that every model takes cannot be built (as ``fit``).
    """
    from oomkit.diagnose.remedy_measurement import (
        combined_changes,
        combined_fields,
        step_changes,
    )
    from oomkit.scenario.fitting import check_fit, fit

    target = check_fit(scenario)
    if not searches_alternatives(scenario):
        return ()
    base = _base_options(scenario, target.gpu)
    changes = [
        change for change in step_changes(base, target.gpu.compute_capability)
        if change.fields.keys() <= _STEP_FIELDS | _FINETUNE_FIELDS
    ]
    total = len(changes)
    out: list[FitAlternative] = []

    def searched(chosen: list[StepChange], combined: bool) -> FitAlternative:
        settings = _settings(combined_fields(chosen), base)
        title = " + ".join(change.title for change in chosen)
        flags = " ".join(change.flag for change in chosen if change.flag)
        try:
            answer = fit(_changed(scenario, settings))
        except NoFeasibleBatchSizeError as exc:
            return FitAlternative(
                title, flags, settings, None, exc.needed_reserved_bytes, combined
            )
        found = answer.result
        peak = (
            found.envelope.worst_peak_reserved_bytes if answer.kind == "lengths"
            else found.peak_reserved_bytes
        )
        return FitAlternative(title, flags, settings, found.batch_size, peak, combined)

    for done, change in enumerate(changes, 1):
        try:
            out.append(searched([change], False))
        except OomkitError:
            if not change.optional:  # 8-bit AdamW needs a model it can replace the optimizer of
                raise
        finally:
            if progress is not None:
                progress(done, total)
    # The combinations too, where a change fits alone: the question is the largest batch, and
    # checkpointing with QLoRA fits a larger one than QLoRA alone (llama-8b on an RTX 4090).
    for combination in combined_changes(changes):
        if len(combination) < 2:  # a change alone was searched above
            continue
        total += 1
        try:
            alternative = searched(combination, True)
        except OomkitError:  # each change builds alone; this pairing is not modelled
            continue
        finally:
            if progress is not None:
                progress(total, total)
        out.append(alternative)
        if alternative.batch_size is not None:
            break
    return tuple(out)


def _settings(fields: Mapping[str, Any], base: Any) -> dict[str, object]:
    """A change's ``StepOptions`` fields as the scenario's ``section.key`` settings; a LoRA or
    QLoRA change names the base's precision, its own or else the step's (as its flags do:
    ``_finetune_flag``), since a LoRA base would otherwise take the bf16 default."""
    settings: dict[str, object] = {
        f"step.{name}": value for name, value in fields.items() if name in _STEP_FIELDS
    }
    lora = fields.get("lora")
    if lora is not None:
        settings["lora.rank"] = lora.r  # peft's defaults otherwise, as LoraOptions()
    if fields.get("quantize") is not None:
        settings["quantize.format"] = fields["quantize"]
        settings["quantize.double_quant"] = bool(fields.get("double_quant"))
        if fields.get("compute_dtype") is not None:
            settings["quantize.compute_dtype"] = fields["compute_dtype"]
    if fields.keys() & _FINETUNE_FIELDS and base.precision is not None:
        settings.setdefault("step.precision", base.precision)
    return settings


def _changed(scenario: Scenario, settings: Mapping[str, object]) -> Scenario:
    """``scenario`` with ``settings`` (``section.key`` -> value) set, sections made where the
    scenario has none (a LoRA section for a full fine-tune)."""
    from oomkit.scenario.model import LoraSection, QuantizeSection

    sections: dict[str, dict[str, object]] = {}
    for name, value in settings.items():
        section, key = name.split(".", 1)
        sections.setdefault(section, {})[key] = value
    update: dict[str, Any] = {}
    if "step" in sections:
        update["step"] = scenario.step.model_copy(update=sections["step"])
    for section, kind in (("lora", LoraSection), ("quantize", QuantizeSection)):
        if section in sections:
            given = getattr(scenario, section)
            update[section] = (
                kind(**sections[section]) if given is None
                else given.model_copy(update=sections[section])
            )
    return scenario.model_copy(update=update)


def searches_alternatives(scenario: Scenario) -> bool:
    """Whether ``fit_alternatives`` searches anything for ``scenario``: a preset's or ``--hf``
    model's training step in a batch search, of one step or of a whole run (``lengths``), not
    ``smallest_gpu`` or ``global_batch``."""
    search = scenario.search
    return (
        scenario.model.kind in ("preset", "hf")
        and (scenario.step.mode or "train") == "train"
        and not search.smallest_gpu
        and search.global_batch is None
    )


def _base_options(scenario: Scenario, gpu: Any) -> Any:
    """The ``StepOptions`` the scenario's step is built with at batch 1, defaults resolved (a
    ``--hf`` model's precision from its config): the workload record of the built step."""
    import torch

    from oomkit.prediction.models import StepOptions
    from oomkit.scenario.workloads import build_workload

    with torch.device("meta"):
        workload = build_workload(scenario, 1, gpu)
    assert workload.spec is not None  # a preset's and a --hf model's record is always kept
    known = {name: value for name, value in workload.spec.options.items() if value is not None}
    return StepOptions(**known)
