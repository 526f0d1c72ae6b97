"""Start-up of each command against a bare Python, apart from the work the command does.

Issue 41 item 4: every command's own start-up at most 3x the CPU of a bare Python that imports
argparse, json, pickle, dataclasses and pathlib. Each command runs in a fresh process (as
``python -m oomkit`` does: ``console_main``'s garbage-collector thresholds, then
``main(argv)``), twice in that process; the second run's CPU is the work alone (its imports are
done), so

    start-up = the process's CPU up to the end of the first run - the second run's CPU,

which counts the interpreter, every import (lazy ones inside ``run`` too), building and parsing
the command line, and first-call costs. Also printed: ``to parse``, the process's CPU once the
command's parser has parsed its words (the CLI and the subcommand's module imported, nothing
run). The baseline is the CPU of a process that imports the five modules (median of the runs).
Commands marked ``(torch)`` import torch for their work (``predict``; ``doctor``, which asks the
running torch about its allocator; ``presets``, which are PyTorch modules) and are listed with
torch's import in their start-up, which no CLI change can remove; the target is for the others
(``target_met`` in the JSON).

CPU time (the child's ``resource.getrusage``, interpreter start included), because the machine
may be shared. The children cache bytecode as an installed package does (a development shell's
``PYTHONDONTWRITEBYTECODE`` would have every command recompile oomkit's modules), in a folder of
their own (``PYTHONPYCACHEPREFIX``) so that the source tree is left as it is; a first round
fills it and is not counted. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SNAPSHOTS = REPO.parent / "shared" / "snapshots"
SMALL_SNAPSHOT = SNAPSHOTS / "HugePandaCoder__octree-nca-groupeq" / "b6026285a7__my_snapshot.pickle"
OTHER_SNAPSHOT = SNAPSHOTS / "HugePandaCoder__octree-nca-groupeq" / "0cc72993c8__my_snapshot.pickle"
OOM_TEXT = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.65 GiB of which 1.13 GiB is free. Including non-PyTorch memory, this process "
    "has 22.51 GiB memory in use. Of the allocated memory 21.90 GiB is allocated by PyTorch, and "
    "151.04 MiB is reserved by PyTorch but unallocated."
)
BASELINE = "import argparse, json, pickle, dataclasses, pathlib"

# The child: CPU at parse, then two runs of main(argv) (output discarded), as JSON.
_CHILD = r"""
import contextlib, io, json, resource, sys, time

def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

argv = json.loads(sys.argv[1])
try:  # as console_main does first (a tree from before issue 41 item 4 has no such step)
    from oomkit.interfaces.cli import _collect_cycles_rarely
except ImportError:
    pass
else:
    _collect_cycles_rarely()
from oomkit.interfaces.cli import _command_named, build_parser, main, summary_parser
command = _command_named(argv)
parser = summary_parser() if command is None else build_parser(command)
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        parser.parse_args(argv)
    except SystemExit:
        pass
to_parse = cpu()
runs = []
for _ in range(2):
    before = cpu()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    runs.append(cpu() - before)
print(json.dumps({"to_parse_s": to_parse, "first_s": runs[0], "second_s": runs[1],
                  "process_s": cpu(), "code": code}))
