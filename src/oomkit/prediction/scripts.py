"""Predict a whole training script's peak GPU memory: ``python train.py ARGS``, without a GPU.

``predict_script("train.py", ["config/x.py", "--batch_size=8"],
target=Target.resolve("rtx4090"))`` runs the script as its ``__main__`` on one emulated GPU up to
its ``steps``-th optimizer step (``oomkit.prediction.tracing.script_run.record_script``), then
replays the recording through the target's caching allocator, as ``predict`` does for a step
function. The figure is the one the builder form of the same step gives (``file.py:function``
returning that step).

A script that sets ``PYTORCH_CUDA_ALLOC_CONF`` in ``os.environ`` itself runs with that
setting, and is predicted with it (``own_alloc_conf.py``).

This module never imports torch itself; ``predict_script`` imports the tracer when called.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from oomkit.core.target import Target
from oomkit.prediction.own_alloc_conf import watching_own_setting, with_own_setting
from oomkit.prediction.predictor import Prediction, predict_recording
from oomkit.prediction.workload import WorkloadSpec

if TYPE_CHECKING:  # oomkit.prediction.tracing imports torch
    from oomkit.prediction.tracing.script_run import ScriptProgress, ScriptRun

__all__ = ["ScriptPrediction", "predict_script"]


@dataclasses.dataclass(frozen=True)
class ScriptPrediction:
    """A script's prediction and the run that recorded it.

    Attributes:
        prediction: the peak figures, breakdown and warnings (the run's notes among them).
        run: the recording, the steps reached and the saves skipped
            (``tracing.script_run.ScriptRun``).
    """

    prediction: Prediction
    run: ScriptRun


def predict_script(
    path: str | os.PathLike[str],
    argv: Sequence[str] = (),
    *,
    steps: int = 3,
    cwd: str | os.PathLike[str] | None = None,
    target: Target | None = None,
    budget_bytes: int | None = None,
    values: Mapping[str, Any] | None = None,
    compile: bool = True,
    workload: WorkloadSpec | None = None,
    progress: Callable[[ScriptProgress], None] | None = None,
    world_size: int | None = None,
    rank: int = 0,
) -> ScriptPrediction:
    """Run ``path`` as ``python path *argv`` would on the target GPU, emulated, and predict it.

    Args:
        path: the training script.
        argv: its own arguments (``sys.argv[1:]`` as it sees them; the CLI's ``-- ARGS``).
        steps: optimizer steps to record (``--steps``; 3 shows the first step's optimizer state
            and the steady state).
        cwd: the working directory it runs in; ``None`` is the current one.
        target: the GPU, allocator setting and versions
            (``Target.resolve("rtx4090", alloc_conf=...)``); ``None`` is
            ``Target.resolve("h100")``: an H100, PyTorch's default allocator setting, the
            newest torch release.
        budget_bytes: a reserved-memory limit to check, in bytes.
        values: tensor values the script reads, by the line that reads them.
        compile: record the script's ``torch.compile`` calls as compiled (else eagerly, with a
            warning).
        workload: the request, carried into the prediction; ``None`` leaves it unset.
        progress: a progress display's callback (``record_script``'s ``progress``).
        world_size: a torchrun script's ranks: ``rank`` of a fake process group of that many
            is recorded (``record_script``'s ``world_size``); ``None``: one GPU.
        rank: the rank recorded, with ``world_size``.

    Returns:
        The prediction and the run.

    Raises:
        TorchRequiredError: torch is not installed.
        OomkitError: ``steps`` is not a whole number from 1 to ``MAX_RECORDED_STEPS``.
        UserCodeError: the script is missing, raises, exits before its steps (or with a
            non-zero code), ends without an optimizer step, or runs torchrun-style distributed
            code; the message names its line.
        UnsupportedOpError, DataDependentValueError: as ``predict``.
    """
    resolved = Target.resolve("h100") if target is None else target
    from oomkit.errors import TorchRequiredError

    try:
        from oomkit.prediction.tracing.emulations import current_sdpa_settings
        from oomkit.prediction.tracing.script_run import ScriptOutOfMemory, record_script
    except ImportError as exc:
        if "torch" not in str(exc):
            raise
        raise TorchRequiredError(
            "oomkit predict runs your script on the meta device and needs torch; install it "
            "with `pip install oomkit[torch]`"
        ) from exc
    recording_of = functools.partial(
        record_script, path, argv, steps=steps, cwd=cwd, target=resolved, values=values,
        compile=compile, progress=progress, world_size=world_size, rank=rank,
    )
    with watching_own_setting() as own:
        try:
            # Out-of-memory errors raised where the GPU would raise them: a script that catches
            # them (a batch finder) goes on as it would there.
            run = recording_of(ooms=True)
        except ScriptOutOfMemory:
            # Not caught: the whole run on a GPU without a limit, for the memory it needs.
            run = recording_of(ooms=False)
    traced, recording = resolved, run.recording
    if run.layout is not None and resolved.parallel is None:
        # NCCL's buffers for the communicator over the script's ranks (distributed_memory.py).
        traced = dataclasses.replace(traced, parallel=run.layout)
    if own.changed:
        traced, assumption, notes = with_own_setting(traced, own, "the script")
        said = {} if assumption is None else {"allocator setting": assumption}
        recording = dataclasses.replace(
            recording,
            warnings=(*recording.warnings, *notes),
            assumptions={**recording.assumptions, **said},
        )
    if traced.cudnn_version is None:
        # As predict: the tracer used the settings in effect; the result names that version.
        traced = dataclasses.replace(traced, cudnn_version=current_sdpa_settings().cudnn_version)
    prediction = predict_recording(
        recording,
        target=traced,
        budget_bytes=budget_bytes,
        description=run.description if world_size is None else (
            f"{run.description}, rank {rank} of {world_size}"
        ),
        workload=workload,
    )
    return ScriptPrediction(prediction, run)

