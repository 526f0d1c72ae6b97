"""``oomkit.predict`` and ``oomkit.fit``: a ``Scenario``, its short form, or a step function.

Three ways to say what to predict, one path below them:

- ``oomkit.predict(scenario)``: a ``Scenario`` (built in Python, or read with
  ``oomkit.load_scenario("run.toml")``);
- ``oomkit.predict("gpt2-124m", batch=8, seq=1024, gpu="rtx4090")``: the short form, each
  keyword a field by its flag's name (``oomkit.scenario.keywords``);
- ``oomkit.predict(step_fn, model, opt, x, gpu="rtx4090")``: your own step function, called
  with the arguments given; the target keywords (``gpu``, ``alloc_conf``,
  ``context_overhead``, ``torch_version``, ``cuda_version``, ``cudnn_version``) make the same
  ``Target`` the scenario's ``target`` section does (``oomkit.scenario.target.target_of``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from oomkit.errors import ScenarioError
from oomkit.scenario.model import Scenario

if TYPE_CHECKING:
    from oomkit.prediction.predictor import Prediction
    from oomkit.scenario.alternatives import FitAlternative
    from oomkit.scenario.fitting import FitAnswer

__all__ = ["fit", "fit_alternatives", "predict"]

# The step-function form's keywords that name the target: TargetSection's fields by their
# flag's name, plus the whole Target.
_TARGET_KEYWORDS = {
    "gpu": "gpu",
    "alloc_conf": "alloc_conf",
    "context_overhead": "context_overhead_bytes",
    "context_overhead_bytes": "context_overhead_bytes",
    "torch_version": "torch_version",
    "cuda_version": "cuda_version",
    "cudnn_version": "cudnn_version",
}
# predict()'s own keywords in the step-function form (the rest go to the step function).
_STEP_KEYWORDS = ("steps", "budget_bytes", "track", "description", "workload", "values", "compile")


def _scenario(what: Any, keywords: Mapping[str, Any], command: str) -> Scenario:
    if isinstance(what, Scenario):
        if keywords:
            raise ScenarioError(
                f"oomkit.{command}(scenario) takes the scenario alone; change it with "
                f"scenario.model_copy(update=...) instead of keywords ({', '.join(keywords)})"
            )
        return what
    from oomkit.scenario.keywords import scenario_from_keywords

    if what is not None and not isinstance(what, str):
        raise ScenarioError(
            f"oomkit.{command}() takes a Scenario, a preset / file.py:function / train.py name, "
            f"or (predict) a step function; got {type(what).__name__}"
        )
    return scenario_from_keywords(what, command, **keywords)


def predict(what: Any = None, /, *args: Any, **keywords: Any) -> Prediction:
    """Predict a step's peak GPU memory on a named GPU, without a GPU.

    Args:
        what: a ``Scenario``; a preset, ``file.py:function`` or ``train.py`` name with the
            scenario's fields as keywords (``batch=8, seq=1024, gpu="rtx4090"``); or a step
            function, run with ``args`` and the keywords that are not predict's own.
        args: the step function's arguments (tracked as allocated before the first step).
        keywords: for a name, scenario fields by their flag's name or sections as mappings;
            for a step function, the target (``gpu``, ``alloc_conf``, ``context_overhead``,
            ``torch_version``, ``cuda_version``, ``cudnn_version``, or ``target`` a whole
            ``Target``), ``steps``, ``budget_bytes``, ``track``, ``description``, ``values``,
            ``compile``, and the step function's own keyword arguments. With a scenario or a
            name, ``cache=False`` records the step even where a cached recording of it is kept
            (``oomkit.scenario.recording_reuse``: a preset or a local ``--hf`` config, in a
            process that has not imported torch yet).

    Returns:
        The ``Prediction`` (its ``scenario`` set for the first two forms).

    Raises:
        ScenarioError: a field the scenario refuses (the flag and field named).
        OomkitError: see ``oomkit.scenario.predict`` and ``prediction.predictor.predict``.
    """
    if callable(what) and not isinstance(what, Scenario):
        return _predict_step(what, args, keywords)
    if args:
        raise ScenarioError(
            "positional arguments after the first go to a step function; with a scenario or a "
            "name, give fields as keywords (oomkit.predict('gpt2-124m', batch=8))"
        )
    cache = keywords.pop("cache", True)
    if not isinstance(cache, bool):
        raise ScenarioError(f"oomkit.predict(cache=...) takes True or False; got {cache!r}")
    from oomkit.scenario.recording_reuse import predict_with_cache

    scenario = _scenario(what, keywords, "predict")
    return predict_with_cache(scenario, cache=cache and scenario.run.cache)


def _predict_step(step_fn: Callable[..., Any], args: tuple[Any, ...], keywords: dict[str, Any]) -> Any:
    """A step function, on the target its keywords name (the scenario's target path)."""
    from oomkit.prediction.predictor import predict as predict_step
    from oomkit.scenario.machine import TargetSection
    from oomkit.scenario.target import installed_torch_version, target_of

    target = keywords.pop("target", None)
    named = {
        field: keywords.pop(key)
        for key, field in _TARGET_KEYWORDS.items()
        if key in keywords and keywords[key] is not None
    }
    for key in _TARGET_KEYWORDS:
        if key in keywords and keywords[key] is None:
            keywords.pop(key)
    if target is not None and named:
        raise ScenarioError(
            f"give the target once: target= or {', '.join(named)}, not both"
        )
    if target is None and not isinstance(named.get("gpu", "h100"), str):
        from oomkit.core.target import Target

        # A GpuSpec of one's own (a measured or custom device): the rest as the section has it.
        target = Target.resolve(
            named.pop("gpu"),
            alloc_conf=named.pop("alloc_conf", None),
            context_overhead_bytes=_size(named.pop("context_overhead_bytes", None)),
            torch_version=named.pop("torch_version", None) or installed_torch_version(),
            cudnn_version=named.pop("cudnn_version", None),
            cuda_version=named.pop("cuda_version", None),
        )
    if target is None:
        from pydantic import ValidationError

        from oomkit.scenario.files import validation_message

        try:
            section = TargetSection(**named)
        except ValidationError as exc:
            raise ScenarioError(validation_message(exc)) from None
        target = target_of(section, default_torch_version=installed_torch_version())
    own = {k: keywords.pop(k) for k in _STEP_KEYWORDS if k in keywords}
    prediction = predict_step(step_fn, *args, target=target, **own, **keywords)
    return _with_handler_said(prediction, step_fn)


def _with_handler_said(prediction: Any, step_fn: Callable[..., Any]) -> Any:
    """A step that does not fit and handles out-of-memory errors itself: say that its handler
    did not run. A step function is recorded without a limit, once per step; raising where the
    GPU would (as the CLI does for a builder) would leave the caller's model and optimizer
    half-run, with no builder to make them again."""
    if prediction.fits:
        return prediction
    from oomkit.prediction.tracing.batch_finders import catches_out_of_memory

    site = catches_out_of_memory(step_fn)
    if site is None:
        return prediction
    said = (
        f"the step handles out-of-memory errors ({site}), but a step function is recorded "
        f"without a memory limit, so its handler never ran: on {prediction.gpu.name} the "
        "request would raise and the step go on as the handler says, which this prediction "
        "does not show. Predict the function that builds the step instead "
        "(oomkit.predict('train.py:build'): built again after an uncaught OOM, the handler "
        "recorded as it runs on the GPU), or the whole script (oomkit.predict('train.py'))"
    )
    return dataclasses.replace(prediction, warnings=(*prediction.warnings, said))


def _size(value: Any) -> int | None:
    """A size keyword: bytes, or text with a unit (``"500MiB"``)."""
    if value is None or isinstance(value, int):
        return value
    from oomkit.units import parse_bytes

    return parse_bytes(value)


def fit(what: Any = None, /, **keywords: Any) -> FitAnswer:
    """The largest batch that fits (or, with ``smallest_gpu=True`` and ``batch``, the smallest
    GPU a batch fits on), without a GPU.

    Args:
        what: a ``Scenario``, or a preset / ``file.py:function`` name with the scenario's fields
            as keywords (``seq=1024, gpu="rtx4090", margin="1GiB"``).
        keywords: scenario fields by their flag's name, or sections as mappings.

    Returns:
        The ``FitAnswer`` (``answer.result.batch_size`` for a batch search).

    Raises:
        NoFeasibleBatchSizeError: not even batch 1 fits.
        ScenarioError, OomkitError: see ``oomkit.scenario.fit``.
    """
    from oomkit.scenario.fitting import fit as fit_scenario

    return fit_scenario(_scenario(what, keywords, "fit"))


def fit_alternatives(what: Any = None, /, **keywords: Any) -> tuple[FitAlternative, ...]:
    """When not even batch 1 fits: the largest batch with each change that applies
    (precision, activation checkpointing, optimizer, LoRA, QLoRA, then their combinations),
    each searched as ``fit`` with that change.

    Args:
        what: a ``Scenario``, or a preset / ``--hf`` name with the scenario's fields as
            keywords (``seq=4096, gpu="rtx4090"``), as for ``fit``.
        keywords: scenario fields by their flag's name, or sections as mappings.

    Returns:
        One ``FitAlternative`` per change searched (``batch_size`` ``None`` where not even
        batch 1 fits with it); empty for a ``file.py:function`` or an inference step.

    Raises:
        ScenarioError, OomkitError: see ``oomkit.scenario.fit``.
    """
    from oomkit.scenario.alternatives import fit_alternatives as alternatives_of

    return alternatives_of(_scenario(what, keywords, "fit"))

