"""Layout planning: which GPU kind, count and layout is the cheapest that fits a training job.

``plan(PlanRequest(...))`` enumerates the layouts that divide a global batch (FSDP, HSDP, DDP,
tensor, pipeline and context parallelism for the Llama presets; micro-batch and accumulation; activation
checkpointing; precision) on each GPU kind, prunes those whose model state alone (parameters,
gradients and optimizer states per rank) exceeds a GPU's usable memory, and predicts the rest
per rank with the multi-GPU path (one ``Scenario`` each, ``oomkit.scenario.predict``), on an
``Executor`` (this machine's processes, or a Ray cluster). The result is a ranked ``Plan`` of
plain records; the candidates' scenarios are data (``scenario_to_data``), so the winner is a
``--config`` file for ``oomkit predict``.

Pipeline layouts (``pp`` with a schedule) are predicted at their worst stage (``all_ranks``);
context-parallel layouts (``cp``) split the sequence, with FSDP2 over the other ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from oomkit.errors import OomkitError
from oomkit.executors import Executor, LocalPoolExecutor

__all__ = [
    "Candidate",
    "Layout",
    "Plan",
    "PlanRequest",
    "enumerate_layouts",
    "plan",
    "plan_to_data",
    "predict_candidate",
]

Checkpointing = Literal["none", "selective-op", "full"]
PlanPrecision = Literal["bf16-mixed", "bf16"]
PipelineSchedule = Literal["1f1b", "interleaved-1f1b", "gpipe"]
Progress = Callable[[int, int], None]

# Recomputation costs time: with the same price, less of it ranks first.
_CHECKPOINT_ORDER = {"none": 0, "selective-op": 1, "full": 2}
# torchtitan keeps tensor parallelism inside a node (its all-reduces per block need NVLink):
# torchtitan/docs/composability.md and its Llama 3 405B config use tp 8 at most.
_MAX_TP = 8
# HSDP shards within a group (a node, as torchtitan's data_parallel_shard_degree) and
# replicates across groups; groups of 2, 4 or 8 GPUs.
_HSDP_SHARD_SIZES = (2, 4, 8)
NOT_MODELLED = (
    "pipeline (PP, Llama presets with untied embeddings) and context parallel (CP, Llama "
    "presets, with FSDP only) layouts are modelled; PP x CP, CP x TP and HSDP x CP are not "
    "enumerated; pipelined layouts are predicted at their worst stage"
)
# Context-parallel degrees tried: torchtitan's Llama 3.1 runs use cp 2 to 8 for long sequences.
_CP_DEGREES = (2, 4, 8)
# Pipeline degrees tried: torchtitan's Llama 3.1 405B config pipelines over 8 stages at most
# with tp 8 (torchtitan/models/llama3/config_registry.py); more stages than that would leave
# the 8B / 70B presets a block or two per stage.
_MAX_PP = 8


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: a preset trained at a global batch on some GPU kinds.

    Attributes:
        preset: a model preset, e.g. ``"llama3-8b"``.
        global_batch: sequences per optimizer step, over every data-parallel rank.
        seq: tokens per sequence.
        gpus: GPU kinds to consider (catalog names, e.g. ``("h100", "a100-80gb")``).
        max_gpus: the most GPUs of a kind a layout may use (counts are powers of two).
        prices: dollars per GPU-hour by GPU kind; ranks by the layout's $/hour where given.
        checkpointing: activation checkpointing policies to consider.
        precisions: precisions to consider (``bf16-mixed``: fp32 master weights; ``bf16``).
        max_micro_batch: the largest micro-batch per rank (None: the whole per-rank batch).
        margin_bytes: headroom a layout must keep to count as fitting with margin.
        pp_schedules: pipeline schedules to consider for pipelined layouts (none: no PP).
    """

    preset: str
    global_batch: int
    seq: int
    gpus: tuple[str, ...]
    max_gpus: int = 512
    prices: Mapping[str, float] = field(default_factory=dict)
    checkpointing: tuple[Checkpointing, ...] = ("none", "selective-op", "full")
    precisions: tuple[PlanPrecision, ...] = ("bf16-mixed", "bf16")
    max_micro_batch: int | None = None
    margin_bytes: int = 0
    pp_schedules: tuple[PipelineSchedule, ...] = ("1f1b", "interleaved-1f1b")

    def __post_init__(self) -> None:
        for name in ("global_batch", "seq", "max_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OomkitError(f"plan: {name} must be a positive int; got {value!r}")
        if self.max_micro_batch is not None and self.max_micro_batch < 1:
            raise OomkitError(f"plan: max_micro_batch must be >= 1; got {self.max_micro_batch}")
        if not self.gpus:
            raise OomkitError("plan: name at least one GPU kind, e.g. --gpus h100,a100-80gb")
        twice = sorted({kind for kind in self.gpus if self.gpus.count(kind) > 1})
        if twice:
            raise OomkitError(
                f"plan: {', '.join(twice)} named more than once in --gpus; name each kind once"
            )
        if not self.checkpointing or not self.precisions:
            raise OomkitError("plan: give at least one checkpointing policy and one precision")
        unknown = set(self.prices) - set(self.gpus)
        if unknown:
            raise OomkitError(
                f"plan: prices given for GPU kinds not planned: {', '.join(sorted(unknown))}; "
                f"price only kinds of --gpus ({', '.join(self.gpus)})"
            )
        bad = {kind: p for kind, p in self.prices.items() if not (math.isfinite(p) and p >= 0)}
        if bad:
            shown = ", ".join(f"{kind}={p}" for kind, p in sorted(bad.items()))
            raise OomkitError(
                f"plan: a price per GPU-hour is a finite number >= 0; got {shown}"
            )
        if self.margin_bytes < 0:
            raise OomkitError(f"plan: margin_bytes must be >= 0; got {self.margin_bytes}")


@dataclass(frozen=True)
class Layout:
    """One way to run the job: GPU kind and count, degrees, micro-batch, AC, precision.

    ``fsdp`` shards over that many ranks (with ``dp``: HSDP, ``dp`` replicas of ``fsdp``-way
    shards; ``dp`` alone: DDP); ``tp`` splits each block over that many GPUs; ``pp`` splits
    the blocks into that many stages, run by ``pp_schedule`` with ``grad_accum`` micro-batches
    of ``micro_batch`` (the schedule's micro-batches; no accumulation on top). A single GPU
    has all degrees ``None``. ``gpus`` = (fsdp or 1) x (dp or 1) x (tp or 1) x (pp or 1).
    """

    gpu: str
    gpus: int
    fsdp: int | None
    dp: int | None
    tp: int | None
    micro_batch: int
    grad_accum: int
    checkpointing: Checkpointing
    precision: PlanPrecision
    pp: int | None = None
    pp_schedule: PipelineSchedule | None = None
    cp: int | None = None

    @property
    def strategy(self) -> str:
        """``single``, ``fsdp``, ``hsdp``, ``ddp`` or ``tp``, joined with ``+tp``, then ``+pp``
        or ``+cp``."""
        if self.cp is not None:
            return "fsdp+cp" if self.fsdp is not None else "cp"
        if self.pp is not None:
            inner = dataclasses.replace(self, pp=None, pp_schedule=None).strategy
            return "pp" if inner == "single" else f"{inner}+pp"
        if self.fsdp is not None:
            data = "hsdp" if self.dp is not None else "fsdp"
        elif self.dp is not None:
            data = "ddp"
        else:
            data = ""
        if self.tp is not None:
            return f"{data}+tp" if data else "tp"
        return data or "single"

    @property
    def sharded(self) -> bool:
        """Whether the layout runs on a fake process group (any degree set)."""
        return any(d is not None for d in (self.fsdp, self.dp, self.tp, self.pp, self.cp))

    @property
    def state_shards(self) -> int:
        """Over how many GPUs one copy of the model state is split (FSDP x TP x PP x CP: FSDP2
        shards over the CP ranks too; for PP the stages' average, a lower bound on the largest
        stage's, so pruning stays safe)."""
        return (self.fsdp or 1) * (self.tp or 1) * (self.pp or 1) * (self.cp or 1)


@dataclass(frozen=True)
class Candidate:
    """A layout, the scenario predicted for it, and what came of it.

    Attributes:
        layout: the layout.
        scenario: the ``Scenario`` predicted, as data (``scenario_to_data``).
        state_bytes: parameters, gradients and optimizer states per rank (the cheap bound).
        usable_bytes: the GPU's usable memory.
        pruned: why it was not predicted (its state alone does not fit), else None.
        peak_reserved_bytes: the predicted peak reserved memory of the worst rank.
        fits: whether that peak fits; None when pruned or failed.
        headroom_bytes: usable minus peak reserved; None when pruned or failed.
        price_per_hour: the layout's dollars per hour, where its GPU kind is priced.
        error: why its prediction failed (an unsupported combination), else None.
        notes: what was assumed for it.
    """

    layout: Layout
    scenario: Mapping[str, Any]
    state_bytes: int
    usable_bytes: int
    pruned: str | None = None
    peak_reserved_bytes: int | None = None
    fits: bool | None = None
    headroom_bytes: int | None = None
    price_per_hour: float | None = None
    error: str | None = None
    notes: tuple[str, ...] = ()

    def fits_with(self, margin_bytes: int) -> bool:
        """Whether it fits with at least ``margin_bytes`` of headroom."""
        return bool(self.fits) and (self.headroom_bytes or 0) >= margin_bytes


@dataclass(frozen=True)
class Plan:
    """Every candidate, ranked best first, and how many were predicted in full.

    Attributes:
        request: what was planned.
        candidates: every layout, best first: fitting with margin, then fitting, then over
            capacity, failed and pruned; within a group the cheapest ($/hour where priced,
            else GPU count), then the least recomputation, accumulation, the most headroom.
        predicted: distinct scenarios predicted in full (candidates that share a scenario,
            as a sharded layout's accumulation counts do, share one prediction).
        pruned: candidates whose state alone did not fit (never predicted).
        notes: what the plan does not cover.
    """

    request: PlanRequest
    candidates: tuple[Candidate, ...]
    predicted: int
    pruned: int
    notes: tuple[str, ...]

    @property
    def winner(self) -> Candidate | None:
        """The best candidate that fits with the request's margin; None where none does."""
        best = self.candidates[0] if self.candidates else None
        return best if best is not None and best.fits_with(self.request.margin_bytes) else None


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def _tp_degrees(preset: str) -> list[int]:
    """Tensor-parallel degrees modelled for ``preset``: torchtitan's Llama plan only."""
    from oomkit.prediction.models.llama import LlamaShape
    from oomkit.prediction.models.presets import get_preset

    return _powers_of_two(_MAX_TP) if isinstance(get_preset(preset).shape, LlamaShape) else [1]


def _data_layouts(ranks: int, tp: int) -> list[tuple[int | None, int | None]]:
    """(fsdp, dp) over ``ranks`` data-parallel ranks: FSDP, HSDP groups, DDP (not with TP)."""
    if ranks == 1:
        return [(None, None)]
    out: list[tuple[int | None, int | None]] = [(ranks, None)]
    out += [(s, ranks // s) for s in _HSDP_SHARD_SIZES if s < ranks and ranks % s == 0]
    if tp == 1:  # DDP of a TP model is refused (ParallelSection: torchtitan's parallelize_llama)
        out.append((None, ranks))
    return out


def _pp_degrees(request: PlanRequest) -> list[int]:
    """Pipeline degrees for the preset: Llama presets with untied embeddings (the ones
    prediction/models/pipeline.py splits), at most ``_MAX_PP``, each a split torchtitan makes
    (``stage_layers``) for every schedule planned."""
    from oomkit.errors import ConfigError
    from oomkit.prediction.models.llama import LlamaShape
    from oomkit.prediction.models.pipeline import PipelineOptions, stage_layers
    from oomkit.prediction.models.presets import get_preset

    shape = get_preset(request.preset).shape
    if not isinstance(shape, LlamaShape) or shape.tied or not request.pp_schedules:
        return []
    out = []
    for pp in _powers_of_two(_MAX_PP)[1:]:
        try:
            for schedule in request.pp_schedules:
                stage_layers(pp * PipelineOptions(pp, schedule).virtual_stages, shape.layers)
        except ConfigError:
            continue
        out.append(pp)
    return out


def _pipeline_layouts(request: PlanRequest) -> list[Layout]:
    """Pipelined layouts: per GPU kind, TP, PP and data-parallel split, the local batch cut
    into micro-batches (at least one per stage: Schedule1F1B's own check), each schedule."""
    layouts = []
    pp_degrees = _pp_degrees(request)
    for gpu in request.gpus:
        for tp in _tp_degrees(request.preset):
            for pp in pp_degrees:
                for count in _powers_of_two(request.max_gpus):
                    if count % (tp * pp) or request.global_batch % (count // (tp * pp)):
                        continue
                    ranks = count // (tp * pp)
                    per_rank = request.global_batch // ranks
                    limit = min(per_rank, request.max_micro_batch or per_rank)
                    micro = [m for m in _powers_of_two(limit)
                             if per_rank % m == 0 and per_rank // m >= pp]
                    # DDP replicas of a pipelined model are refused (pipeline.py _mesh_parts).
                    data = [(f, d) for f, d in _data_layouts(ranks, tp) if f is not None or d is None]
                    for (fsdp, dp), m, ac, precision, schedule in itertools.product(
                        data, micro, request.checkpointing, request.precisions,
                        request.pp_schedules,
                    ):
                        layouts.append(Layout(
                            gpu, count, fsdp, dp, tp if tp > 1 else None, m, per_rank // m,
                            ac, precision, pp, schedule,
                        ))
    return layouts


def _context_layouts(request: PlanRequest) -> list[Layout]:
    """Context-parallel layouts (Llama presets): the sequence over ``cp`` ranks (a multiple
    of ``2 * cp`` tokens: head-tail load balancing), FSDP2 over the other ranks with them."""
    from oomkit.prediction.models.llama import LlamaShape
    from oomkit.prediction.models.presets import get_preset

    if not isinstance(get_preset(request.preset).shape, LlamaShape):
        return []
    layouts = []
    for gpu, cp, count in itertools.product(
        request.gpus, _CP_DEGREES, _powers_of_two(request.max_gpus)
    ):
        if request.seq % (2 * cp) or count % cp or request.global_batch % (count // cp):
            continue
        ranks = count // cp
        per_rank = request.global_batch // ranks
        limit = min(per_rank, request.max_micro_batch or per_rank)
        micro = [m for m in _powers_of_two(limit) if per_rank % m == 0]
        for m, ac, precision in itertools.product(
            micro, request.checkpointing, request.precisions
        ):
            layouts.append(Layout(
                gpu, count, ranks if ranks > 1 else None, None, None, m, per_rank // m, ac,
                precision, cp=cp,
            ))
    return layouts


def enumerate_layouts(request: PlanRequest) -> list[Layout]:
    """Every layout that divides the global batch, in a fixed order.

    Raises:
        UnknownPresetError: the preset is unknown.
    """
    layouts = []
    for gpu in request.gpus:
        for tp in _tp_degrees(request.preset):
            for count in _powers_of_two(request.max_gpus):
                if count % tp or request.global_batch % (count // tp):
                    continue
                ranks = count // tp
                per_rank = request.global_batch // ranks
                limit = min(per_rank, request.max_micro_batch or per_rank)
                micro = [m for m in _powers_of_two(limit) if per_rank % m == 0]
                for fsdp, dp in _data_layouts(ranks, tp):
                    for m in micro:
                        for ac in request.checkpointing:
                            for precision in request.precisions:
                                layouts.append(Layout(
                                    gpu, count, fsdp, dp, tp if tp > 1 else None, m,
                                    per_rank // m, ac, precision,
                                ))
    return layouts + _pipeline_layouts(request) + _context_layouts(request)


def _scenario_data(request: PlanRequest, layout: Layout) -> dict[str, Any]:
    """The scenario predicted for ``layout`` (validated: ``scenario_from_data``)."""
    from oomkit.scenario.files import scenario_from_data, scenario_to_data

    step: dict[str, Any] = {
        "batch": layout.micro_batch,
        "seq": request.seq,
        "checkpointing": layout.checkpointing,
        "precision": layout.precision,
    }
    if layout.pp is not None:
        # The local batch, cut by the schedule into grad_accum micro-batches (torchtitan's
        # pipeline_parallel_microbatch_size); the worst stage is the candidate's peak.
        step["batch"] = layout.micro_batch * layout.grad_accum
    elif layout.grad_accum > 1:
        step["grad_accum"] = layout.grad_accum
    data: dict[str, Any] = {
        "model": {"preset": request.preset},
        "step": step,
        "target": {"gpu": layout.gpu},
    }
    if layout.sharded:
        degrees = {
            "fsdp": layout.fsdp, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
            "cp": layout.cp,
        }
        data["parallel"] = {k: v for k, v in degrees.items() if v is not None}
        if layout.pp is not None:
            data["parallel"].update(
                pp_schedule=layout.pp_schedule, microbatches=layout.grad_accum, all_ranks=True
            )
    return scenario_to_data(scenario_from_data(data))


def _state_bytes(request: PlanRequest, layout: Layout, cache: dict[str, int]) -> int:
    """Parameters, gradients and AdamW states per rank (prediction/models/state_bytes.py)."""
    if layout.precision not in cache:
        from oomkit.prediction.models.options import StepOptions
        from oomkit.prediction.models.state_bytes import expected_state_bytes

        parts = expected_state_bytes(
            request.preset,
            StepOptions(batch_size=1, seq_len=request.seq, precision=layout.precision),
        )
        cache[layout.precision] = sum(parts.values())
    whole = cache[layout.precision]
    return -(-whole // layout.state_shards)


def predict_candidate(data: Mapping[str, Any]) -> dict[str, Any]:
    """Predict one candidate's scenario (``scenario_to_data`` form): the worst rank's figures,
    or the error that refused it. Runs in an executor's worker; returns plain data."""
    from oomkit.scenario.files import scenario_from_data
    from oomkit.scenario.run import predict

    try:
        prediction = predict(scenario_from_data(data))
    except Exception as exc:  # noqa: BLE001 - one layout's failure is its row, not the plan's end
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "peak_reserved_bytes": prediction.peak_reserved_bytes,
        "fits": prediction.fits,
        "headroom_bytes": prediction.headroom_bytes,
    }


def _key(data: Mapping[str, Any]) -> str:
    import json

    return json.dumps(data, sort_keys=True)


def plan(
    request: PlanRequest,
    executor: Executor | None = None,
    *,
    progress: Progress | None = None,
    predictor: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None,
) -> Plan:
    """Plan the job: enumerate, prune by state bytes, predict the rest, rank.

    Args:
        request: the job and the GPU kinds.
        executor: where predictions run (None: ``LocalPoolExecutor()``, one process per core).
        progress: ``progress(done, total)`` over the predictions run.
        predictor: predicts one scenario's data (None: ``predict_candidate``); a test's seam.

    Returns:
        The ranked ``Plan``.

    Raises:
        OomkitError: an unknown preset or GPU kind, or no layout divides the global batch.
    """
    from oomkit.core.gpus import get_gpu

    layouts = enumerate_layouts(request)
    if not layouts:
        raise OomkitError(
            f"plan: no layout of up to {request.max_gpus} GPUs divides global batch "
            f"{request.global_batch}: use a global batch with a power-of-two factor, or more GPUs"
        )
    usable = {gpu: get_gpu(gpu).usable_bytes() for gpu in request.gpus}
    cache: dict[str, int] = {}
    drafts = []
    for layout in layouts:
        state = _state_bytes(request, layout, cache)
        pruned = None
        if state > usable[layout.gpu]:
            pruned = f"model state alone needs {state} B per rank, over {usable[layout.gpu]} B usable"
        notes: tuple[str, ...] = ()
        price = request.prices.get(layout.gpu)
        drafts.append(Candidate(
            layout, _scenario_data(request, layout), state, usable[layout.gpu], pruned,
            price_per_hour=None if price is None else price * layout.gpus, notes=notes,
        ))
    unique: dict[str, Mapping[str, Any]] = {}
    for draft in drafts:
        if draft.pruned is None:
            unique.setdefault(_key(draft.scenario), draft.scenario)
    runner = executor if executor is not None else LocalPoolExecutor()
    results = runner.map(predictor or predict_candidate, list(unique.values()), progress=progress)
    by_key = dict(zip(unique, results, strict=True))
    candidates = []
    for draft in drafts:
        if draft.pruned is not None:
            candidates.append(draft)
            continue
        result = by_key[_key(draft.scenario)]
        candidates.append(Candidate(
            draft.layout, draft.scenario, draft.state_bytes, draft.usable_bytes,
            peak_reserved_bytes=result.get("peak_reserved_bytes"), fits=result.get("fits"),
            headroom_bytes=result.get("headroom_bytes"), price_per_hour=draft.price_per_hour,
            error=result.get("error"), notes=draft.notes,
        ))
    order = {id(c): i for i, c in enumerate(candidates)}
    ranked = sorted(candidates, key=lambda c: _rank(c, request, order[id(c)]))
    plan_notes: tuple[str, ...] = (NOT_MODELLED,)
    return Plan(request, tuple(ranked), len(unique), sum(c.pruned is not None for c in candidates), plan_notes)


def _rank(candidate: Candidate, request: PlanRequest, index: int) -> tuple[Any, ...]:
    """Sort key: status group, cost, recomputation, accumulation, headroom, then enumeration."""
    if candidate.pruned is not None:
        group = 4
    elif candidate.error is not None:
        group = 3
    elif not candidate.fits:
        group = 2
    else:
        group = 0 if candidate.fits_with(request.margin_bytes) else 1
    layout = candidate.layout
    if request.prices:
        cost = candidate.price_per_hour if candidate.price_per_hour is not None else float("inf")
    else:
        cost = float(layout.gpus)
    headroom = candidate.headroom_bytes if candidate.headroom_bytes is not None else 0
    return (group, cost, _CHECKPOINT_ORDER[layout.checkpointing], layout.grad_accum, -headroom, index)


def _candidate_data(candidate: Candidate) -> dict[str, Any]:
    layout = candidate.layout
    return {
        "gpu": layout.gpu,
        "gpus": layout.gpus,
        "strategy": layout.strategy,
        "fsdp": layout.fsdp,
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
        "pp_schedule": layout.pp_schedule,
        "cp": layout.cp,
        "micro_batch": layout.micro_batch,
        "grad_accum": layout.grad_accum,
        "checkpointing": layout.checkpointing,
        "precision": layout.precision,
        "state_bytes": candidate.state_bytes,
        "usable_bytes": candidate.usable_bytes,
        "pruned": candidate.pruned,
        "peak_reserved_bytes": candidate.peak_reserved_bytes,
        "fits": candidate.fits,
        "headroom_bytes": candidate.headroom_bytes,
        "price_per_hour": candidate.price_per_hour,
        "error": candidate.error,
        "notes": list(candidate.notes),
        "scenario": dict(candidate.scenario),
    }


def plan_to_data(result: Plan) -> dict[str, Any]:
    """The plan as JSON-ready data: every candidate (ranked) and the winner's scenario, which
    ``oomkit predict --config`` runs (None where no layout fits with the margin)."""
    request = result.request
    winner = result.winner
    return {
        "request": {
            "preset": request.preset,
            "global_batch": request.global_batch,
            "seq": request.seq,
            "gpus": list(request.gpus),
            "max_gpus": request.max_gpus,
            "prices": dict(request.prices),
            "margin_bytes": request.margin_bytes,
        },
        "enumerated": len(result.candidates),
        "pruned": result.pruned,
        "predicted": result.predicted,
        "notes": list(result.notes),
        "winner": None if winner is None else _candidate_data(winner),
        "winner_scenario": None if winner is None else dict(winner.scenario),
        "candidates": [_candidate_data(c) for c in result.candidates],
    }

