"""``fit`` of a ``Scenario``: the largest batch that fits, or the GPU a batch fits on.

Searches over batch size with the predictor (``oomkit.plan.batch_search.max_batch_size``):
doubling, then bisection, one trace per size. ``search.smallest_gpu`` with ``step.batch``
answers the reverse question (the smallest catalog GPU that batch fits on); with
``search.global_batch`` it tabulates GPU counts x catalog GPUs. A ``parallel`` layout searches
rank 0's per-rank batch; a ``lengths`` section the batch whose whole run fits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from oomkit.errors import NoFeasibleBatchSizeError, OomkitError, UserCodeError
from oomkit.plan.batch_probe import RecordingBuilder
from oomkit.prediction.own_alloc_conf import (
    OwnSetting,
    watching_own_setting,
    with_own_setting_said,
)
from oomkit.scenario.model import Scenario
from oomkit.scenario.options import default_steps
from oomkit.scenario.run import require_torch_for, scenario_target, tracing_jobs
from oomkit.scenario.workloads import (
    Workload,
    build_workload,
    user_errors,
    user_values,
    user_workload_spec,
)
from oomkit.units import format_bytes

if TYPE_CHECKING:
    from oomkit.core.target import ParallelLayout, Target
    from oomkit.scenario.sharded import ShardedWorkload

__all__ = ["FitAnswer", "FitKind", "check_fit", "fit", "per_rank_batch"]

FitKind = Literal["batch", "smallest_gpu", "gpu_count", "lengths"]
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class FitAnswer:
    """What ``fit`` found, with the question it answered.

    Attributes:
        kind: ``batch`` (``BatchSearchResult``), ``smallest_gpu`` (``SmallestGpuResult``),
            ``gpu_count`` (``GpuCountResult``) or ``lengths`` (``EnvelopeFit``).
        result: the plan layer's record of that kind.
        target: the machine searched for.
        per_rank: for a parallel layout, what the batch is (``per_rank_batch``).
        scenario: the request.
        batch_arg: for a whole script, the argument of its own that was varied
            (``--batch_size``: ``--batch-arg``, or the one its arguments named); else ``None``.
    """

    kind: FitKind
    result: Any
    target: Target
    scenario: Scenario
    per_rank: dict[str, Any] | None = None
    batch_arg: str | None = None

    @property
    def batch_size(self) -> int | None:
        """The largest batch that fits (of one step, or whose whole run fits with
        ``lengths``; per rank for a parallel layout); ``None`` for the other questions
        (``smallest_gpu``, ``gpu_count``), whose answers are in ``result``."""
        return self.result.batch_size if self.kind in ("batch", "lengths") else None

    @property
    def peak_reserved_bytes(self) -> int | None:
        """What that batch needs reserved (with ``lengths``: at the run's worst step);
        ``None`` where ``batch_size`` is."""
        if self.kind == "batch":
            return int(self.result.peak_reserved_bytes)
        if self.kind == "lengths":
            return int(self.result.envelope.worst_peak_reserved_bytes)
        return None

    def __repr__(self) -> str:
        """The answer in one line, as ``Prediction``'s (the fields are attributes):
        ``<FitAnswer: batch 40 on RTX 4090, peak reserved 23.01 GiB of 23.57 GiB usable (margin
        482.00 MiB)>``."""
        result = self.result
        if self.kind == "smallest_gpu":
            said = (
                f"smallest GPU {result.smallest.name}" if result.smallest is not None
                else "no GPU checked fits"
            )
        elif self.kind == "gpu_count":
            said = f"global batch {result.global_batch}: " + (
                f"{result.least_memory[0]} x {result.least_memory[1].name}"
                if result.least_memory is not None else "no GPU count fits"
            )
        elif self.batch_size is None or self.peak_reserved_bytes is None:
            said = f"no batch fits on {self.target.gpu.name}"
        else:
            margin = getattr(result, "margin_bytes", None)
            said = (
                f"batch {self.batch_size} on {self.target.gpu.name}, peak reserved "
                f"{format_bytes(self.peak_reserved_bytes)} of "
                f"{format_bytes(self.target.usable_bytes)} usable"
                + (f" (margin {format_bytes(margin)})" if margin else "")
            )
        return f"<FitAnswer: {said}>"


class _Builders:
    """Batch size -> step for the scenario's model and its eval function, keeping what the
    user's code raised."""

    def __init__(self, scenario: Scenario, target: Target, steps: int) -> None:
        self.scenario = scenario
        self._target = target
        self._steps = steps
        # The last step built (it is traced before the next is built): its name, and the
        # workload whose step appends what it raises to its ``raised``.
        self.name: str | None = scenario.model.name
        self._built: Workload | ShardedWorkload | None = None
        # What the user's code did to the allocator variables (own_alloc_conf.py); None: not
        # built yet, or it set none.
        self.own_alloc_conf: OwnSetting | None = None

    @property
    def raised(self) -> list[BaseException]:
        """What the last step built raised from the user's code."""
        return [] if self._built is None else self._built.raised

    def _keep(self, name: str | None, workload: Any) -> Any:
        self.name, self._built = name, workload
        return workload

    def _building(self, build: Callable[[], Any]) -> Any:
        """``build()``, with the allocator variables it set noted and set back: the module
        of a file.py:function is run again at each build, and this process goes on."""
        with watching_own_setting() as own:
            built = build()
        if own.changed:
            self.own_alloc_conf = own
        return built

    def use_own_setting(self) -> tuple[Target, list[str]]:
        """The target with the allocator setting a file.py:function sets itself, found by
        building its first batch, and what to say about it (``own_alloc_conf.py``)."""
        self.train(self.scenario.step.batch or 1)
        if self.own_alloc_conf is None:
            return self._target, []
        who = self.scenario.model.name or "the builder"
        self._target, said = with_own_setting_said(self._target, self.own_alloc_conf, who)
        return self._target, said

    def parallel(self, layout: ParallelLayout, batch_size: int) -> ShardedWorkload:
        """The model under ``layout`` at the per-rank ``batch_size`` (as predict records it)."""
        from oomkit.scenario.sharded import parallel_workload

        workload = parallel_workload(
            self.scenario, layout, batch_size, self._target.gpu, steps=self._steps
        )
        return self._keep(self.scenario.model.name, workload)

    def train(self, batch_size: int) -> Workload:
        workload = self._building(
            lambda: build_workload(self.scenario, batch_size, self._target.gpu, steps=self._steps)
        )
        _check_takes_batch(self.scenario.model.function, workload)
        return self._keep(self.scenario.model.name, workload)

    def evaluation(self, batch_size: int) -> Workload:
        from oomkit.scenario.user_function import load_user_step

        name = self.scenario.model.eval_function
        assert name is not None
        step = self.scenario.step
        user = self._building(lambda: load_user_step(
            name, batch_size=batch_size, seq_len=step.seq, image_size=step.image_size,
            gpu=self._target.gpu,
        ))
        spec = user_workload_spec(name, user, 1)
        workload = Workload(user.step_fn, user.track, user.description, user.raised, spec)
        _check_takes_batch(name, workload)
        return self._keep(name, workload)


def _check_takes_batch(function: str | None, workload: Workload | ShardedWorkload) -> None:
    # A function that declares no batch_size was called without one.
    takes_batch = workload.spec is not None and workload.spec.batch_size is not None
    if function is not None and not takes_batch:
        raise UserCodeError(
            f"{function}: the function has no batch_size parameter, so oomkit fit cannot vary "
            "the batch. Add one: def build(batch_size, seq_len=1024): ..."
        )


def check_fit(scenario: Scenario) -> Target:
    """What ``fit`` refuses before any model is built, and torch; returns the target searched.

    Raises:
        OomkitError: a combination of the search's fields that cannot run.
        TorchRequiredError: torch is not installed.
    """
    target = scenario_target(scenario)
    _check(scenario, target)
    require_torch_for(scenario, "fit")
    return target


def _check(scenario: Scenario, target: Target) -> None:
    """What fit refuses before any model is built.

    Raises:
        OomkitError: a combination of the search's fields that cannot run.
    """
    search, step, model = scenario.search, scenario.step, scenario.model
    if model.kind is None:
        raise OomkitError(
            "name what to fit: a preset (e.g. `oomkit fit gpt2-124m --gpu rtx4090`), "
            "path/to/file.py:function, or --hf NAME_OR_PATH."
        )
    if model.kind == "script":
        _check_script(scenario)
    if step.mode == "generate":
        raise OomkitError("fit searches train or inference steps; --mode generate is predict's")
    if search.global_batch is not None:
        if not search.smallest_gpu or target.parallel is not None or step.batch is not None:
            raise OomkitError(
                "--global-batch goes with --smallest-gpu alone (it tries GPU counts itself, "
                "with per-rank batch B / N): e.g. `oomkit fit llama3-8b --smallest-gpu "
                "--global-batch 64`; drop --fsdp/--tp/--dp and --batch"
            )
        return
    if target.parallel is not None and (
        search.smallest_gpu or model.eval_function is not None or scenario.lengths is not None
    ):
        raise OomkitError(
            "--fsdp/--tp/--dp search rank 0's per-rank batch of one --seq: for how many GPUs of "
            "which kind use --smallest-gpu --global-batch B (without --fsdp/--tp/--dp); --eval "
            "is not sharded, and --lengths is not searched sharded yet (give the longest length "
            "as --seq)"
        )
    if search.smallest_gpu and step.batch is None:
        raise OomkitError(
            "--smallest-gpu checks one batch size: give it with --batch N, e.g. "
            "`oomkit fit gpt2-124m --batch 16 --smallest-gpu`."
        )
    if not search.smallest_gpu and step.batch is not None and step.batch > search.max_batch:
        raise OomkitError(
            f"--batch {step.batch} (the first batch tried) is above --max-batch "
            f"{search.max_batch}; lower --batch or raise --max-batch."
        )
    if scenario.lengths is not None and (search.smallest_gpu or model.eval_function is not None):
        raise OomkitError("--lengths searches the batch of one run: drop --smallest-gpu/--eval")


def _check_script(scenario: Scenario) -> None:
    """What fit refuses of a whole script (``script_batch.py``)."""
    from oomkit.scenario.script_batch import batch_arg_of

    model, search = scenario.model, scenario.search
    assert model.script is not None
    batch_arg_of(model.script, model.script_args, model.script_batch_arg)
    if search.global_batch is not None or scenario.lengths is not None:
        raise OomkitError(
            "a script's batch is searched on one GPU (or per rank with --world-size), or "
            "checked on each GPU with --smallest-gpu --batch N: --global-batch and --lengths "
            "vary what the script sets itself"
        )
    if model.script_all_ranks:
        raise OomkitError(
            "fit searches one rank's batch of a torchrun script: drop model.script_all_ranks "
            "and give the rank (model.script_rank; `oomkit predict train.py --world-size N "
            "--all-ranks` names the one that peaks)"
        )


def fit(
    scenario: Scenario,
    *,
    progress: Progress | None = None,
    lines: Callable[[str], None] | None = None,
) -> FitAnswer:
    """Search the scenario's batch (or GPU) by prediction, without a GPU.

    Args:
        scenario: the request; its ``search`` section shapes the question.
        progress: called as ``progress(done, total)`` as sizes (GPUs, counts) are traced.
        lines: called with a line of progress text (``--lengths``' recordings).

    Returns:
        The answer (``FitAnswer``).

    Raises:
        NoFeasibleBatchSizeError: not even batch 1 fits (its figures in the error).
        OomkitError: a combination that cannot run; see also ``oomkit.scenario.predict``.
    """
    target = check_fit(scenario)
    try:
        return _fit(scenario, target, progress, lines)
    except NoFeasibleBatchSizeError as exc:
        if scenario.model.kind not in ("script", "function"):
            raise
        from oomkit.plan.batch_advice import advice_in_code

        # Code run as written takes no --precision/--checkpointing: the changes said as code.
        raise advice_in_code(exc, target.gpu.compute_capability) from None


def _fit(
    scenario: Scenario,
    target: Target,
    progress: Progress | None,
    lines: Callable[[str], None] | None,
) -> FitAnswer:
    steps, _ = default_steps(scenario, "fit")
    if scenario.lengths is None:
        scenario = scenario.model_copy(
            update={"run": scenario.run.model_copy(update={"steps": steps})}
        )
    if scenario.model.kind == "script":
        return _fit_script(scenario, target, steps, progress)
    builders = _Builders(scenario, target, steps)
    own: list[str] = []
    if scenario.model.kind == "function" and scenario.search.global_batch is None:
        with user_errors(lambda: (builders.name, builders.raised)):
            target, own = builders.use_own_setting()
    train: Any = builders.train
    eval_step: Any = None if scenario.model.eval_function is None else builders.evaluation
    if scenario.step.compile:  # every probe recorded with its torch.compile regions compiled
        train = _compiled_recorder(train)
        eval_step = None if eval_step is None else _compiled_recorder(eval_step)
    jobs = tracing_jobs(scenario)
    with user_errors(lambda: (builders.name, builders.raised)), user_values(scenario.step.values):
        if scenario.lengths is not None:
            from oomkit.scenario.lengths import fit_lengths

            found = fit_lengths(scenario, target, builders.raised, progress=lines, jobs=jobs)
            return FitAnswer("lengths", found, target, scenario)
        if scenario.search.global_batch is not None:
            return FitAnswer(
                "gpu_count", _gpu_counts(scenario, target, builders, progress, jobs), target,
                scenario,
            )
        if scenario.search.smallest_gpu:
            result = _smallest(scenario, target, builders, train, eval_step, progress, jobs)
            if own:
                result = replace(result, warnings=(*own, *result.warnings))
            return FitAnswer("smallest_gpu", result, target, scenario)
        if target.parallel is not None:
            train, eval_step = _parallel_recorder(target.parallel, builders), None
        result = _search(scenario, target, train, eval_step, progress, jobs)
        if own:
            result = replace(result, warnings=(*own, *result.warnings))
        per_rank = None
        if target.parallel is not None:
            per_rank = per_rank_batch(scenario, target.parallel, result.batch_size)
        return FitAnswer("batch", result, target, scenario, per_rank)


def _fit_script(
    scenario: Scenario, target: Target, steps: int, progress: Progress | None
) -> FitAnswer:
    """A whole script's batch searched through its batch argument: the script is recorded at
    each batch tried, as ``oomkit predict train.py -- ARGS`` records it."""
    from oomkit.plan.batch_search import max_batch_warning, smallest_gpu
    from oomkit.scenario.script_batch import BatchSaturated, ScriptBatches, batch_in_argv

    batches = ScriptBatches(scenario, steps)
    search = scenario.search
    # The search starts at --batch, else at the batch the script's arguments give.
    start = scenario.step.batch or batch_in_argv(scenario.model.script_args, batches.name) or 1
    if not search.smallest_gpu:
        start = min(start, search.max_batch)
    target, own = batches.first(start, target)
    jobs = tracing_jobs(scenario)
    if search.smallest_gpu:
        result = smallest_gpu(
            batches.builder(), start, candidates=_candidates(scenario), target=target,
            margin_bytes=search.margin_bytes, steps=steps, jobs=jobs,
        )
        kind: FitKind = "smallest_gpu"
    else:
        try:
            result = _search(scenario, target, batches.builder(), None, progress, jobs,
                             start=start)
        except BatchSaturated as saturated:
            # Every batch from `at` up needs what `at` needs: searched again up to it, from it
            # (one recording when it fits; bisected below it when not).
            at = min(saturated.at, search.max_batch)
            capped = scenario.model_copy(update={"search": search.model_copy(
                update={"max_batch": at})})
            result = _search(capped, target, batches.builder(), None, progress, jobs, start=at)
            if result.batch_size == at:  # not "raise --max-batch": larger ones are the same
                kept = [w for w in result.warnings if w != max_batch_warning(at)]
                result = replace(result, memory_stops_growing_at=at,
                                 warnings=(f"{saturated}; searched again up to {at}", *kept))
        kind = "batch"
    if own:
        result = replace(result, warnings=(*own, *result.warnings))
    return FitAnswer(kind, result, target, scenario, batch_arg=batches.name)


def _compiled_recorder(builder: Any) -> RecordingBuilder:
    """``builder`` (batch size -> ``Workload``) as a ``RecordingBuilder`` whose recordings run
    ``torch.compile`` regions compiled (``trace_step(compile=True)``, as ``predict --compile``):
    each probe is built, then recorded with dynamo's caches reset (``compiled_code_recorded``),
    so each batch size gets its own compile, as a run at that batch does."""

    def record(batch_size: int, target: Target, steps: int) -> tuple[Any, str]:
        import torch

        from oomkit.prediction.tracing import trace_step

        meta = torch.device("meta")
        with meta:
            workload = builder(batch_size)
        step_fn = workload.step_fn

        def step(*_tracked: Any) -> Any:
            with meta:  # as record_step runs a built step
                return step_fn()

        recording = trace_step(step, *workload.track, steps=steps, target=target, compile=True)
        return recording, workload.description

    return RecordingBuilder(record)


def _parallel_recorder(layout: ParallelLayout, builders: _Builders) -> RecordingBuilder:
    """(per-rank batch, target, steps) -> rank 0's recording of the model under ``layout``
    (FSDP2, DDP, HSDP, TP and their products) on a fake process group, as ``predict`` records
    it, and its description."""

    def record(batch_size: int, target: Target, steps: int) -> tuple[Any, str]:
        from oomkit.scenario.sharded import record_rank_0

        workload = builders.parallel(layout, batch_size)
        recording = record_rank_0(workload, layout, steps=steps, target=target)
        # A file.py:function's spec is known once it was called on the mesh.
        _check_takes_batch(builders.scenario.model.function, workload)
        return recording, workload.description

    return RecordingBuilder(record)


def _candidates(scenario: Scenario) -> tuple[Any, ...]:
    from oomkit.core.gpus import CATALOG

    overhead = scenario.target.context_overhead_bytes
    if overhead is None:
        return CATALOG
    return tuple(replace(g, context_overhead_bytes=overhead) for g in CATALOG)


def _gpu_counts(
    scenario: Scenario, target: Target, builders: _Builders, progress: Progress | None,
    jobs: int | None,
) -> Any:
    """``--smallest-gpu --global-batch B``: GPU counts x catalog GPUs, one recording per count."""
    from oomkit.core.target import ParallelLayout
    from oomkit.plan.batch_probe import record_step
    from oomkit.plan.smallest_gpu import smallest_gpu_count

    search = scenario.search
    steps = scenario.run.steps
    assert search.global_batch is not None and steps is not None

    def record(count: int, per_rank: int, on: Target) -> tuple[Any, str]:
        if count == 1:  # one GPU trains without FSDP
            if scenario.step.compile:  # compiled as predict --compile records it
                return _compiled_recorder(builders.train).record(per_rank, on, steps)
            return record_step(builders.train, "train step", per_rank, target=on, steps=steps)
        # Above 1: FSDP2, each block compiled with --compile (models/compiled_blocks.py).
        return _parallel_recorder(ParallelLayout(fsdp=count), builders).record(
            per_rank, on, steps
        )

    return smallest_gpu_count(
        record,
        search.global_batch,
        max_gpus=search.max_gpus,
        candidates=_candidates(scenario),
        margin_bytes=search.margin_bytes,
        target=target,
        progress=progress,
        jobs=jobs,
    )


def _search(
    scenario: Scenario, target: Target, train: Any, eval_step: Any, progress: Progress | None,
    jobs: int | None, *, start: int | None = None,
) -> Any:
    from oomkit.plan.batch_search import max_batch_size

    steps = scenario.run.steps
    assert steps is not None
    return max_batch_size(
        train,
        target=target,
        margin_bytes=scenario.search.margin_bytes,
        steps=steps,
        eval_step=eval_step,
        start_batch=start or scenario.step.batch or 1,
        max_batch=scenario.search.max_batch,
        progress=progress,
        jobs=jobs,
        multiple_of=scenario.search.multiple_of,
        power_of_two=scenario.search.power_of_two,
        allow_retries=scenario.search.allow_retries,
    )


def _smallest(
    scenario: Scenario, target: Target, builders: _Builders, train: Any, eval_step: Any,
    progress: Progress | None, jobs: int | None,
) -> Any:
    from oomkit.plan.batch_search import smallest_gpu

    candidates = _candidates(scenario)
    # The step is traced once per compute capability (kernels differ by architecture).
    traces = len({g.kernel_compute_capability for g in candidates})
    built = 0

    def counted(batch_size: int) -> Workload:
        nonlocal built
        built += 1
        if progress is not None:
            progress(built, max(built, traces))
        return builders.train(batch_size)

    steps = scenario.run.steps
    assert steps is not None and scenario.step.batch is not None
    return smallest_gpu(
        _compiled_recorder(counted) if scenario.step.compile else counted,
        scenario.step.batch,
        candidates=candidates,
        target=target,
        margin_bytes=scenario.search.margin_bytes,
        steps=steps,
        eval_step=eval_step,
        jobs=jobs,
    )


def per_rank_batch(scenario: Scenario, layout: ParallelLayout, batch_size: int) -> dict[str, Any]:
    """What a sharded search's batch is: rank 0's per-rank (local) batch under ``layout``.

    The global batch is the per-rank batch times the data-parallel ranks, the DDP (or HSDP)
    replicas times the FSDP2 shards; the TP ranks of a group read one batch (torchtitan
    docs/performance.md: "global batch size = local batch size 2 * number of FSDP ranks").
    """
    from oomkit.scenario.sharded import layout_words

    data_ranks = layout.dp * layout.fsdp
    return {
        "layout": layout_words(scenario, layout),
        "fsdp": layout.fsdp,
        "tp": layout.tp,
        "dp": layout.dp,
        "world_size": layout.world_size,
        "rank": 0,
        "batch_is_per_rank": True,
        "data_parallel_ranks": data_ranks,
        "global_batch_size": batch_size * data_ranks,
    }

