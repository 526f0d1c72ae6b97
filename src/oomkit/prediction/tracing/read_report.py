"""What a recording says about the values it read and the compiled code it ran eagerly.

Answered and stated reads are assumptions the prediction rests on (``assumptions``: one entry
per site); stand-ins, stated values never read and ``torch.compile`` are warnings, one line each.
"""

from __future__ import annotations

from collections import Counter

from oomkit.prediction.tracing.value_reads import ValueReads
from oomkit.prediction.tracing.values import KnownValues

__all__ = [
    "COMPILED",
    "COMPILED_EAGERLY",
    "COMPILED_WARNING",
    "compile_assumptions",
    "read_assumptions",
    "read_warnings",
]

# The start of the warning for compiled code (reports mark the verdict with it).
COMPILED_EAGERLY = "torch.compile: traced eagerly"
# How a step recorded with compile=True was recorded (its assumption and warning say so).
COMPILED = "compiled (AOTAutograd partitioner real, Inductor fusion emulated)"
# The start of that step's warning (reports mark the verdict with it).
COMPILED_WARNING = f"torch.compile: {COMPILED}"


def compile_assumptions(graphs: Counter[str]) -> dict[str, str]:
    """What a step recorded with ``compile=True`` that compiled ``graphs`` (by kind, at least
    one) rests on, as one assumption."""
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(graphs.items()))
    return {
        "torch.compile": (
            f"{COMPILED}: dynamo graph capture and AOTAutograd's min-cut partitioner with "
            "Inductor's decompositions ran for real on the meta tensors (" + counts + "); "
            "Inductor's lowering, fusion and buffer reuse are emulated from its rules "
            "(compile_plan.py), SDPA as the fused kernel the target GPU picks, default mode "
            "(no CUDA graphs)"
        )
    }


# GradScaler's overflow check (torch/amp/grad_scaler.py _unscale_grads_), counted when answered.
_SCALER_READ = "torch._amp_foreach_non_finite_check_and_unscale_"


def read_assumptions(reads: ValueReads, known: KnownValues) -> dict[str, str]:
    """``{"read at masking_utils.py:292 in _ignore_causal_mask_sdpa": "bool() = True, ..."}``."""
    out: dict[str, str] = {}
    finite = reads.assumed_finite + known.assumed_finite
    for record in reads.records.values():
        if record.outcome == "stand-in":
            continue
        if _SCALER_READ in finite and record.site.filename.replace("\\", "/").endswith(
            "torch/amp/grad_scaler.py"
        ):
            continue  # GradScaler.step's read of found_inf: the finite-values line says it
        key = f"read at {record.site.key} in {record.site.function}"
        assumed = sorted(o for o in record.origins if o.startswith("assumed: "))
        if record.outcome == "stated":
            how = "as stated (--value / values=)"
        elif assumed:  # an answer for unknown values (value_reads.py says which and why)
            how = "; ".join(assumed)
        else:
            how = "computed from the values your tensors were created with (" + ", ".join(
                sorted(record.origins)
            ) + ")"
        text = f"{record.kind} = {record.value}, {how}; {record.count} time(s)"
        out[key] = f"{out[key]}; {text}" if key in out else text
    if known.nested_fast_paths:
        # torch/nn/modules/transformer.py TransformerEncoder.forward: a left-aligned padding
        # mask in inference turns the batch into nested tensors (padding dropped); the fast
        # path refuses devices other than cpu/cuda, meta included, so the recording ran the
        # padded layers.
        out["TransformerEncoder fast path"] = (
            f"nn.TransformerEncoder was called {known.nested_fast_paths} time(s) in inference "
            "with a padding mask that qualifies for its nested-tensor fast path, which a GPU "
            "run may take (padding dropped, fused layers); predicted as the padded layers run, "
            "which hold at least as much (an upper bound)"
        )
    if finite:
        ops = ", ".join(f"{name} x{n}" for name, n in sorted(finite.items()))
        out["finite values"] = (
            f"tests of unknown tensors for nan/inf ({ops}) answered as for finite values, as in a "
            "training run that proceeds"
        )
        if _SCALER_READ in finite:
            # torch/amp/grad_scaler.py step: optimizer.step() runs only when found_inf is 0.
            out["finite values"] += (
                "; so GradScaler skipped no optimizer step (its scale, growth tracker, found_inf "
                "and unscale_'s temporaries are recorded as torch allocates them). On a GPU, "
                "fp16's first steps may overflow at the initial scale of 65536 and be skipped, "
                "which creates the optimizer state a step or more later, not a higher peak"
            )
    if reads.generation_goes_on:
        out["generation length"] = (
            f"transformers' generate asked {reads.generation_goes_on} time(s) whether every "
            "sequence had ended, answered 'not yet' (the new tokens are unknown, so no "
            "end-of-sequence token is seen): it runs to its length limit (max_new_tokens), the "
            "most memory the call can take"
        )
    return out


