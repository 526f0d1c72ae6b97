"""``predict`` of a scenario from a recording kept on disk (``prediction/recording_cache.py``).

A hit replays the kept recording without importing torch: the CLI asks ``cached_prediction``
before anything imports torch. A miss records as ``PredictRun.record`` does and keeps the
recording (``record_and_keep``). The replay, the report and ``--json`` of a hit are those of
the miss, byte for byte: the same recording goes through the same ``predict_recording``.

Only requests whose recording is settled by what the key holds are cached (``cache_refusal``):
a preset or a Hugging Face config read from a local directory (its ``config.json``'s bytes in
the key), on one GPU, recorded eagerly, in a process whose torch is not yet imported (a fresh
process: the state the key assumes; the Python API in a process that already imported torch
records afresh). Never the user's code (``file.py:function``, a script, ``--eval``, an HF
Trainer's arguments, a torchtitan job, a config with ``auto_map``), which can read anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomkit.prediction.recording_cache import (
    CachedRecording,
    cache_disabled,
    load_recording,
    plain_data,
    plain_value,
    recorder_environment,
    recording_key,
    store_recording,
)
from oomkit.prediction.workload import WorkloadSpec
from oomkit.scenario.model import Scenario

if TYPE_CHECKING:
    from oomkit.prediction.predictor import Prediction
    from oomkit.scenario.run import PredictRun, StepObserver

__all__ = [
    "cache_key",
    "cache_refusal",
    "cached_prediction",
    "predict_with_cache",
    "record_and_keep",
]


def cache_refusal(
    scenario: Scenario,
    *,
    environ: Mapping[str, str] | None = None,
    modules: Mapping[str, Any] | None = None,
) -> str | None:
    """Why ``scenario``'s recording is not cached, in words; ``None`` when it is cacheable.

    Args:
        scenario: the request.
        environ: the environment (``OOMKIT_NO_CACHE``); default ``os.environ``.
        modules: the modules imported so far; default ``sys.modules``.
    """
    env = os.environ if environ is None else environ
    if cache_disabled(env):
        return "OOMKIT_NO_CACHE is set"
    model, step = scenario.model, scenario.step
    if scenario.torchtitan is not None:
        return "a torchtitan job runs its own code"
    if scenario.lengths is not None:
        return "--lengths records several lengths"
    if model.kind not in ("preset", "hf"):
        return "the step is your own code (file.py:function or a script)"
    if model.eval_function is not None or model.trainer_args is not None:
        return "--eval and --trainer-args run your own code or read your own file"
    if scenario.parallel is not None and scenario.parallel.given:
        return "a sharded step is recorded on a fake process group"
    if step.compile:
        return "--compile runs dynamo and Inductor, which read more than the key holds"
    if "torch" in (sys.modules if modules is None else modules):
        return "torch is already imported in this process (its state may differ)"
    if model.hf is not None and _hf_config_digest(model.hf) is None:
        return (
            "a Hugging Face model is cached only from a local directory's config.json, "
            "without code of its own (auto_map, .py files)"
        )
    return None


def cache_key(
    scenario: Scenario,
    *,
    environ: Mapping[str, str] | None = None,
    modules: Mapping[str, Any] | None = None,
) -> str | None:
    """The recording's key (``recording_key``): the whole scenario as JSON, the bytes of a
    local HF config, and the environment the recorder reads; ``None`` when not cacheable
    (``cache_refusal``, whose arguments these are)."""
    if cache_refusal(scenario, environ=environ, modules=modules) is not None:
        return None
    material: dict[str, Any] = {
        "scenario": scenario.model_dump(mode="json"),
        "environment": recorder_environment(environ),
    }
    if scenario.model.hf is not None:
        material["hf_config_sha256"] = _hf_config_digest(scenario.model.hf)
    return recording_key(material)


def _hf_config_digest(name: str) -> str | None:
    """SHA-256 of ``name``'s ``config.json`` when ``name`` is a local directory whose config
    names no code of its own (``auto_map``) and which holds no Python files; else ``None``
    (a hub name resolves through a cache and the network: not keyed here)."""
    folder = Path(name)
    try:
        if not folder.is_dir() or any(p.suffix == ".py" for p in folder.iterdir()):
            return None
        if not (folder / "config.json").is_file():  # a FIFO's read would wait for a writer
            return None
        data = (folder / "config.json").read_bytes()
        config = json.loads(data)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or "auto_map" in config:
        return None
    return hashlib.sha256(data).hexdigest()


def cached_prediction(
    scenario: Scenario, key: str, *, directory: Path | None = None
) -> Prediction | None:
    """The prediction replayed from the recording kept as ``key`` (``cache_key(scenario)``),
    or ``None`` on a miss. Imports no torch."""
    recording = load_recording(key, directory)
    if recording is None:
        return None
    context = recording.context
    try:
        workload = _workload_of(context.get("workload"))
        description = context["description"]
        notes = context["notes"]
        cudnn = context["cudnn_version"]
        if not isinstance(description, str) or not isinstance(notes, dict):
            return None
        if not all(isinstance(text, str) for text in notes.values()):
            return None
        if cudnn is not None and type(cudnn) is not int:
            return None
    except (KeyError, TypeError):
        return None
    from oomkit.scenario.run import scenario_target

    target = scenario_target(scenario)
    return _replayed(scenario, recording, target, cudnn, workload, description, notes)


def record_and_keep(
    run: PredictRun,
    key: str | None,
    observer: StepObserver | None = None,
    *,
    directory: Path | None = None,
) -> Prediction:
    """Record ``run``'s step as ``run.record(observer)`` does and return its prediction; with
    a ``key`` (``cache_key`` of its scenario, taken before torch was imported), keep the
    recording as that key (``cached_prediction`` then replays it).

    An entry is kept only when it reads back equal to the recording, and the workload and
    notes this replay reports are the ones read back: a hit replays exactly what this did.
    """
    scenario = run.scenario
    from oomkit.scenario.workloads import Workload, user_errors

    workload = run.workload
    if key is None or not isinstance(workload, Workload) or run.target.parallel is not None:
        return run.record(observer)
    from oomkit.prediction.tracing import trace_step
    from oomkit.prediction.tracing.emulations import current_sdpa_settings

    # prediction/predictor.py predict: the tracked objects go to the tracer, not to the step.
    def step(*_tracked: Any) -> Any:
        return step_fn()

    step_fn = workload.step_fn if observer is None else observer.wrap(workload.step_fn)
    counting: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if observer is not None and run.new_tokens is not None:
        counting = observer.count_forwards(workload.track[0])
    name = scenario.model.name
    with user_errors(lambda: (name, workload.raised)), counting:
        recording = trace_step(
            step,
            *workload.track,
            steps=run.steps,
            target=run.target,
            require_allocations=True,
            compile=False,
        )
    cudnn = run.target.cudnn_version
    if cudnn is None:
        # predictor.predict: not stated, the tracer used the settings in effect.
        cudnn = current_sdpa_settings().cudnn_version
    context = {
        "description": workload.description,
        "workload": None if workload.spec is None else dataclasses.asdict(workload.spec),
        "notes": dict(run.notes),
        "cudnn_version": cudnn,
    }
    kept = CachedRecording(
        events=tuple(recording.events),
        step_starts=tuple(recording.step_starts),
        warnings=tuple(recording.warnings),
        bytes_by_category={str(k): v for k, v in recording.bytes_by_category.items()},
        kernel_choices=dict(recording.kernel_choices),
        assumptions=dict(recording.assumptions),
        collective_ids=recording.collective_ids,
        timing_note=recording.timing_note,
        context=context,
        memory_fraction=recording.memory_fraction,
    )
    try:
        # What a hit will read: the context through the entry's codec.
        context = plain_value(plain_data(context))
        spec = _workload_of(context["workload"])
    except TypeError:
        spec = workload.spec  # not plain data: recorded, not kept
    else:
        if recording.memory_fraction is None:  # an entry does not keep a memory fraction
            store_recording(key, dataclasses.replace(kept, context=context), directory)
    return _replayed(scenario, kept, run.target, cudnn, spec, workload.description, run.notes)


def _workload_of(data: Any) -> WorkloadSpec | None:
    """The ``WorkloadSpec`` of a context's ``workload`` (``dataclasses.asdict`` of one)."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise TypeError("workload is not a mapping")
    return WorkloadSpec(**data)


