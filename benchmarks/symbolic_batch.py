"""Why `fit` traces sizes instead of one symbolic batch: a symbolic trace next to concrete ones.

A `fit` search costs as many traces as it makes (benchmarks/fit_speed.py). One recording with
the batch left symbolic would answer every batch at once: under ``FakeTensorMode`` with a
``ShapeEnv`` (what dynamo uses for dynamic shapes, torch/fx/experimental/symbolic_shapes.py) the
batch can be a ``SymInt``, every size the recorder sees is then an expression in it
(``256*s0``), and a code path chosen by size leaves a guard (GPT-2's embedding backward:
``1024*s0 > 3072``) that says for which batches the recording holds. This prototype records the
``gpt2-124m`` preset (seq 1024, bf16-mixed, AdamW, 2 steps, H100) that way, with the model the
concrete probes share (its meta parameters are turned into fake tensors as ops meet them), and
prints, in CPU seconds (``time.process_time``):
- ``concrete``: a traced batch (1, the first probe, then ``--batch``), as a `fit` probe records it;
- ``symbolic``: the same step with the batch a ``SymInt`` hinted at ``--batch``;
- the guards left, the range of batches they allow, and whether the symbolic recording,
  evaluated at ``--batch``, has the concrete recording's event count and sizes.
Last, one JSON line with the figures and the machine (cores, load average).

Measured 2026-11-26 on the 2-core machine: the symbolic trace costs about 6x a concrete one
(FakeTensor dispatch and sympy-backed ``SymInt`` arithmetic on every size), and meta parameters
converted to fake ones get new storages, which the recorder sees as allocations a concrete trace
does not make. So one symbolic trace costs more than the four or five concrete ones a search
makes, and is not what `fit` does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--batch", type=int, default=8, help="the batch traced, and the hint (>= 2)"
    )
    args = parser.parse_args()
    if args.batch < 2:
        parser.error("--batch must be at least 2: ShapeEnv specializes sizes 0 and 1")

    import sympy
    import torch
    import torch._dynamo  # noqa: F401  (imported on first use anyway: not a trace's cost)
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from oomkit.core.target import Target
    from oomkit.plan.batch_probe import new_model_cache, record_step
    from oomkit.prediction.models import StepOptions, build_preset_step

    target = Target.resolve("h100")
    models = new_model_cache()

    def build(batch: Any) -> Any:
        options = StepOptions(
            batch_size=args.batch, seq_len=1024, precision="bf16-mixed", optimizer="adamw"
        )
        # StepOptions checks for a whole number; the symbolic batch replaces it afterwards.
        object.__setattr__(options, "batch_size", batch)
        return build_preset_step("gpt2-124m", options)

    def timed(fn: Any) -> tuple[Any, float]:
        start = time.process_time()
        result = fn()
        return result, round(time.process_time() - start, 2)

    _, first_s = timed(
        lambda: record_step(build, "train step", 1, target=target, steps=2, models=models)
    )
    concrete, concrete_s = timed(
        lambda: record_step(build, "train step", args.batch, target=target, steps=2, models=models)[
            0
        ]
    )
    shapes = ShapeEnv()
    symbol = shapes.create_symbol(
        args.batch, ConstantSource("batch_size"), dynamic_dim=DimDynamic.DYNAMIC
    )
    batch = shapes.create_symintnode(symbol, hint=args.batch)
    with FakeTensorMode(shape_env=shapes, allow_non_fake_inputs=True):
        symbolic, symbolic_s = timed(
            lambda: record_step(
                lambda _: build(batch),
                "train step",
                args.batch,
                target=target,
                steps=2,
                models=models,
            )[0]
        )

    def size_at(size: Any) -> int:
        expr = size.node.expr if isinstance(size, torch.SymInt) else size
        return int(sympy.sympify(expr).subs(symbol, args.batch))

    evaluated = [(e.action, size_at(e.size)) for e in symbolic.events]
    traced = [(e.action, e.size) for e in concrete.events]
    valid = shapes.var_to_range.get(symbol)
    result = {
        "first_probe_cpu_s": first_s,
        "concrete_cpu_s": concrete_s,
        "symbolic_cpu_s": symbolic_s,
        "symbolic_over_concrete": round(symbolic_s / concrete_s, 2) if concrete_s else None,
        "guards": [str(guard.expr) for guard in shapes.guards],
        "batches_allowed": None if valid is None else [str(valid.lower), str(valid.upper)],
        "events_concrete": len(traced),
        "events_symbolic": len(evaluated),
        "same_events": evaluated == traced,
        "machine": {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)},
    }
    print(
        f"gpt2-124m, seq 1024, 2 steps: first probe (batch 1) {first_s:.2f} s CPU, batch "
        f"{args.batch} traced {concrete_s:.2f} s, symbolic {symbolic_s:.2f} s "
        f"({result['symbolic_over_concrete']}x); guards {result['guards']} (batches "
        f"{result['batches_allowed']}); events {len(evaluated)} symbolic vs {len(traced)} traced, "
        f"same: {result['same_events']} (load average {os.getloadavg()[0]:.2f})"
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
