"""A scenario with a ``lengths`` section: a run of variable-length steps (the epoch envelope).

``length_recorder`` records the scenario's step at one (batch, length); ``predict_lengths`` and
``fit_lengths`` replay the whole run (``prediction/envelope.py``, ``plan/envelope_fit.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomkit.errors import OomkitError
from oomkit.scenario.workloads import build_workload

if TYPE_CHECKING:
    from oomkit.core.target import Target
    from oomkit.plan.envelope_fit import EnvelopeFit
    from oomkit.prediction.envelope import Envelope
    from oomkit.scenario.model import Scenario

__all__ = ["COMPILED_LENGTHS", "fit_lengths", "length_recorder", "predict_lengths"]

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


def length_recorder(
    scenario: Scenario, target: Target, raised: list[BaseException]
) -> Callable[[int | None, int], tuple[Any, str]]:
    """``(batch, length) -> (two-step recording, description)`` of the scenario's model; what
    the user's code raised is kept in ``raised`` for the error message."""
    from oomkit.plan.batch_probe import new_model_cache
    from oomkit.prediction.tracing import trace_step

    # One model for every length and batch recorded (model_cache.py: its key leaves both out).
    models = new_model_cache()
    compiled = scenario.step.compile

    def record(batch: int | None, length: int) -> tuple[Any, str]:
        shaped = scenario.model_copy(
            update={"step": scenario.step.model_copy(update={"seq": length})}
        )
        with models.active():
            workload = build_workload(shaped, batch, target.gpu)
        raised[:] = workload.raised
        step_fn = workload.step_fn

        def step(*_tracked: object) -> object:
            return step_fn()  # the tracked objects are passed only to be recorded (as predict)

        recording = trace_step(step, *workload.track, steps=2, target=target, compile=compiled)
        if compiled:
            assumptions = {**recording.assumptions, "torch.compile lengths": COMPILED_LENGTHS}
            recording = dataclasses.replace(recording, assumptions=assumptions)
        return recording, workload.description.replace(f"seq {length}", "variable seq")

    return record


def _check(scenario: Scenario) -> None:
    model = scenario.model
    if model.preset in ("resnet50", "vit-b16"):
        raise OomkitError(f"--lengths varies the sequence length; {model.preset} takes images")


def _max_length(scenario: Scenario) -> int | None:
    """A preset's positions (the longest sequence it takes), to refuse a longer length before
    anything is recorded; None for --hf and file.py:function targets (their builders check)."""
    if scenario.model.preset is None:
        return None
    from oomkit.prediction.models import get_preset

    try:
        shape = get_preset(scenario.model.preset).shape
    except ValueError:
        return None  # an unknown preset: building says so
    positions = getattr(shape, "positions", None)
    return positions if isinstance(positions, int) else None


def _run_options(scenario: Scenario, progress: Callable[[str], None] | None) -> dict[str, Any]:
    """What both runs over the lengths take from the scenario: the steps, their padding and
    order, the longest length allowed, and the progress lines."""
    lengths = scenario.lengths
    assert lengths is not None
    return {
        "steps": scenario.run.steps,
        "pad_to": lengths.pad_to,
        "seed": lengths.seed,
        "max_length": _max_length(scenario),
        "progress": progress,
    }


def predict_lengths(
    scenario: Scenario,
    target: Target,
    raised: list[BaseException],
    *,
    progress: Callable[[str], None] | None = None,
    record_jobs: int | None = 1,
) -> Envelope:
    """Record each distinct length once, replay the run, price remedies (``--lengths``)."""
    from oomkit.prediction.envelope import predict_envelope
    from oomkit.prediction.lengths import read_lengths

    _check(scenario)
    assert scenario.lengths is not None
    lengths = read_lengths(Path(scenario.lengths.file))
    description = ""
    record_at = length_recorder(scenario, target, raised)

    def record(length: int) -> Any:
        nonlocal description
        recording, description = record_at(scenario.step.batch, length)
        return recording

    return predict_envelope(
        record,
        lengths,
        target,
        description=lambda: description,
        jobs=scenario.run.jobs,
        record_jobs=record_jobs,
        **_run_options(scenario, progress),
    )


def fit_lengths(
    scenario: Scenario,
    target: Target,
    raised: list[BaseException],
    *,
    progress: Callable[[str], None] | None = None,
    jobs: int | None = 1,
) -> EnvelopeFit:
    """The largest batch whose whole run fits (``fit --lengths``).

    Raises:
        NoFeasibleBatchSizeError: not even batch 1 fits.
    """
    from oomkit.plan.envelope_fit import max_batch_for_run
    from oomkit.prediction.lengths import read_lengths

    _check(scenario)
    assert scenario.lengths is not None
    lengths = read_lengths(Path(scenario.lengths.file))
    record_at = length_recorder(scenario, target, raised)

    def record(batch: int, length: int) -> Any:
        return record_at(batch, length)[0]

    def description() -> str:
        """The step's description at batch 1, for the advice when not even that fits (the
        recordings may have been made in forked processes, whose descriptions stay there)."""
        shaped = scenario.model_copy(
            update={"step": scenario.step.model_copy(update={"seq": max(lengths)})}
        )
        built = build_workload(shaped, 1, target.gpu)
        return built.description.replace(f"seq {max(lengths)}", "variable seq")

    return max_batch_for_run(
        record,
        lengths,
        target,
        description=description,
        margin_bytes=scenario.search.margin_bytes,
        start_batch=scenario.step.batch or 1,
        max_batch=scenario.search.max_batch,
        jobs=jobs,
        **_run_options(scenario, progress),
    )
