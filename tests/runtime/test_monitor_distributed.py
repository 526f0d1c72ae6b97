"""Monitor under torch.distributed (2 CPU processes, gloo): per-rank logs, rank 0 gathers all."""

from __future__ import annotations

import textwrap

import pytest
from _gloo import run_two_ranks

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from oomkit.interfaces.reports.monitor import build_monitor_report  # noqa: E402

MiB = 2**20

# Rank r keeps (r + 1) * 4 MiB alive over 3 steps on its own simulated 64 MiB device.
_WORKER = textwrap.dedent(
    """
    import datetime, json, os, sys
    import torch, torch.distributed as dist
    from oomkit.runtime import SimulatedCudaDevice
    from oomkit.runtime.monitor import Monitor

    rank, store, log_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    kept = []
    with SimulatedCudaDevice("64MiB", context_overhead_bytes=0):
        with Monitor(log_path=f"{log_dir}/mem_{{rank}}.jsonl") as monitor:
            for _ in range(3):
                kept.append(torch.empty((rank + 1) * 4 * 2**20, dtype=torch.uint8))
                monitor.step()
            gathered = monitor.gather()
    again = monitor.gather()  # after the with block: rank 0 appends to its closed log
    out = {
        "log_path": str(monitor.log_path),
        "ranks_in_records": sorted({r.rank for r in monitor.records}),
        "gathered": None if gathered is None else [
            [s.rank, s.steps, s.peak_allocated_bytes] for s in gathered],
        "again": None if again is None else len(again),
    }
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
    # Gloo's C++ worker threads can still hold work objects at interpreter finalization and
    # abort it ('terminate called without an active exception', about 1 run in 12 here, after
    # every result is printed; pytorch/pytorch#179291): leave without finalizing.
    os._exit(0)
    """
)



@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("monitor_dist")
    log_dir = root / "logs"
    log_dir.mkdir()
    return run_two_ranks(root, _WORKER, str(log_dir), timeout_s=60), log_dir


def test_each_rank_records_its_own_numbers(ranks):
    """Rank r's log is mem_r.jsonl and its records carry rank r."""
    outputs, log_dir = ranks
    for rank, out in enumerate(outputs):
        assert out["log_path"] == str(log_dir / f"mem_{rank}.jsonl")
        assert out["ranks_in_records"] == [rank]


def test_rank_0_gathers_every_rank_summary(ranks):
    """gather(): rank 0 gets both summaries (12 and 24 MiB kept) and logs them; rank 1 gets None."""
    outputs, _ = ranks
    assert outputs[0]["gathered"] == [[0, 3, 12 * MiB], [1, 3, 24 * MiB]]
    assert outputs[1]["gathered"] is None
    assert (outputs[0]["again"], outputs[1]["again"]) == (2, None)
    _, log_dir = ranks
    assert (log_dir / "mem_0.jsonl").read_text().count('"oomkit_ranks"') == 2
    assert "oomkit_ranks" not in (log_dir / "mem_1.jsonl").read_text()


def test_report_shows_every_rank_and_the_worst(ranks):
    """The directory report has both ranks, rank 1 worst; rank 0's log alone shows both too."""
    _, log_dir = ranks
    report = build_monitor_report([log_dir])
    assert [(s.rank, s.peak_allocated_bytes) for s in report.summaries] == [
        (0, 12 * MiB),
        (1, 24 * MiB),
    ]
    assert report.worst.rank == 1 and report.warnings == ()
    alone = build_monitor_report([log_dir / "mem_0.jsonl"])
    assert [s.rank for s in alone.summaries] == [0, 1]
    assert alone.worst.rank == 1
