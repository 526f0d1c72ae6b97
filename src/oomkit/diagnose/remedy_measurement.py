"""Remedies measured by re-predicting the step with each change, and whether each makes it fit.

A step oomkit can rebuild (a built-in preset or a ``--hf`` model, with its ``StepOptions``) is
predicted again with one change at a time: precision (mixed bf16 / fp16, pure bf16), activation
checkpointing, SGD, the fine-tuning changes (LoRA, QLoRA, 8-bit AdamW: ``_finetune_remedies``),
the smallest ``--fsdp N`` (a power of two) whose rank 0 fits, and the largest halved batch that
fits with gradient accumulation keeping the global batch (recorded with its accumulation:
``_batch_remedies``). When no one change fits, the least combination that does
(``combined_changes``: checkpointing, then with mixed or pure bf16 precision, then with QLoRA,
each at the largest halved batch that fits) is one more remedy. Each remedy says whether the step then
fits (``MeasuredRemedy.fits``) and what it needs (``peak_reserved_bytes``: the required reserved
bytes of the re-prediction, its peak on a device without limit). A change that cannot apply is
never measured (precision already that low, checkpointing already on, no Adam to replace, a
model peft or FSDP does not take).

``prediction_remedies`` does this for a ``Prediction`` that does not fit (what ``oomkit
predict`` prints under the verdict); ``measure_remedies`` for any step given a re-predict
function (``oomkit explain`` of a saved prediction, ``_model_remedies.measured_model_remedies``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from oomkit.core.target import ParallelLayout, Target
from oomkit.diagnose._batch_remedies import batch_parts, fitting_batch, measured_batch
from oomkit.diagnose._finetune_remedies import finetune_changes
from oomkit.diagnose._remedy_code import (
    CHECKPOINT_CODE,
    FP16_CODE,
    MEASURED_WHY,
    MIXED_CODE,
    PURE_BF16_CODE,
    SGD_CODE,
)
from oomkit.diagnose.diagnosis import Remedy
from oomkit.diagnose.measured_remedy import MeasuredRemedy
from oomkit.errors import OomkitError, TorchRequiredError
from oomkit.executors.forked import run_forked_or_here
from oomkit.prediction.workload import WorkloadSpec
from oomkit.units import format_bytes

if TYPE_CHECKING:
    from oomkit.prediction.predictor import Prediction

__all__ = [
    "FSDP_SIZES",
    "MEASURED_WHY",
    "MeasuredRemedy",
    "Repredict",
    "StepChange",
    "combined_changes",
    "combined_fields",
    "measure_remedies",
    "measured_remedies_of",
    "prediction_remedies",
    "predict_rebuilt",
    "rank_measured",
    "rebuild",
    "repredict",
    "step_changes",
]

# The --fsdp sizes tried, smallest first: powers of two, as FSDP meshes are laid out on nodes of
# 8 GPUs (torchtitan's parallel_dims: dp_shard * tp * ... = world size).
FSDP_SIZES: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
# torch/cuda/__init__.py is_bf16_supported: native bf16 needs compute capability 8.0 (Ampere).
_NATIVE_BF16_CAPABILITY = (8, 0)


# (options, layout) -> the re-predicted step: layout None keeps the step's own.
Repredict = Callable[[Any, ParallelLayout | None], "Prediction"]


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What a re-prediction of one change says (all a remedy keeps of it, and what a forked
    process sends back)."""

    required_bytes: int
    fits: bool


@dataclasses.dataclass(frozen=True)
class StepChange:
    """One change to a step's ``StepOptions``: its title, the fields it sets, the code that
    applies it, and the options that do (``--checkpointing full``; ``None``: no option does)."""

    title: str
    fields: dict[str, Any]
    code: str
    flag: str | None
    optional: bool = False  # a model may not take it (peft targets, nothing to quantize)


def _native_bf16(compute_capability: tuple[int, int] | None) -> bool:
    return compute_capability is None or tuple(compute_capability) >= _NATIVE_BF16_CAPABILITY


