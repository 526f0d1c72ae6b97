"""Run a worker script as torch.distributed ranks (gloo, on CPU) and collect their JSON results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_two_ranks(root: Path, worker_source: str, *extra_args: str, timeout_s: float = 90) -> list:
    """``run_ranks`` with ranks 0 and 1."""
    return run_ranks(root, worker_source, *extra_args, ranks=2, timeout_s=timeout_s)


def run_ranks(
    root: Path, worker_source: str, *extra_args: str, ranks: int, timeout_s: float = 90
) -> list:
    """Run ``worker_source`` as ranks 0 .. ranks-1; each gets ``rank store *extra_args`` as argv.

    ``store`` is a file for ``init_method=f"file://{store}"``: a file rendezvous has no
    free-port race between finding a port and binding it. Each rank must print one JSON line
    last; a rank that fails or hangs past ``timeout_s`` fails the test instead of hanging it.
    """
    script = root / "worker.py"
    script.write_text(worker_source)
    store = str(root / "rendezvous")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), store, *extra_args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(ranks)
    ]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, stderr
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return outputs