def read_warnings(
    reads: ValueReads, compiled: Counter[str], *, compiled_recorded: bool = False
) -> list[str]:
    """One line per stand-in site, per stated value never read, and one for torch.compile.

    ``compiled_recorded``: compiled code was recorded as compiled (``compile=True``), not
    eagerly; the line then says what of it is emulated and by how much it may differ.
    """
    out = []
    for record in reads.records.values():
        if record.outcome != "stand-in":
            continue
        key = record.site.key
        if record.kind == "float()":
            fate = (
                "it got 1.0, a plain float (Python does not keep a checked stand-in through "
                "float()), so oomkit cannot tell whether it decided a size or a branch; read "
                "it with .item() to have that checked"
            )
        else:
            fate = (
                "it got a stand-in (printed as nan; 1.0, finite, as a number), which was only "
                "printed, logged or passed on, never used as a size, a loop bound or a condition"
            )
        out.append(
            f"{record.site.describe()}: {record.kind} read a tensor value that oomkit cannot know "
            f"without a GPU ({record.count} time(s)); {fate}. If it matters, state it: "
            f"--value {key}=NUMBER (values={{{key!r}: NUMBER}} in oomkit.predict)"
        )
    for key in reads.unused_stated():
        out.append(
            f"the value stated for {key} was never used: no tensor value was read at that line "
            "(name the line of the .item() / float() / bool() call, or a line of a library "
            "function on the stack when it reads)"
        )
    if compiled and compiled_recorded:
        sites = ", ".join(f"{where} ({n}x)" for where, n in sorted(compiled.items()))
        out.append(
            f"{COMPILED_WARNING}; compiled code was entered {sum(compiled.values())} "
            f"time(s) ({sites}). Inductor cannot lower for CUDA without a GPU and Triton, so "
            "which intermediates its fused kernels materialise and how its wrapper reuses "
            "buffers follow its rules, not its scheduler: the compiled regions' transient "
            "memory (never the tensors saved for backward, which are the partitioner's own) "
            "may differ by the intermediates its scheduler fuses differently, at most those "
            "regions' fused pointwise/reduction buffers; not yet measured against a GPU. "
            "Joint-graph pattern rewrites, max-autotune and CUDA graphs "
            "(mode='reduce-overhead') are not modelled"
        )
    elif compiled:
        sites = ", ".join(f"{where} ({n}x)" for where, n in sorted(compiled.items()))
        out.append(
            f"{COMPILED_EAGERLY}: compiled code was entered {sum(compiled.values())} time(s) "
            f"({sites}) and recorded as eager PyTorch runs it. Inductor's fused kernels (fewer "
            "tensors saved for backward, intermediates never materialised) and CUDA graphs' "
            "private pools are not modelled, so the compiled step's memory may differ; record "
            "it as compiled with --compile (compile=True in oomkit.predict)"
        )
    return out
