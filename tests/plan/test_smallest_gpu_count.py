"""How many GPUs of which kind: GPU counts x GPUs for a global batch, one recording per count."""

from __future__ import annotations

import dataclasses

import pytest

from oomkit.core.gpus import get_gpu
from oomkit.core.target import Target
from oomkit.plan.smallest_gpu import gpu_counts, smallest_gpu_count
from oomkit.prediction.predictor import predict_recording

torch = pytest.importorskip("torch")

GLOBAL_BATCH = 131072
MiB = 2**20


def _record(count: int, per_rank: int, target: Target):
    """Rank 0 of two 512-wide Linear units under FSDP2 (count > 1) or plain (count 1)."""
    from oomkit.prediction.tracing import trace_step
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    def build(mesh=None):
        from torch.distributed.fsdp import fully_shard

        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
        if mesh is not None:
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        batch = torch.randn(per_rank, 512)

        def step(*_):
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, (model, optimizer, batch)

    if count == 1:
        with torch.device("meta"):
            step, track = build()
        return trace_step(step, *track, steps=2, target=target), "plain"
    return trace_distributed_step(build, world_size=count, steps=2, target=target), f"{count}"


def test_gpu_counts_are_powers_of_two_that_divide():
    """Counts 1, 2, 4, ... up to the maximum; those that do not divide the batch are skipped."""
    assert gpu_counts(12, 64) == ((1, 2, 4), (8, 16, 32, 64))
    assert gpu_counts(64, 10) == ((1, 2, 4, 8), ())
    with pytest.raises(ValueError, match="max_gpus"):
        gpu_counts(8, 0)


def test_table_names_the_fewest_gpus_of_each_kind():
    """Three GPUs sized just above rank 0's peak at 1, 2 and 4 ranks: each fits from its own
    count on; every count is recorded once and replayed on all three."""
    target = Target.resolve(gpu="h100")
    calls: list[tuple[int, int]] = []

    recorded = {n: _record(n, GLOBAL_BATCH // n, target) for n in (1, 2, 4)}

    def record(count, per_rank, on):
        calls.append((count, per_rank))
        assert on == target
        return recorded[count]

    peaks = {
        n: predict_recording(recorded[n][0], target=target).peak_reserved_bytes for n in (1, 2, 4)
    }
    assert peaks[1] > peaks[2] > peaks[4]
    h100 = get_gpu("h100")
    gpus = [
        dataclasses.replace(
            h100, name=name, total_memory_bytes=peaks[n] + 2 * MiB, context_overhead_bytes=0
        )
        for name, n in (("small", 4), ("mid", 2), ("big", 1))
    ]
    result = smallest_gpu_count(
        record, GLOBAL_BATCH, max_gpus=4, candidates=gpus, margin_bytes=0, target=target
    )
    assert calls == [(1, 131072), (2, 65536), (4, 32768)]
    assert result.traces == 3 and result.skipped_counts == ()
    assert [row.per_rank_batch for row in result.rows] == [131072, 65536, 32768]
    table = [[fit.fits for fit in row.candidates] for row in result.rows]
    assert table == [[False, False, True], [False, True, True], [True, True, True]]
    assert result.fewest == {"big": 1, "mid": 2, "small": 4}
    assert [fit.headroom_bytes for fit in result.rows[2].candidates][0] == 2 * MiB
    best = min((n * (peaks[n] + 2 * MiB), n) for n in (1, 2, 4))
    assert result.least_memory is not None and result.least_memory[0] == best[1]
    assert any("recorded once with H100 SXM 80GB's kernels" in w for w in result.warnings)