"""

_BASELINE_CHILD = BASELINE + r"""
import json, resource
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"process_s": usage.ru_utime + usage.ru_stime}))
"""


def commands(workdir: Path) -> dict[str, list[str]]:
    """Each command measured, by label. Those marked ``(torch)`` import torch to do their work
    (``doctor`` asks the running torch about its allocator; the presets are PyTorch modules)."""
    from oomkit.core.snapshot import load_snapshot
    from oomkit.core.trace import TraceHeader, write_trace

    text = workdir / "oom.txt"
    text.write_text(OOM_TEXT + "\n", encoding="utf-8")
    snapshot = str(SMALL_SNAPSHOT)
    # The small snapshot's trace as an oomkit trace file, for `simulate`.
    trace = workdir / "small.jsonl"
    loaded = load_snapshot(SMALL_SNAPSHOT)
    write_trace(trace, loaded.trace_for(loaded.devices()[0]), TraceHeader(source="snapshot"))
    log = _monitor_log(workdir / "monitor.jsonl")
    script = workdir / "script.py"  # for `run`: its own process's CPU is not counted
    script.write_text("x = 1\n", encoding="utf-8")
    return {
        "help": ["--help"],
        "explain TEXT": ["explain", str(text)],
        "explain SNAPSHOT": ["explain", snapshot],
        "replay SNAPSHOT --verify": ["replay", snapshot, "--verify"],
        "tune SNAPSHOT": ["tune", snapshot, "--jobs", "1"],
        "simulate TRACE": ["simulate", str(trace)],
        "diff SNAPSHOT SNAPSHOT": ["diff", snapshot, str(OTHER_SNAPSHOT)],
        "doctor SNAPSHOT": ["doctor", snapshot],
        "doctor --no-live": ["doctor", "--no-live"],
        "demo": ["demo"],
        "report LOG": ["report", str(log)],
        "run -- python SCRIPT": ["run", "--", sys.executable, str(script)],
        "gpus": ["gpus"],
        "doctor (torch)": ["doctor"],
        "presets (torch)": ["presets"],
        "predict (torch)": ["predict", "gpt2-124m", "--gpu", "h100", "--steps", "1", "--batch", "1"],
    }


class _SteadyDevice:
    """A device for ``oomkit.Monitor`` that reports 8 MiB allocated of 16 MiB reserved."""

    name = "benchmark"

    def memory_stats(self) -> dict[str, int]:
        return {"allocated_bytes.all.current": 2**23, "reserved_bytes.all.current": 2**24}

    def reset_peak_memory_stats(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        return 2**24, 2**25


def _monitor_log(path: Path, steps: int = 20) -> Path:
    """A monitor log of ``steps`` steps, for `report`."""
    from oomkit.runtime.monitor import Monitor

    with Monitor(log_path=path, device=_SteadyDevice()) as monitor:
        for _ in range(steps):
            monitor.step()
    return path


def child(code: str, *args: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, env=env
    )
    if done.returncode != 0:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"child exited {done.returncode}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--only", nargs="*", help="command labels to run (default: all)")
    parser.add_argument("--write", help="also write the JSON line here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = commands(Path(tmp))
        if args.only:
            table = {k: v for k, v in table.items() if k in args.only}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        baseline: list[float] = []
        measured: dict[str, list[dict[str, Any]]] = {label: [] for label in table}
        for round_index in range(args.repeat + 1):  # the first fills the bytecode cache
            base = child(_BASELINE_CHILD, env=env)["process_s"]
            runs = {label: child(_CHILD, json.dumps(argv), env=env) for label, argv in table.items()}
            if round_index:
                baseline.append(base)
                for label, run in runs.items():
                    measured[label].append(run)
    base = statistics.median(baseline)
    print(f"baseline ({BASELINE}): {base * 1000:.0f} ms CPU")
    rows: dict[str, Any] = {}
    for label, runs in measured.items():
        startup = statistics.median(r["to_parse_s"] + r["first_s"] - r["second_s"] for r in runs)
        to_parse = statistics.median(r["to_parse_s"] for r in runs)
        work = statistics.median(r["second_s"] for r in runs)
        rows[label] = {
            "startup_s": round(startup, 4),
            "to_parse_s": round(to_parse, 4),
            "work_s": round(work, 4),
            "ratio": round(startup / base, 2),
            "to_parse_ratio": round(to_parse / base, 2),
            "exit_code": runs[-1]["code"],
            "imports_torch": label.endswith("(torch)"),
        }
        print(
            f"{label:28} start-up {startup * 1000:6.0f} ms = {startup / base:5.2f}x "
            f"(to parse {to_parse / base:4.2f}x), work {work * 1000:6.0f} ms",
            flush=True,
        )
    # The target holds for every command that does not import torch for its work.
    met = all(row["ratio"] <= 3.0 for row in rows.values() if not row["imports_torch"])
    print(f"every command without torch at most 3.0x: {'yes' if met else 'NO'}")
    line = json.dumps(
        {
            "baseline_s": round(base, 4),
            "commands": rows,
            "target_ratio": 3.0,
            "target_met": met,
            "machine": {
                "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "cores": os.cpu_count(),
                "load_average": [round(x, 2) for x in os.getloadavg()],
            },
        }
    )
    print(line)
    if args.write:
        Path(args.write).write_text(line + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