def step_changes(base: Any, compute_capability: tuple[int, int] | None) -> list[StepChange]:
    """The single changes that apply to ``base`` (a training step's ``StepOptions``)."""
    out: list[StepChange] = []
    bf16 = _native_bf16(compute_capability)
    if base.precision == "fp32":
        mixed = "bf16-mixed" if bf16 else "fp16-mixed"
        fields: dict[str, Any] = {"precision": mixed}
        if base.trainer_mixed_precision is not None:  # the Trainer's bf16/fp16: accelerate's too
            fields["trainer_mixed_precision"] = mixed.removesuffix("-mixed")
        title = (
            "bf16 mixed precision (autocast)" if bf16
            else "fp16 mixed precision (autocast + GradScaler)"
        )
        out.append(StepChange(title, fields, MIXED_CODE if bf16 else FP16_CODE,
                           f"--precision {mixed}"))
    if base.precision not in ("bf16", "fp16") and bf16 and base.trainer_mixed_precision is None:
        out.append(
            StepChange(
                "pure bf16 weights, gradients and optimizer states",
                {"precision": "bf16"},
                PURE_BF16_CODE,
                "--precision bf16",
            )
        )
    if base.checkpointing == "none":
        out.append(
            StepChange("activation checkpointing", {"checkpointing": "full"}, CHECKPOINT_CODE,
                    "--checkpointing full")
        )
    if base.optimizer not in ("sgd",):
        out.append(
            StepChange(
                "SGD with momentum instead of Adam (one optimizer state, not two)",
                # torch has no meta kernel for fused SGD (StepOptions refuses it): foreach.
                {"optimizer": "sgd"}
                | ({"optimizer_impl": "foreach"} if base.optimizer_impl == "fused" else {}),
                SGD_CODE,
                "--optimizer sgd",
            )
        )
    for title, fields, code in finetune_changes(base, "bf16" if bf16 else "fp16"):
        out.append(StepChange(title, fields, code, _finetune_flag(base, fields), optional=True))
    return out


def _finetune_flag(base: Any, fields: dict[str, Any]) -> str | None:
    """The options that apply a fine-tuning change as it was measured: ``--lora R`` (peft's
    defaults otherwise, as ``LoraOptions()``), ``--quantize nf4``, ``--optimizer adamw8bit``.
    The precision of the base weights is named too (the change's, else the step's own): a
    LoRA or QLoRA base is bf16 by default when no ``--precision`` is given
    (``scenario/options.py``), and a command that gives one keeps it; either way the flags
    then give the step that was measured."""
    if fields.get("optimizer") == "adamw8bit":
        return "--optimizer adamw8bit"
    parts = []
    if fields.get("lora") is not None:
        parts.append(f"--lora {fields['lora'].r}")
    if fields.get("quantize") is not None:
        parts.append(f"--quantize {fields['quantize']}")
    if not parts:
        return None
    precision = fields.get("precision", base.precision)
    if precision is not None:
        parts.append(f"--precision {precision}")
    return " ".join(parts)


