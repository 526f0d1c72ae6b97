"""A prediction in words: the one-line verdict and the plain-text summary ``str()`` prints.

Plain text, no rich: ``print(oomkit.predict(...))`` shows this (``Prediction.__str__``), and the
terminal, JSON and HTML reports (``oomkit.interfaces.reports.prediction``) reuse the verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from oomkit.prediction.module_groups import group_modules
from oomkit.units import format_bytes

if TYPE_CHECKING:  # predictor.py imports this module
    from oomkit.prediction.predictor import OomPoint, Prediction

__all__ = [
    "DEFAULT_PREFIX",
    "COMPILED_EAGERLY",
    "COMPILED_RECORDED",
    "SUMMARY_ROWS",
    "header_line",
    "module_label",
    "nothing_recorded",
    "oom_phase",
    "oom_place",
    "peak_rank_words",
    "rank_peak_lines",
    "prediction_summary",
    "precision_note",
    "verdict_line",
]

# The assumptions that name a default the scenario chose (oomkit.scenario.options: "default
# precision", "default steps"): the verdict names them.
DEFAULT_PREFIX = "default "
# The start of the recording's warning for compiled code run eagerly (the same text as
# oomkit.prediction.tracing.read_report.COMPILED_EAGERLY, which imports torch; a test keeps
# them equal): the verdict says so too.
COMPILED_EAGERLY = "torch.compile: traced eagerly"
# The start of the warning of a step recorded with compile=True (read_report.COMPILED_WARNING).
COMPILED_RECORDED = "torch.compile: compiled (AOTAutograd partitioner real, Inductor fusion emulated)"

# Rows of each list (categories, modules) that the summary shows; the rest are counted.
SUMMARY_ROWS = 5


def module_label(path: str | None) -> str:
    """A module path as a row label: ``(root module)`` for ``""``, ``(outside any module)``."""
    if path is None:
        return "(outside any module)"
    return path or "(root module)"


def nothing_recorded(prediction: Prediction) -> bool:
    """Whether the step allocated nothing on the traced device (peak allocated 0 B, no OOM).

    Then there is nothing to predict: the step ran somewhere else, most often because the model
    or its inputs were left on the CPU (``device="cpu"``, ``.cpu()``), and "fits" would be a
    success reported on nothing.
    """
    return prediction.oom is None and prediction.peak_allocated_bytes == 0


def precision_note(prediction: Prediction) -> str:
    """``" (bf16, from the config's torch_dtype)"`` when the precision was not given but taken
    from somewhere (``WorkloadSpec.precision_source``); ``""`` otherwise."""
    workload = prediction.workload
    if workload is None or workload.precision is None or not workload.precision_source:
        return ""
    return f" ({workload.precision}, {workload.precision_source})"


def peak_rank_words(prediction: Prediction) -> str:
    """``"rank 4 (pipeline stage 1) peaks, of 2 distinct ranks"`` for an ``--all-ranks``
    prediction (which is the peaking rank's); ``""`` without ``rank_peaks``."""
    peaks = prediction.rank_peaks
    if not peaks:
        return ""
    top = max(peaks, key=lambda p: (p["peak_reserved_bytes"], p["peak_allocated_bytes"], -p["rank"]))
    # A script's ranks are each of them (no stage: scenario/ranks.py peak_of), a layout's the
    # distinct ones.
    ranks = "ranks" if all(p["stage"] is None for p in peaks) else "distinct ranks"
    return f"rank {top['rank']}{_stage(prediction, top)} peaks, of {len(peaks)} {ranks}"


def _stage(prediction: Prediction, peak: Mapping[str, Any]) -> str:
    """`` (pipeline stage S)`` where the ranks are pipelined (some stage above 0), else ``""``."""
    staged = any(p["stage"] for p in prediction.rank_peaks)
    return f" (pipeline stage {peak['stage']})" if staged else ""


def rank_peak_lines(prediction: Prediction) -> list[str]:
    """One line per distinct rank of an ``--all-ranks`` prediction: its peaks."""
    return [
        f"rank {p['rank']}{_stage(prediction, p)}: peak reserved "
        f"{format_bytes(p['peak_reserved_bytes'])}, peak allocated "
        f"{format_bytes(p['peak_allocated_bytes'])}, {'fits' if p['fits'] else 'does not fit'}"
        for p in prediction.rank_peaks
    ]


def verdict_line(prediction: Prediction) -> str:
    """One line a person reads first: fits (with headroom) or where it would OOM.

    ``fits on H100 SXM 80GB: peak reserved 12.30 GiB of 79.11 GiB usable, 66.81 GiB headroom``

    A step that allocated nothing on the traced device gets no "fits": the line says that
    nothing was predicted and why that usually happens.
    """
    p = prediction
    on = f"{p.gpu.name}{precision_note(p)}"
    if nothing_recorded(p):
        return (
            f"NOTHING PREDICTED for {on}: the step allocated nothing on the traced device (peak "
            "allocated 0 B), so it ran somewhere else: a model or tensors left on the CPU "
            "(device='cpu', .cpu(), .to('cpu'))? Create them on the meta device (oomkit runs the "
            "step under torch.device('meta')) and predict again"
        )
    if p.oom is None:
        line = (
            f"fits on {on}: peak reserved {format_bytes(p.peak_reserved_bytes)} of "
            f"{format_bytes(p.usable_bytes)} usable, {format_bytes(p.headroom_bytes)} headroom"
        )
    else:
        oom = p.oom
        where = "before the first step" if oom.step is None else f"at step {oom.step}"
        line = (
            f"would OOM {where} {oom_place(oom)} requesting {format_bytes(oom.requested_bytes)} on "
            f"{on}: the step needs about {format_bytes(p.required_bytes)} reserved, "
            f"{format_bytes(-p.headroom_bytes)} more than the {format_bytes(p.usable_bytes)} "
            "usable"
        )
    if p.budget_bytes is not None and not p.within_budget:
        line += f"; over the budget of {format_bytes(p.budget_bytes)}"
    elif p.budget_bytes is not None:
        line += f"; within the budget of {format_bytes(p.budget_bytes)}"
    if any(w.startswith(COMPILED_EAGERLY) for w in p.warnings):
        line += " (torch.compile traced eagerly)"
    elif any(w.startswith(COMPILED_RECORDED) for w in p.warnings):
        line += " (torch.compile: compiled, Inductor fusion emulated)"
    if p.rank_peaks:  # --all-ranks (scenario/ranks.py): which rank peaks
        line += f"; {peak_rank_words(p)}"
    defaults = [text for name, text in p.assumptions.items() if name.startswith(DEFAULT_PREFIX)]
    if defaults:  # each default the verdict rests on, and how to change it
        line += f" ({'; '.join(defaults)})"
    return line


# Ops of a cross-entropy loss (torch/nn/functional.py cross_entropy: log_softmax then
# nll_loss; autocast's fp32 copy of the logits is made by the loss's own call).
_LOSS_OPS = ("log_softmax", "nll_loss", "cross_entropy", "mse_loss", "binary_cross_entropy")


def oom_phase(oom: OomPoint) -> str | None:
    """The phase an OOM falls in: ``forward``, ``loss``, ``backward``, ``optimizer step``,
    ``optimizer state creation``; ``None`` where the recording did not say (older saves).

    From the tracer's tags: the ``phase`` the step was in, the allocation's category (optimizer
    state made inside ``optimizer.step()``: torch/optim/adam.py ``_init_group`` makes
    ``exp_avg`` / ``exp_avg_sq`` with ``zeros_like`` at a parameter's first step), and for the
    loss its op or module (a ``...Loss`` module, or log_softmax / nll_loss called outside one).
    """
    op = (oom.op or "").removeprefix("aten.").split(".")[0].lstrip("_")
    module = (oom.module or "").rsplit(".", 1)[-1]
    if oom.phase == "optimizer":
        return "optimizer state creation" if oom.category == "optimizer_state" else "optimizer step"
    if oom.phase == "backward":
        return "backward"
    if oom.phase in ("forward", "user") and (op in _LOSS_OPS or module.endswith("Loss")):
        return "loss"
    return "forward" if oom.phase == "forward" else None


def oom_place(oom: OomPoint) -> str:
    """Where an OOM happens, in words, for the verdict.

    ``in optimizer.step(): AdamW state for layers.7.mlp.gate_proj.weight (aten.zeros_like.default)``;
    ``in the backward pass in layers.3.attn (aten.mm.default)``; ``in the forward pass in h.0``.
    """
    phase = oom_phase(oom)
    op = "" if oom.op is None else f" ({oom.op})"
    module = "" if oom.module is None else f" in {module_label(oom.module)}"
    if phase in ("optimizer state creation", "optimizer step"):
        if oom.category == "optimizer_state" and oom.parameter is not None:
            owner = f"{oom.optimizer} state" if oom.optimizer else "optimizer state"
            return f"in optimizer.step(): {owner} for {oom.parameter}{op}"
        by = f" ({oom.optimizer})" if oom.optimizer else ""
        return f"in optimizer.step(){by}{module}{op}"
    if phase == "backward":
        grad = f": the gradient of {oom.parameter}" if oom.parameter is not None else ""
        return f"in the backward pass{module}{grad}{op}"
    if phase == "loss":
        return f"in the loss{module}{op}"
    if phase == "forward":
        return f"in the forward pass{module}{op}"
    return f"{module.lstrip()}{op}".strip() or "in the step"


def header_line(prediction: Prediction) -> str:
    """What was predicted, on which GPU and allocator setting."""
    p = prediction
    return (
        f"{p.description or 'step'} on {p.gpu.name} ({format_bytes(p.capacity_bytes)} total, "
        f"{format_bytes(p.context_overhead_bytes)} outside PyTorch, "
        f"allocator settings: {p.alloc_conf or 'default'})"
    )


def _more(left_out: int, nbytes: int, modules: int | None = None) -> str:
    """``  (19 more rows: 63 modules, 1.41 GiB)``: what a list left out."""
    what = f"{left_out} more row{'s' if left_out != 1 else ''}"
    if modules is not None:
        what += f": {modules} module{'s' if modules != 1 else ''}"
    return f"  ({what}, {format_bytes(nbytes)})"


def prediction_summary(prediction: Prediction, rows: int = SUMMARY_ROWS) -> str:
    """The verdict and the top lines of a prediction, as plain text (``str(prediction)``).

    Args:
        prediction: the prediction.
        rows: categories and module rows to list (repeated layers merged into one row); the
            rest are counted in a last line.

    Returns:
        Lines: what and where, the verdict, the OOM message's first line when it does not fit,
        the largest categories and modules at the peak allocated, every warning.
    """
    p = prediction
    lines = [header_line(p), verdict_line(p), *rank_peak_lines(p)]
    if p.distributed is not None:  # NCCL's buffers and the timing range (distributed_memory.py)
        lines.extend(p.distributed.lines())
    if p.oom is not None:
        lines.append(f"  {p.oom.message.splitlines()[0] if p.oom.message else ''}".rstrip())
    at = p.peak_allocated_at
    if at.allocated_bytes:
        when = "before the first step" if at.step is None else f"step {at.step}"
        lines.append(
            f"at peak allocated ({when}): {format_bytes(at.allocated_bytes)} allocated, "
            f"{format_bytes(at.reserved_bytes)} reserved"
        )
        categories = list(at.by_category_bytes.items())
        width = max(len(name) for name, _ in categories)
        lines.extend(f"  {name:<{width}}  {format_bytes(n):>10}" for name, n in categories[:rows])
        if len(categories) > rows:
            lines.append(_more(len(categories) - rows, sum(n for _, n in categories[rows:])))
        groups = group_modules(at.modules or at.top_modules)
        if groups:
            lines.append("largest modules at peak allocated:")
            shown = groups[:rows]
            labels = [module_label(g.describe() if g.layers > 1 else g.label) for g in shown]
            width = max(len(label) for label in labels)
            lines.extend(
                f"  {label:<{width}}  {format_bytes(g.total_bytes):>10}"
                for label, g in zip(labels, shown, strict=True)
            )
            if len(groups) > rows:
                rest = groups[rows:]
                nbytes = sum(g.total_bytes for g in rest)
                lines.append(_more(len(rest), nbytes, sum(g.layers for g in rest)))
    lines.extend(f"warning: {warning}" for warning in p.warnings)
    return "\n".join(lines)
