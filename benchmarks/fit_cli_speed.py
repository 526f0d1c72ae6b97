"""What `oomkit fit` costs from a terminal next to its first probe and to `oomkit predict` of one size.

``benchmarks/fit_speed.py`` times a search inside one warm process, from the call to
``max_batch_size``; this times what a user waits for at the prompt: each command in a fresh
process (``python -c`` calling what the ``oomkit`` command runs,
``oomkit.interfaces.cli.console_main``), from the moment it is started until it exits, start-up
(torch imported) and shut-down included:
- ``fit``: ``oomkit fit PRESET ... --json``, as a user runs it (the preset's sizes traced ahead,
  one process per core), and within it the moment its first probe (batch 1) was predicted:
  ``BatchProber._report``'s first call, written to stderr with the wall clock;
- ``predict``: ``oomkit predict PRESET --batch 1 --steps 2 ... --json``, the first probe as a
  command of its own (a probe records 2 steps, `predict` 3 by default);
- ``import torch``: ``python -c "import torch"``, the floor under both.

Cases as ``fit_speed.py``'s (``--case``, or ``all``). The children write and read cached
bytecode, as an installed package has it (after one untimed run). Each command runs
``--repeat`` times (default 3), alternating, and the median wall seconds are reported, with the ratios "fit /
first probe in fit" and "fit / predict". State of the machine (cores, load average before and
after) beside the figures.

Prints a line per case, then, last, one JSON line:
{"cases": {"gpt2": {"fit_s": [...], "fit_first_probe_s": [...], "predict_s": [...],
 "import_torch_s": [...], "median": {...}, "fit_over_first_probe": ..., "fit_over_predict": ...,
 "batch_size": ...}}, "machine": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _children import emit

# --case: the CLI arguments of `oomkit fit` (and of `oomkit predict`, with --batch 1), as
# fit_speed.py's CASES: GPT-2 124M at seq 1024; Llama 3.2 1B at seq 2048, every weight trained;
# Llama 3.1 8B at seq 2048 with LoRA r 16. Every one on an H100, bf16-mixed, AdamW.
CASES = {
    "gpt2": ["gpt2-124m", "--gpu", "h100"],
    "llama-1b": ["llama-1b", "--gpu", "h100"],
    "llama-8b-lora": ["llama-8b", "--seq", "2048", "--lora", "16", "--gpu", "h100"],
}

# What the child runs: the entry point, with the first probe's moment written to stderr.
_CHILD = """
import sys, time
from oomkit.plan import batch_prober
report = batch_prober.BatchProber._report
def first(self, remaining, _report=report):
    if self._made == 0:
        sys.stderr.write(f"OOMKIT-FIRST-PROBE {time.time():.6f}\\n")
    _report(self, remaining)
batch_prober.BatchProber._report = first
from oomkit.interfaces.cli import console_main
console_main()
"""


# The children cache their bytecode as an installed package has it (pip compiles a wheel's
# modules when it installs them); a development shell's PYTHONDONTWRITEBYTECODE would have every
# command compile oomkit's modules again (about 0.2 s).
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run_command(argv: list[str]) -> tuple[float, float | None, dict | None]:
    """(wall seconds from start to exit, seconds to the first probe or None, its JSON or None)."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True,
                          check=False, env=_ENV)
    wall_s = time.time() - start
    if proc.returncode not in (0, 1):  # 1: fit found nothing that fits, still an answer
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"oomkit {' '.join(argv)} exited {proc.returncode}")
    first_s = None
    for line in proc.stderr.splitlines():
        if line.startswith("OOMKIT-FIRST-PROBE "):
            first_s = float(line.split()[1]) - start
            break
    payload = None
    if "--json" in argv and proc.stdout.strip():
        payload = json.loads(proc.stdout)
    return wall_s, first_s, payload


def import_torch_s() -> float:
    """Wall seconds of ``python -c "import torch"``."""
    start = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, env=_ENV)
    return time.time() - start


def run_case(name: str, repeat: int) -> dict:
    """Every command of one case ``repeat`` times, alternating; the medians and ratios."""
    args = CASES[name]
    fit_s, first_s, predict_s, torch_s = [], [], [], []
    batch_size = None
    run_command(["predict", *args, "--batch", "1", "--steps", "1", "--json"])  # writes bytecode
    for _ in range(repeat):
        wall, first, payload = run_command(["fit", *args, "--json"])
        if first is None:
            raise SystemExit(f"oomkit fit {' '.join(args)} made no probe")
        fit_s.append(round(wall, 2))
        first_s.append(round(first, 2))
        batch_size = None if payload is None else payload.get("batch_size")
        wall, _, _ = run_command(["predict", *args, "--batch", "1", "--steps", "2", "--json"])
        predict_s.append(round(wall, 2))
        torch_s.append(round(import_torch_s(), 2))
    median = {
        "fit_s": round(statistics.median(fit_s), 2),
        "fit_first_probe_s": round(statistics.median(first_s), 2),
        "predict_s": round(statistics.median(predict_s), 2),
        "import_torch_s": round(statistics.median(torch_s), 2),
    }
    return {
        "argv": ["fit", *args],
        "batch_size": batch_size,
        "fit_s": fit_s,
        "fit_first_probe_s": first_s,
        "predict_s": predict_s,
        "import_torch_s": torch_s,
        "median": median,
        "fit_over_first_probe": round(median["fit_s"] / median["fit_first_probe_s"], 2),
        "fit_over_predict": round(median["fit_s"] / median["predict_s"], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=(*CASES, "all"), default="all", help="what to search")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command (default 3)")
    parser.add_argument("--write", metavar="PATH", help="also write the JSON result to PATH")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat: at least 1")
    state = {"cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)}
    cases = {}
    for name in CASES if args.case == "all" else (args.case,):
        result = cases[name] = run_case(name, args.repeat)
        median = result["median"]
        print(f"{name:>14}: fit {median['fit_s']:.2f} s (batch {result['batch_size']}), its first "
              f"probe done at {median['fit_first_probe_s']:.2f} s; predict --batch 1 "
              f"{median['predict_s']:.2f} s; import torch {median['import_torch_s']:.2f} s; fit / "
              f"first probe {result['fit_over_first_probe']:.2f}, fit / predict "
              f"{result['fit_over_predict']:.2f} (medians of {args.repeat}; load average "
              f"{os.getloadavg()[0]:.2f})")
    state["load_average_1m_after"] = round(os.getloadavg()[0], 2)
    emit({"cases": cases, "machine": state}, args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