def measure_remedies(
    base: Any,
    repredict_with: Repredict,
    *,
    required_bytes: int,
    usable_bytes: int,
    compute_capability: tuple[int, int] | None = None,
    fsdp_sizes: Sequence[int] = (),
    progress: Callable[[int, int], None] | None = None,
    jobs: int | None = 1,
) -> tuple[list[MeasuredRemedy], list[str]]:
    """Re-predict each change that applies to ``base`` and return what it saves and whether the
    step then fits.

    Args:
        base: the step's ``StepOptions`` (``mode="train"``; other modes get no remedies).
        repredict_with: ``(options, layout)`` -> the step's ``Prediction`` on the same target
            (``layout``: a ``ParallelLayout`` to shard over, ``None`` for the step's own).
        required_bytes: what the step needs now (reserved bytes on a device without limit).
        usable_bytes: what the target offers PyTorch.
        compute_capability: the target GPU's: below 8.0, fp16 autocast instead of bf16 and no
            pure bf16.
        fsdp_sizes: ``--fsdp`` sizes to try, smallest first; the first whose rank 0 fits is
            offered (empty: not tried, e.g. for a model FSDP is not modelled for).
        progress: called as ``progress(done, total)`` after each change.
        jobs: processes that re-predict the single changes at once, forked
            (``executors.forked.run_forked_or_here``: the results, and the first error, are
            the one-at-a-time ones; None: one per core). The searches after them (FSDP, the
            batch, the combinations) decide each step from the last, one at a time.

    Returns:
        The remedies that save memory (unranked; ``rank_measured`` orders them) and warnings.

    Raises:
        OomkitError: the step cannot be rebuilt for a change every model takes.
    """
    if base.mode != "train":
        return [], []
    changes = step_changes(base, compute_capability)
    total = len(changes) + 1 + (1 if fsdp_sizes else 0)
    out: list[MeasuredRemedy] = []
    warnings: list[str] = []
    def attempt(change: StepChange) -> _Outcome | OomkitError:
        try:
            new = repredict_with(dataclasses.replace(base, **change.fields), None)
        except OomkitError as exc:  # judged below, in the changes' order
            return exc
        return _Outcome(new.required_bytes, bool(new.fits))

    outcomes = run_forked_or_here(
        [functools.partial(attempt, change) for change in changes],
        jobs=jobs,
        progress=None if progress is None else (lambda done, _: progress(done, total)),
    )
    for change, new in zip(changes, outcomes, strict=True):
        if isinstance(new, TorchRequiredError):  # peft (or transformers) is not installed
            warnings.append(f"{change.title}: not measured ({new})")
            continue
        if isinstance(new, OomkitError):
            if not change.optional:
                raise new
            continue
        saving = required_bytes - new.required_bytes
        if saving <= 0:
            continue
        out.append(
            _measured(change.title, saving, change.code, new, required_bytes, usable_bytes,
                      flag=change.flag,
                      # Adapters on frozen (or 4-bit) base weights train another model.
                      changes_training=bool(change.fields.keys() & {"lora", "quantize"}))
        )
    if fsdp_sizes:
        fsdp = _measured_fsdp(base, repredict_with, fsdp_sizes, required_bytes, usable_bytes)
        if fsdp is not None:
            out.append(fsdp)
        if progress is not None:
            progress(total - 1, total)
    batch = measured_batch(base, repredict_with, required_bytes)
    if batch is not None:
        out.append(batch)
    # Sharding over more GPUs is no answer on the GPUs one has (rank_measured puts it after).
    if not any(r.fits and not (r.flag or "").startswith("--fsdp") for r in out):

        def counted(options: Any, layout: ParallelLayout | None) -> Prediction:
            # How many re-predictions a combination takes is known only as it goes: the bar
            # expects one more after each.
            nonlocal total
            try:
                return repredict_with(options, layout)
            finally:
                total += 1
                if progress is not None:
                    progress(total, total + 1)

        combined = _measured_combination(base, changes, counted, required_bytes, usable_bytes)
        if combined is not None:
            out.append(combined)
    if progress is not None:
        progress(total, total)
    return out, warnings


def _measured(
    title: str,
    saving: int,
    code: str,
    new: Prediction | _Outcome,
    required: int,
    usable: int,
    *,
    flag: str | None,
    changes_training: bool = False,
    what: str = "",
) -> MeasuredRemedy:
    verdict = "fits" if new.fits else "still does not fit"
    return MeasuredRemedy(
        title,
        saving,
        "high",
        code,
        f"{MEASURED_WHY}: {what}the step needs {format_bytes(new.required_bytes)} reserved "
        f"instead of {format_bytes(required)} and {verdict} in the {format_bytes(usable)} usable.",
        estimate=False,
        changes_training=changes_training,
        fits=bool(new.fits),
        peak_reserved_bytes=new.required_bytes,
        flag=flag,
    )


