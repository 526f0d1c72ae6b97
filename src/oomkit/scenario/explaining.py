"""``oomkit.explain``: why memory ran out, from an OOM message, a snapshot or a prediction.

One call for every kind of evidence a Python user holds:

- the error text (``str(exc)`` of a ``torch.OutOfMemoryError``, or a log);
- a snapshot file (``torch.cuda.memory._dump_snapshot``) or an oomkit trace;
- a saved prediction (``oomkit predict --json``): re-predicted from the ``Scenario`` it carries,
  so the diagnosis reads the fresh record, never the saved report's fields;
- a ``Scenario`` (predicted, then explained) or a ``Prediction``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomkit.errors import OomkitError, PredictionFormatError
from oomkit.scenario.model import Scenario

if TYPE_CHECKING:
    from oomkit.core.gpus import GpuSpec
    from oomkit.diagnose.diagnosis import Diagnosis

__all__ = ["explain", "explain_saved"]


def explain(
    source: Any,
    *,
    gpu: str | GpuSpec | None = None,
    measure: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Diagnosis:
    """Explain an out-of-memory error: its cause, the evidence and ranked remedies.

    Args:
        source: the OOM text; a path (``str`` or ``Path``) to a snapshot, a log or a saved
            prediction; a saved prediction's data (``dict``); a ``Scenario``; or a
            ``Prediction``.
        gpu: the GPU the run used (a catalog name, a size or a ``GpuSpec``), where the evidence
            does not say it (an OOM message); ``None``: matched from the message's total.
        measure: re-predict each remedy of a prediction to measure it (a few seconds each).
        progress: called as ``progress(done, total)`` while measuring.

    Returns:
        The ``Diagnosis``.

    Raises:
        OomTextError: no out-of-memory message in the text.
        SnapshotFormatError: a file that is not a snapshot.
        PredictionFormatError: a prediction that fits (nothing to explain).
    """
    spec = _gpu(gpu)
    if isinstance(source, Scenario):
        from oomkit.scenario.run import predict

        return _explain_prediction(predict(source), measure, progress, source)
    if _is_prediction_record(source):
        return _explain_prediction(source, measure, progress)
    if isinstance(source, Mapping):
        return explain_saved(source, measure=measure, progress=progress)
    if isinstance(source, Path) or (isinstance(source, str) and _is_file(source)):
        return _explain_file(Path(source), spec, measure, progress)
    if isinstance(source, str):
        return _explain_text(source, spec)
    raise OomkitError(
        f"oomkit.explain() takes OOM text, a file path, a saved prediction, a Scenario or a "
        f"Prediction; got {type(source).__name__}"
    )


def _gpu(gpu: Any) -> Any:
    if gpu is None or not isinstance(gpu, str):
        return gpu
    from oomkit.core.target import Target

    return Target.resolve(gpu).gpu  # the one target path, as --gpu


def _is_file(text: str) -> bool:
    try:
        return len(text) < 4096 and Path(text).is_file()
    except (OSError, ValueError):
        return False


def _is_prediction_record(source: object) -> bool:
    from oomkit.prediction.predictor import Prediction

    return isinstance(source, Prediction)


def _explain_text(text: str, gpu: Any) -> Diagnosis:
    from oomkit.diagnose.diagnosis import diagnose_oom_text
    from oomkit.diagnose.oom_text import find_oom_texts, parse_oom_text
    from oomkit.diagnose.oom_traceback import find_oom_location

    found = find_oom_texts(text)
    parsed = found[0] if found else parse_oom_text(text)  # raises: none found
    return diagnose_oom_text(parsed, gpu, location=find_oom_location(text))


def _explain_file(path: Path, gpu: Any, measure: bool, progress: Any) -> Diagnosis:
    from oomkit._files import input_file_error, refuse_special_file
    from oomkit.core.snapshot import looks_like_pickle

    refuse_special_file(path)
    try:
        with path.open("rb") as head:
            magic = head.read(8)
        if looks_like_pickle(magic):
            from oomkit.core.snapshot import load_snapshot
            from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot

            return diagnose_snapshot(load_snapshot(path), gpu=gpu)
        raw = path.read_bytes()
    except OSError as exc:
        raise input_file_error(path, exc) from None
    from oomkit.diagnose.oom_text import decode_log

    text = decode_log(raw)
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            data = None
        if isinstance(data, Mapping):
            return explain_saved(data, measure=measure, progress=progress)
    return _explain_text(text, gpu)


def explain_saved(
    data: Mapping[str, Any],
    *,
    measure: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Diagnosis:
    """A saved prediction (``oomkit predict --json``): re-predicted from the scenario it carries
    and the fresh record diagnosed; saves without one are read as they were saved (the
    documented fallback, ``diagnose_prediction``).

    Raises:
        ScenarioError: the carried scenario is not a valid one.
        PredictionFormatError: the re-prediction fits (nothing to explain).
    """
    from oomkit.diagnose.prediction_diagnosis import diagnose_prediction

    saved = data.get("scenario")
    if isinstance(saved, Mapping):
        from oomkit.scenario.files import scenario_from_data
        from oomkit.scenario.run import predict

        scenario = scenario_from_data(saved, source="the saved prediction's scenario")
        return _explain_prediction(predict(scenario), measure, progress, scenario)
    return diagnose_prediction(data, measure=measure, progress=progress)


def _explain_prediction(
    prediction: Any, measure: bool, progress: Any, scenario: Scenario | None = None
) -> Diagnosis:
    """The diagnosis of ``prediction``; of a whole script's (``scenario``), its own batch
    argument halved is measured by running the script again, as ``oomkit predict`` does."""
    from oomkit.diagnose.prediction_diagnosis import diagnose_predicted

    if prediction.oom is None:
        raise PredictionFormatError(
            "the prediction fits: there is no OOM to explain. Explain the error text or a "
            "snapshot of a run that failed instead"
        )
    measured = None
    if scenario is not None and scenario.model.script is not None:

        def measured(bar: Callable[[int, int], None] | None) -> tuple[list[Any], list[str]]:
            from oomkit.scenario.run import predict
            from oomkit.scenario.script_remedies import script_batch_remedy

            remedy = script_batch_remedy(scenario, prediction, predict, bar)
            return ([] if remedy is None else [remedy]), []

    return diagnose_predicted(
        prediction, measure=measure, progress=progress, measured_remedies=measured
    )
