"""Run a worker script as torch.distributed ranks (gloo, on CPU) and collect their JSON results.

The ranks are separate processes, forked from one launcher process that imported torch (and the
modules the caller names in ``preload``) once: each rank then runs the worker script as
``python worker.py RANK STORE ARGS...`` would (``runpy``, ``__name__ == "__main__"``), without
paying the interpreter's start and ``import torch`` again (about 1 s of CPU per rank, 2 s where
the worker enters a dispatch mode such as ``SimulatedCudaDevice``, whose first op imports
``torch._dynamo``). The launcher is single-threaded Python plus the one native thread
``import torch`` starts, as every forked pool of the other tests (``LocalPoolExecutor``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# What the workers of tests/runtime import (DDP and FSDP2 import dynamo and inductor; a dispatch
# mode's first op imports dynamo): imported once, in the launcher, instead of once per rank.
RANK_IMPORTS = (
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "oomkit.prediction.tracing",
    "oomkit.runtime",
    "oomkit.runtime.batch_probe",
    "oomkit.runtime.monitor",
    "oomkit.runtime.resilient",
)

# argv: script ranks outdir preload(comma-separated, may be empty) freeze(0/1) store extra...
_LAUNCHER = textwrap.dedent(
    """
    import os, runpy, sys, traceback
    import torch, torch.distributed
    script, ranks, outdir, preload, freeze, *rank_args = sys.argv[1:]
    for name in filter(None, preload.split(",")):
        __import__(name)
    if freeze == "1":
        import gc
        gc.collect()
        gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(int(ranks)):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd, suffix in ((1, "out"), (2, "err")):
                    path = os.path.join(outdir, f"rank{rank}.{suffix}")
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
                sys.argv = [script, str(rank), *rank_args]
                sys.path[0] = os.path.dirname(script)
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
    print(" ".join(map(str, codes)), flush=True)
    """
)


def run_two_ranks(root: Path, worker_source: str, *extra_args: str, **options: Any) -> list:
    """``run_ranks`` with ranks 0 and 1 (``options``: its keyword arguments)."""
    return run_ranks(root, worker_source, *extra_args, ranks=2, **options)


def run_ranks(
    root: Path,
    worker_source: str,
    *extra_args: str,
    ranks: int,
    timeout_s: float = 90,
    preload: Sequence[str] = RANK_IMPORTS,
    freeze_imports: bool = False,
) -> list:
    """Run ``worker_source`` as ranks 0 .. ranks-1; each gets ``rank store *extra_args`` as argv.

    ``store`` is a file for ``init_method=f"file://{store}"``: a file rendezvous has no
    free-port race between finding a port and binding it. Each rank must print one JSON line
    last; a rank that fails or hangs past ``timeout_s`` fails the test instead of hanging it.
    ``preload``: modules the launcher imports before it forks the ranks (what the ranks would
    import anyway), so that no rank imports them again. ``freeze_imports``: the launcher then
    moves them out of the cyclic collector's sight (``gc.collect``, ``gc.freeze``, as
    tests/conftest.py does for the test processes), so that a rank's ``gc.collect`` (oomkit's
    ``release_after_oom`` runs one per caught OOM: 0.1-0.2 s each over torch's import graph)
    walks only what the rank made. Not where exact bytes are compared: it changes when the
    automatic collections run, and with them when tensors held in reference cycles are freed
    (the ground truth's launches matched the prediction 4 times in 12 frozen, 8 times not).
    """
    script = root / "worker.py"
    script.write_text(worker_source)
    store = str(root / "rendezvous")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [
        str(script),
        str(ranks),
        str(root),
        ",".join(preload),
        "1" if freeze_imports else "0",
        store,
        *extra_args,
    ]
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # the launcher and its ranks: one group, killed as one
    )
    try:
        stdout, stderr = launcher.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
        errors = "".join(
            f"rank {rank}: {path.read_text()}"
            for rank in range(ranks)
            if (path := root / f"rank{rank}.err").is_file()
        )
        raise AssertionError(
            f"the {ranks} ranks gave no result in {timeout_s:g} s:\n{errors}"
        ) from None
    assert launcher.returncode == 0, stderr
    codes = [int(code) for code in stdout.split()]
    assert len(codes) == ranks, stdout + stderr
    outputs = []
    for rank, code in enumerate(codes):
        rank_err = (root / f"rank{rank}.err").read_text()
        assert code == 0, f"rank {rank} exited with {code}:\n{rank_err}"
        rank_out = (root / f"rank{rank}.out").read_text()
        outputs.append(json.loads(rank_out.strip().splitlines()[-1]))
    return outputs