def _measured_fsdp(
    base: Any, repredict_with: Repredict, sizes: Sequence[int], required: int, usable: int
) -> MeasuredRemedy | None:
    """The smallest FSDP2 mesh whose rank 0 fits (per-rank batch unchanged), by bisection over
    ``sizes`` (rank 0's need shrinks as the states are sharded over more ranks). The largest
    mesh is tried first: where its rank 0 does not fit (activations, which FSDP does not shard,
    outweigh the states), no mesh does, and one recording says so instead of the bisection's
    three (a rank of an 8B model takes about 20 s)."""
    if not sizes:
        return None
    found: dict[int, Prediction] = {}
    try:
        largest = repredict_with(base, ParallelLayout(fsdp=sizes[-1]))
    except OomkitError:  # a model or setting FSDP2 is not modelled for (fp16-mixed)
        return None
    if not largest.fits:
        return None
    found[len(sizes) - 1] = largest
    lo, hi = -1, len(sizes) - 1  # sizes[lo] does not fit (-1: none tried), sizes[hi] fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            new = repredict_with(base, ParallelLayout(fsdp=sizes[mid]))
        except OomkitError:  # a model or setting FSDP2 is not modelled for (fp16-mixed)
            return None
        if new.fits:
            found[mid], hi = new, mid
        else:
            lo = mid
    if hi < len(sizes):
        size, new = sizes[hi], found[hi]
        code = (
            f"torchrun --nproc-per-node {size} train.py  # {size} GPUs, same batch per GPU\n"
            "# in train.py, per transformer block and then the root (FSDP2):\n"
            "from torch.distributed.fsdp import fully_shard\n"
            "for block in model.layers:\n"
            "    fully_shard(block)\n"
            "fully_shard(model)"
        )
        return _measured(
            f"shard with FSDP across {size} GPUs", required - new.required_bytes, code, new,
            required, usable, flag=f"--fsdp {size}", what=f"on rank 0 of {size}, ",
        )
    return None


def combined_changes(changes: Sequence[StepChange]) -> list[list[StepChange]]:
    """The changes tried together when none fits alone, the least first: activation
    checkpointing (the same arithmetic, recomputed), then with mixed precision, then with pure
    bf16 instead; each is also tried with the batch halved. Last, as it trains another model,
    checkpointing with QLoRA (4-bit base weights under LoRA adapters: what fits a 7-8B model's
    training on a 24 GB GPU). The optimizer's changes (SGD, 8-bit AdamW) are not combined."""
    checkpointing = [c for c in changes if "checkpointing" in c.fields][:1]
    mixed = [c for c in changes if c.fields.get("precision") in ("bf16-mixed", "fp16-mixed")]
    precisions = mixed[:1] + [c for c in changes if c.fields.get("precision") == "bf16"][:1]
    qlora = [c for c in changes if c.fields.get("quantize") in ("nf4", "fp4")][:1]
    out = ([checkpointing] if checkpointing else []) + [checkpointing + [p] for p in precisions]
    return out + ([checkpointing + qlora] if checkpointing and qlora else [])


def combined_fields(combination: Sequence[StepChange]) -> dict[str, Any]:
    """The ``StepOptions`` fields of changes applied together (a later change's win)."""
    fields: dict[str, Any] = {}
    for change in combination:
        fields |= change.fields
    return fields


def _measured_combination(
    base: Any, changes: Sequence[StepChange], repredict_with: Repredict, required: int, usable: int
) -> MeasuredRemedy | None:
    """The first of ``combined_changes`` that fits, at the largest halved batch that does
    (``_batch_remedies.fitting_batch``; a combination that cannot fit costs two
    re-predictions); none when no combination fits even at batch 1."""
    for combination in combined_changes(changes):
        fields = combined_fields(combination)
        try:
            found = fitting_batch(base, dataclasses.replace(base, **fields), repredict_with,
                                   measured_alone=len(combination) == 1)
        except OomkitError:  # each change builds alone; this pairing is not modelled
            continue
        if found is None:
            continue
        size, new = found
        titles = [change.title for change in combination]
        codes = [change.code for change in combination]
        flags = [change.flag for change in combination if change.flag]
        if size != base.batch_size:
            title, code, flag = batch_parts(base, size)
            titles, codes, flags = [*titles, title], [*codes, code], [*flags, flag]
        return MeasuredRemedy(
            " + ".join(titles),
            required - new.required_bytes,
            "high",
            "\n\n".join(codes),
            f"{MEASURED_WHY}: with these changes together (no one of them fits alone) the "
            f"step needs {format_bytes(new.required_bytes)} reserved instead of "
            f"{format_bytes(required)} and fits in the {format_bytes(usable)} usable.",
            estimate=False,
            # Adapters on 4-bit base weights train another model (as the single change says).
            changes_training=bool(fields.keys() & {"lora", "quantize"}),
            fits=True,
            peak_reserved_bytes=new.required_bytes,
            flag=" ".join(flags) or None,
        )
    return None