def _replayed(
    scenario: Scenario,
    recording: Any,
    target: Any,
    cudnn_version: int | None,
    workload: WorkloadSpec | None,
    description: str,
    notes: Mapping[str, str],
) -> Prediction:
    """``predict_recording`` of a recording as ``PredictRun.record`` makes it: the cuDNN
    version filled in (predictor.predict), the notes and the scenario added (run.py
    ``_with_scenario``)."""
    from oomkit.prediction.predictor import predict_recording
    from oomkit.scenario.files import scenario_to_data

    if target.cudnn_version is None:
        target = dataclasses.replace(target, cudnn_version=cudnn_version)
    prediction = predict_recording(
        recording,
        target=target,
        budget_bytes=scenario.run.budget_bytes,
        description=description,
        workload=workload,
    )
    assumptions = {**prediction.assumptions, **notes}
    return dataclasses.replace(
        prediction, assumptions=assumptions, scenario=scenario_to_data(scenario)
    )


def predict_with_cache(
    scenario: Scenario, observer: StepObserver | None = None, *, cache: bool = True
) -> Prediction:
    """``oomkit.scenario.predict`` through the cache: a hit replayed, a miss recorded and kept
    (``cache=False``, or a scenario that is not cacheable: recorded as always)."""
    from oomkit.scenario.run import predict, predicting

    key = cache_key(scenario) if cache else None
    if key is None:
        return predict(scenario, observer)
    hit = cached_prediction(scenario, key)
    if hit is not None:
        return hit
    with predicting(scenario) as run:
        return record_and_keep(run, key, observer)
