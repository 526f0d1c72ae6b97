"""``predict`` and ``fit`` of a ``Scenario``: the library every way in calls.

The CLI, config files and the MCP tools build a ``Scenario`` and call these; they only parse
and render. ``predicting`` splits ``predict`` in two for a front end that shows progress:
building the step (what it is, how many steps) and recording it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from oomkit.prediction.own_alloc_conf import watching_own_setting, with_own_setting
from oomkit.prediction.workload import WorkloadSpec
from oomkit.scenario.model import Scenario
from oomkit.scenario.options import default_steps
from oomkit.scenario.target import installed_torch_version, target_of
from oomkit.scenario.workloads import (
    Workload,
    build_workload,
    user_errors,
    user_values,
)

if TYPE_CHECKING:
    from oomkit.core.target import Target
    from oomkit.prediction.predictor import Prediction
    from oomkit.prediction.tracing.script_run import ScriptProgress
    from oomkit.scenario.sharded import ShardedWorkload
    from oomkit.scenario.torchtitan_run import TorchtitanWorkload

__all__ = [
    "PredictRun",
    "ScriptWorkload",
    "StepObserver",
    "predict",
    "predicting",
    "require_torch_for",
    "scenario_target",
    "script_command",
    "tracing_jobs",
]


class StepObserver(Protocol):
    """What a front end's progress display offers the recording: a wrapped step (called once
    per step), for ``generate`` a count of the model's forwards (one per token), and for a
    whole script a callback with where its recording is (``ScriptProgress``)."""

    def wrap(self, step_fn: Callable[..., Any]) -> Callable[..., Any]: ...

    def count_forwards(self, model: Any) -> contextlib.AbstractContextManager[Any]: ...

    def script(self, progress: ScriptProgress) -> None: ...


def scenario_target(scenario: Scenario) -> Target:
    """The scenario's ``Target``, the installed torch's allocator by default (it records)."""
    return target_of(
        scenario.target, scenario.parallel, default_torch_version=installed_torch_version()
    )


def tracing_jobs(scenario: Scenario) -> int | None:
    """Processes that trace at once (``fit``; ``predict --lengths``' recordings): ``run.jobs``,
    or by default one per core (None) for oomkit's own builders (a preset, ``--hf``) on Linux,
    and 1 for the user's code (``file.py:function``, ``--eval``), whose builder may have
    effects outside its process, for ``--compile``, and off Linux (macOS's system libraries
    are not safe to fork with torch loaded: Python's multiprocessing docs)."""
    if scenario.run.jobs is not None:
        return scenario.run.jobs
    model = scenario.model
    users = model.eval_function is not None or model.kind in ("function", "script")
    compiled = scenario.step.compile
    return 1 if users or compiled or not sys.platform.startswith("linux") else None


def _with_scenario(prediction: Prediction, scenario: Scenario, notes: Mapping[str, str]) -> Any:
    """The prediction carrying its request (saved with ``--json``) and the defaults chosen."""
    from oomkit.scenario.files import scenario_to_data

    assumptions = {**prediction.assumptions, **notes}
    return dataclasses.replace(
        prediction, assumptions=assumptions, scenario=scenario_to_data(scenario)
    )


@dataclass
class ScriptWorkload:
    """A whole training script (``model.script``), run as ``python SCRIPT ARGS`` when recorded.

    Attributes:
        path: the script.
        argv: its own arguments (after ``--`` on the command line).
        spec: its workload record (kind ``script``).
        raised: always empty (the runner names the script's own failures itself).
        world_size: a torchrun script's ranks; ``None``: one GPU.
        rank: the rank recorded (with ``world_size``).
        all_ranks: each rank recorded, the peaking one's prediction returned.
    """

    path: str
    argv: tuple[str, ...]
    spec: WorkloadSpec
    raised: list[BaseException] = field(default_factory=list)
    world_size: int | None = None
    rank: int = 0
    all_ranks: bool = False

    @property
    def description(self) -> str:
        """The command line it runs."""
        return script_command(self.path, self.argv, self.world_size)


def script_command(path: str, argv: tuple[str, ...], world_size: int | None) -> str:
    """``python train.py ARGS``, or ``torchrun --nproc-per-node=N train.py ARGS``."""
    if world_size is not None:
        return " ".join(["torchrun", f"--nproc-per-node={world_size}", path, *argv])
    return " ".join(["python", path, *argv])


@dataclass
class PredictRun:
    """One scenario's step, built (one GPU) or ready to build on a fake process group.

    Attributes:
        scenario: the request.
        target: the machine it is predicted on.
        steps: steps recorded.
        workload: the built step (one GPU), or the sharded workload built while recording.
        notes: defaults chosen and other assumptions to add to the prediction.
        warnings: warnings to add to it (a setting of the caller's the user's code replaced).
    """

    scenario: Scenario
    target: Target
    steps: int
    workload: Workload | ShardedWorkload | ScriptWorkload | TorchtitanWorkload
    notes: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        """What is recorded ("" for a sharded step before it is built)."""
        return self.workload.description

    @property
    def new_tokens(self) -> int | None:
        """Tokens generated per step (``generate``), for a per-token progress count."""
        spec = self.workload.spec
        if spec is not None and spec.mode == "generate" and isinstance(self.workload, Workload):
            return spec.new_tokens if self.workload.track else None
        return None

    def layout_words(self) -> str | None:
        """The parallel layout in words (``"FSDP2 8"``); ``None`` on one GPU."""
        layout = self.target.parallel
        if layout is None:
            return None
        from oomkit.scenario.sharded import layout_words

        return layout_words(self.scenario, layout)

    def record(self, observer: StepObserver | None = None) -> Prediction:
        """Record the step and replay it on the target.

        Raises:
            UserCodeError: the user's step raised (its line named).
            UnsupportedOpError, DataDependentValueError: an op or a value read the recorder
                cannot follow.
        """
        from oomkit.scenario.torchtitan_run import TorchtitanWorkload

        parallel = self.scenario.parallel
        if parallel is not None and parallel.all_ranks and self.target.parallel is not None:
            from oomkit.scenario.ranks import with_rank_peaks

            # Each distinct rank predicted on its own (scenario/ranks.py); the peak's returned.
            return with_rank_peaks(
                self.scenario, self.target.parallel, lambda one: predict(one, observer)
            )
        name = self.scenario.model.name
        workload = self.workload
        # self.workload, read when an error arrives: a builder's step may be built again.
        with user_errors(lambda: (name, self.workload.raised)):
            if isinstance(workload, TorchtitanWorkload):
                prediction = workload.record(self.target, self.scenario.run.budget_bytes)
            elif isinstance(workload, ScriptWorkload):
                prediction = self._record_script(workload, observer)
            elif self.target.parallel is not None:
                prediction = self._record_sharded()
            else:
                prediction = self._record_one(observer)
        prediction = _with_scenario(prediction, self.scenario, self.notes)
        if self.warnings:
            prediction = dataclasses.replace(
                prediction, warnings=(*prediction.warnings, *self.warnings)
            )
        return prediction

    def _record_one(self, observer: StepObserver | None) -> Prediction:
        if self.scenario.model.kind != "function":
            return self._record_workload(observer)
        from oomkit.prediction.tracing.step_memory import ooms_raised

        # A builder's step may catch an out-of-memory error (@oomkit.resilient splitting its
        # batch): raised where the GPU would raise it, it goes on as there. Not caught: built
        # again and recorded without the limit, for the memory the step needs.
        try:
            with ooms_raised() as raised:
                prediction = self._record_workload(observer)
        except Exception as exc:
            if not (raised.count and _out_of_memory(exc)):
                raise
            # Built as the first time (its allocator variables set back: the target has them).
            with watching_own_setting():
                self.workload = build_workload(
                    self.scenario, self.scenario.step.batch, self.target.gpu, steps=self.steps
                )
            return self._record_workload(observer)
        if not raised.count:
            return prediction
        said = (
            f"the step caught {raised.count} out-of-memory error(s), raised where a request "
            f"did not fit on {self.target.gpu.name} as on the GPU, and went on: the prediction "
            "is of the steps as they went, their failed attempts included"
        )
        return dataclasses.replace(prediction, warnings=(*prediction.warnings, said))

    def _record_workload(self, observer: StepObserver | None) -> Prediction:
        from oomkit.prediction.predictor import predict as predict_step

        workload = self.workload
        assert isinstance(workload, Workload)
        step_fn = workload.step_fn if observer is None else observer.wrap(workload.step_fn)
        counting: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if observer is not None and self.new_tokens is not None:
            counting = observer.count_forwards(workload.track[0])
        with counting:
            return predict_step(
                step_fn,
                target=self.target,
                steps=self.steps,
                budget_bytes=self.scenario.run.budget_bytes,
                track=workload.track,
                description=workload.description,
                workload=workload.spec,
                compile=self.scenario.step.compile,
            )

    def _record_script(
        self, workload: ScriptWorkload, observer: StepObserver | None
    ) -> Prediction:
        from oomkit.prediction.scripts import predict_script

        each = workload.all_ranks and workload.world_size is not None
        script = None if observer is None else observer.script

        def one(rank: int) -> Prediction:
            progress: Callable[[ScriptProgress], None] | None = script
            if script is not None and each:  # the bar names the rank being recorded
                progress = _naming_rank(script, (rank, workload.world_size or 1))
            # The script's own torch.compile calls are recorded as compiled, as they run.
            return predict_script(
                workload.path,
                workload.argv,
                steps=self.steps,
                target=self.target,
                budget_bytes=self.scenario.run.budget_bytes,
                values=self.scenario.step.values,
                workload=workload.spec,
                progress=progress,
                world_size=workload.world_size,
                rank=rank,
            ).prediction

        if each and workload.world_size is not None:
            from oomkit.scenario.ranks import peak_of

            return peak_of(range(workload.world_size), one)
        return one(workload.rank)

    def _record_sharded(self) -> Prediction:
        from oomkit.prediction.predictor import predict_recording
        from oomkit.prediction.tracing.emulations import current_sdpa_settings
        from oomkit.scenario.sharded import ShardedWorkload, record_rank_0

        workload = self.workload
        layout = self.target.parallel
        assert isinstance(workload, ShardedWorkload) and layout is not None
        from oomkit.scenario.ranks import rank_of

        rank = rank_of(self.scenario)
        recording = record_rank_0(
            workload, layout, steps=self.steps, target=self.target, rank=rank
        )
        target = self.target
        if target.cudnn_version is None:
            # Not stated: the tracer used the settings in effect; the result names that version.
            cudnn = current_sdpa_settings().cudnn_version
            target = dataclasses.replace(target, cudnn_version=cudnn)
        self.notes.update({f"default {k}": v for k, v in workload.defaults.items()})
        return predict_recording(
            recording,
            target=target,
            budget_bytes=self.scenario.run.budget_bytes,
            description=workload.description,
            workload=workload.spec,
        )


def _naming_rank(
    script: Callable[[ScriptProgress], None], rank: tuple[int, int]
) -> Callable[[ScriptProgress], None]:
    """``script`` told which of the ranks each progress report is of (``--all-ranks``)."""

    def report(progress: ScriptProgress) -> None:
        script(dataclasses.replace(progress, rank=rank))

    return report


@contextlib.contextmanager
def predicting(scenario: Scenario) -> Iterator[PredictRun]:
    """Build the scenario's step and yield it, ready to ``record``; tensor values the user's
    code reads are followed from its import on until the block ends.

    Raises:
        OomkitError: the scenario names nothing to run, a ``lengths`` section (use
            ``oomkit.scenario.predict_lengths``), or a combination that cannot run.
        UserCodeError: the user's file or function cannot be loaded or called.
        TorchRequiredError: torch (or transformers for ``model.hf``) is not installed.
    """
    from oomkit.errors import OomkitError

    if scenario.torchtitan is not None:
        yield _torchtitan_run(scenario)
        return
    if scenario.lengths is not None:
        raise OomkitError(
            "a scenario with a lengths section predicts a whole run: use predict_lengths "
            "(oomkit predict --lengths FILE)"
        )
    if scenario.model.kind is None:
        raise OomkitError(
            "name what to predict: a preset (e.g. `oomkit predict gpt2-124m --gpu rtx4090`), "
            "path/to/file.py:function, path/to/train.py, or --hf NAME_OR_PATH."
        )
    target = scenario_target(scenario)
    require_torch_for(scenario, "predict")
    steps, steps_note = default_steps(scenario, "predict")
    warned: list[str] = []
    with user_values(scenario.step.values):
        workload: Workload | ShardedWorkload | ScriptWorkload
        notes: dict[str, str] = {}
        if scenario.model.script is not None:
            argv = tuple(scenario.model.script_args)
            if scenario.step.batch is not None:  # through the script's batch argument
                from oomkit.scenario.script_batch import batch_arg_of, script_argv

                name = batch_arg_of(scenario.model.script, argv, scenario.model.script_batch_arg)
                argv = script_argv(argv, name, scenario.step.batch)
            script = ScriptWorkload(
                scenario.model.script,
                argv,
                WorkloadSpec("script", scenario.model.script, steps=steps),
                world_size=scenario.model.script_world_size,
                rank=scenario.model.script_rank or 0,
                all_ranks=scenario.model.script_all_ranks,
            )
            workload = script
        elif target.parallel is not None:
            from oomkit.scenario.sharded import parallel_workload

            workload = parallel_workload(
                scenario, target.parallel, scenario.step.batch, target.gpu, steps=steps
            )
        else:
            with watching_own_setting() as own:
                workload = build_workload(scenario, scenario.step.batch, target.gpu, steps=steps)
            notes = {f"default {k}": v for k, v in workload.defaults.items()}
            notes.update(workload.trainer_notes)
            if own.changed:  # the module or builder set its own
                who = scenario.model.name or "the builder"
                target, assumption, warned = with_own_setting(target, own, who)
                if assumption is not None:
                    notes["allocator setting"] = assumption
        if steps_note is not None:
            notes["default steps"] = steps_note
        yield PredictRun(scenario, target, steps, workload, notes, tuple(warned))


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised from, a ``torch.OutOfMemoryError`` (the tracer names
    an op that failed: ``step_failure``)."""
    import torch

    seen: BaseException | None = exc
    chain: set[int] = set()
    while seen is not None and id(seen) not in chain:
        if isinstance(seen, torch.OutOfMemoryError):
            return True
        chain.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    return False


def _torchtitan_run(scenario: Scenario) -> PredictRun:
    """A ``--torchtitan`` job, ready to record (scenario/torchtitan_run.py)."""
    from oomkit.scenario.torchtitan_run import TorchtitanWorkload

    assert scenario.torchtitan is not None
    require_torch_for(scenario, "predict")
    steps, steps_note = default_steps(scenario, "predict")
    notes = {} if steps_note is None else {"default steps": steps_note}
    workload = TorchtitanWorkload.of(scenario.torchtitan, steps)
    return PredictRun(scenario, scenario_target(scenario), steps, workload, notes)


def predict(scenario: Scenario, observer: StepObserver | None = None) -> Prediction:
    """Predict the scenario's step: its peak allocated and reserved memory on its target.

    Args:
        scenario: what to predict (``Scenario``).
        observer: a progress display's hooks (``StepObserver``); ``None``: none.

    Returns:
        The ``Prediction``, carrying the scenario (``Prediction.scenario``).

    Raises:
        OomkitError: see ``predicting`` and ``PredictRun.record``.
    """
    with predicting(scenario) as run:
        return run.record(observer)


def require_torch_for(scenario: Scenario, command: str) -> None:
    """Import torch before building, or say how to install it (``TorchRequiredError``: exit 3
    from the CLI)."""
    from oomkit.scenario._torch import require_torch

    if scenario.model.hf is not None:
        # (transformers itself is imported by the builder, which says how to install it)
        require_torch(f"oomkit {command} --hf", extra="hf")
    else:
        require_torch(f"oomkit {command}")