def rank_measured(remedies: Iterable[Remedy], deficit_bytes: int | None) -> list[Remedy]:
    """Remedies that make the step fit first, those on the same GPUs before sharding over more
    (``--fsdp``), then by ``Remedy.rank_key`` (those that keep the training as it is before
    LoRA/QLoRA, then by bytes saved)."""

    def key(remedy: Remedy) -> tuple[bool, bool, tuple[bool, bool, bool, bool, int, bool]]:
        measured = remedy if isinstance(remedy, MeasuredRemedy) else None
        fits = measured is not None and measured.fits is True
        more_gpus = measured is not None and (measured.flag or "").startswith("--fsdp")
        return (not fits, more_gpus, remedy.rank_key(deficit_bytes))

    return sorted(remedies, key=key)


def repredict(workload: WorkloadSpec, target: Target, options: Any) -> Prediction:
    """The step of ``workload`` with ``options`` predicted again on ``target`` (for a
    ``target.parallel`` layout: its rank 0, as ``oomkit predict --fsdp/--tp/--dp`` builds it).

    Raises:
        OomkitError: the workload cannot be rebuilt (an ``--hf`` config not in the cache) or
            does not take the options.
    """
    if target.parallel is not None:
        return _repredict_parallel(workload, target, options)
    return predict_rebuilt(workload, rebuild(workload, options), target, options)


def rebuild(workload: WorkloadSpec, options: Any) -> Any:
    """The ``BuiltStep`` of a preset or ``--hf`` workload with ``options`` (an ``--hf``
    config from its directory or the local cache only: re-predicting never goes online).

    Raises:
        OomkitError: the workload cannot be rebuilt, or does not take the options.
    """
    from oomkit.prediction.models import build_hf_step, build_preset_step

    if workload.kind == "hf":
        return build_hf_step(workload.name, options, local_files_only=True)
    return build_preset_step(workload.name, options)


def predict_rebuilt(workload: WorkloadSpec, built: Any, target: Target, options: Any) -> Prediction:
    """Predict a ``rebuild`` step on one GPU of ``target``, recording the workload's steps."""
    from oomkit.prediction.predictor import predict

    return predict(
        built.step_fn,
        target=target,
        steps=workload.steps or 2,
        track=built.track,
        description=built.description,
        # A compiled prediction's changes are re-predicted compiled too, or each would be
        # compared eager against the compiled original.
        compile=bool(options.compile),
    )


