"""A plan on a local Ray cluster equals the local pool's, even when a worker dies mid-plan."""

from __future__ import annotations

import dataclasses
import os
import sys
from types import MappingProxyType

import pytest

from oomkit.executors import LocalPoolExecutor, RayExecutor
from oomkit.scenario.planning import PlanRequest, plan, predict_candidate

# 6 layouts of gpt2-124m at seq 64 on 1-2 L40S (single, FSDP 2, DDP 2; micro-batch 1-2; no
# AC): tests/scenario/test_planning.py checks the enumeration itself (12 with AC none/full).
# The executor is this module's subject, not the model: each candidate is predicted (the real
# ``predict_candidate``, in the executor's worker) on a one-layer GPT-2 standing in for
# gpt2-124m (``_tiny_candidate``), 6 predictions in 3 s of CPU instead of 23.
SIX = PlanRequest(
    "gpt2-124m", 4, 64, ("l40s",), max_gpus=2, checkpointing=("none",),
    precisions=("bf16-mixed",), max_micro_batch=2,
)
# Its 2 single-GPU layouts.
TWO = PlanRequest(
    "gpt2-124m", 4, 64, ("l40s",), max_gpus=1, checkpointing=("none",),
    precisions=("bf16-mixed",), max_micro_batch=2,
)


# One block of width 256 and a vocabulary of 8192 (gpt2-124m: 12 blocks of 768, 50257).
_TINY_SHAPE = {"hidden": 256, "layers": 1, "heads": 4, "vocab": 8192, "positions": 512}


def _tiny_candidate(data):
    """``predict_candidate(data)`` with preset gpt2-124m built one block deep, in whichever
    process runs it (a forked pool worker, a Ray worker: this function travels by value)."""
    from oomkit.prediction.models import presets
    from oomkit.prediction.models.gpt2 import GPT2Shape

    real = presets.PRESETS
    tiny = dataclasses.replace(real["gpt2-124m"], shape=GPT2Shape(**_TINY_SHAPE))
    presets.PRESETS = MappingProxyType({**real, "gpt2-124m": tiny})
    try:
        return predict_candidate(data)
    finally:
        presets.PRESETS = real


@pytest.fixture(scope="module")
def ray_cluster(ray_session):
    ray = ray_session
    # The workers cannot import this test module: its functions travel by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def local_plan():
    return plan(SIX, LocalPoolExecutor(2), predictor=_tiny_candidate)


def test_six_candidate_plan_on_ray_equals_the_local_pool(ray_cluster, local_plan):
    """Every candidate, its figures and the ranking are the local pool's."""
    seen: list[int] = []
    on_ray = plan(SIX, RayExecutor(), progress=lambda d, t: seen.append(d),
                  predictor=_tiny_candidate)
    assert on_ray == local_plan
    assert len(on_ray.candidates) == 6 and on_ray.predicted == 6
    assert all(c.fits and c.peak_reserved_bytes for c in on_ray.candidates)
    assert seen == list(range(7))
    # The best (first ranked) layout of each strategy, in MiB: one layer of width 256 holds so
    # little that FSDP 2's gathered block and buffers outweigh the state it shards.
    best = {c.layout.strategy: c.peak_reserved_bytes >> 20 for c in reversed(on_ray.candidates)}
    assert best == {"single": 100, "ddp": 100, "fsdp": 112}


def test_a_worker_killed_mid_plan_loses_no_candidate(ray_cluster, local_plan, tmp_path):
    """The second prediction's worker exits (os._exit) once: Ray runs it again, and every
    candidate is there once, with the local pool's figures."""
    marker = str(tmp_path / "killed")

    def dies_once(data):
        if data["step"]["batch"] == 2 and data["step"]["checkpointing"] == "none":
            if not os.path.exists(marker):
                open(marker, "w").close()
                os._exit(1)
        return _tiny_candidate(data)

    seen: list[int] = []
    result = plan(TWO, RayExecutor(max_retries=2), progress=lambda d, t: seen.append(d),
                  predictor=dies_once)
    assert os.path.exists(marker)
    assert seen == [0, 1, 2]
    assert len({c.layout for c in result.candidates}) == 2
    reference = {c.layout: c for c in local_plan.candidates}
    for candidate in result.candidates:
        assert candidate == reference[candidate.layout]