def _repredict_parallel(workload: WorkloadSpec, target: Target, options: Any) -> Prediction:
    """Rank 0 of the target's layout, rebuilt as ``oomkit predict --fsdp/--tp/--dp`` builds
    it (interfaces/cli/predict.py ``_predict_sharded``), with the saved DDP bucket options."""
    from oomkit.prediction.models.data_parallel import DdpOptions, build_ddp_preset_step
    from oomkit.prediction.models.parallel import build_fsdp_preset_step
    from oomkit.prediction.predictor import predict_recording
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    layout = target.parallel
    assert layout is not None
    ddp_alone = layout.dp > 1 or workload.ddp_gradient_as_bucket_view is not None
    if layout.fsdp == 1 and layout.tp == 1 and ddp_alone:
        ddp = DdpOptions(workload.ddp_bucket_cap_mb, bool(workload.ddp_gradient_as_bucket_view))

        def build(mesh: Any) -> tuple[Any, ...]:
            step = build_ddp_preset_step(workload.name, options, mesh, ddp)
            return step.built.step_fn, tuple(step.built.track), step.setup

    else:
        float8 = None
        if workload.float8_recipe is not None:  # a --float8 run (models/float8.py)
            from oomkit.prediction.models.float8 import Float8Options

            float8 = Float8Options(
                workload.float8_recipe,  # type: ignore[arg-type]  # checked by Float8Options
                all_gather=bool(workload.float8_all_gather),
            )

        def build(mesh: Any) -> tuple[Any, ...]:
            built = build_fsdp_preset_step(workload.name, options, mesh, float8)
            return built.step_fn, tuple(built.track)

    recording = trace_distributed_step(
        build,
        world_size=layout.world_size,
        mesh_shape=layout.mesh_shape,
        steps=workload.steps or 2,
        target=target,
        # Blocks compiled per block (models/compiled_blocks.py) are recorded compiled.
        compile=bool(options.compile),
    )
    return predict_recording(recording, target=target)


def measured_remedies_of(
    prediction: Prediction, progress: Callable[[int, int], None] | None = None
) -> tuple[list[Remedy], list[str]]:
    """Every measured remedy of a ``Prediction`` of a preset or ``--hf`` model, unranked, and
    the warnings of measuring them (``explain``'s measured remedies, from the record itself)."""
    remedies = prediction_remedies(prediction, top=None, progress=progress)
    return list(remedies), []


def prediction_remedies(
    prediction: Prediction,
    *,
    top: int | None = 3,
    fsdp_sizes: Sequence[int] = FSDP_SIZES,
    progress: Callable[[int, int], None] | None = None,
    jobs: int | None = 1,
) -> tuple[MeasuredRemedy, ...]:
    """The measured remedies of a step that does not fit, those that make it fit first.

    Args:
        prediction: a prediction of a built-in preset or a ``--hf`` model (its ``workload``
            and ``target``), made by ``oomkit predict``.
        top: how many to return (``None``: all).
        fsdp_sizes: ``--fsdp`` sizes to try, smallest first (presets on one GPU only; ``()``
            skips them).
        progress: called as ``progress(done, total)`` while measuring.
        jobs: processes that re-predict the single changes at once (``measure_remedies``).

    Returns:
        The remedies, ranked (``rank_measured``); empty when the step fits, is not a training
        step, or cannot be rebuilt (a ``file.py:function`` workload, a pipeline or
        context-parallel layout).
    """
    workload, target = prediction.workload, prediction.target
    if prediction.fits or workload is None or target is None:
        return ()
    if workload.kind not in ("preset", "hf"):
        return ()
    layout = target.parallel
    if layout is not None and (layout.pp > 1 or layout.cp > 1):
        # A pipeline's schedule and a context-parallel split are the scenario's, not the
        # workload record's: re-predicting them here would rebuild another layout.
        return ()
    from oomkit.prediction.models import StepOptions

    known = {name: value for name, value in workload.options.items() if value is not None}
    try:
        base = StepOptions(**known)
    except (TypeError, ValueError):
        return ()

    def repredict_with(options: Any, layout: ParallelLayout | None) -> Prediction:
        chosen = target if layout is None else dataclasses.replace(target, parallel=layout)
        return repredict(workload, chosen, options)

    one_gpu = target.parallel is None and workload.kind == "preset"
    remedies, _ = measure_remedies(
        base,
        repredict_with,
        required_bytes=prediction.required_bytes,
        usable_bytes=prediction.usable_bytes,
        compute_capability=prediction.gpu.compute_capability,
        fsdp_sizes=fsdp_sizes if one_gpu else (),
        progress=progress,
        jobs=jobs,
    )
    ranked = rank_measured(remedies, prediction.required_bytes - prediction.usable_bytes)
    out = tuple(r for r in ranked if isinstance(r, MeasuredRemedy))
    return out if top is None else out[:top]
