"""What `oomkit serve vllm` costs from a terminal, on a Llama-3.1-8B config (target: under 10 s).

Each run is a fresh process (``python -c`` building the ``serve`` parser and calling ``run``, as
the ``oomkit serve vllm`` command will once it is registered in ``cli/__init__.py``), timed from
start to exit, start-up (torch and transformers imported) included, with ``--json``. The config
is Llama-3.1-8B's ``config.json`` (written to a temporary folder: no network). Next to it, the
floor: ``python -c "import torch, torch._dynamo"`` (torch, and the dynamo modules the tracer's
dispatch modes load; Llama-family configs are built without transformers). ``--repeat`` runs each (default 3); the
median is reported, with the machine's load before and after.

Prints a line, then one JSON line:
{"serve_vllm_s": [...], "import_floor_s": [...], "median_serve_vllm_s": ..., "machine": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# meta-llama/Llama-3.1-8B-Instruct config.json.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
}

_CHILD = """
import argparse, sys
from oomkit.interfaces.cli import serve
parser = argparse.ArgumentParser(prog="oomkit")
serve.add_parser(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(["serve", "vllm", sys.argv[1], "--gpu", "h100", "--max-model-len",
                          "16000", "--json"])
sys.exit(args.run(args))
"""


def _time(argv: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{argv[:3]} failed ({done.returncode}): {done.stderr[-500:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "config.json"), "w") as out:
            json.dump(LLAMA_31_8B, out)
        serve_s, floor_s = [], []
        _time([sys.executable, "-c", _CHILD, folder])  # untimed: writes cached bytecode
        for _ in range(args.repeat):
            serve_s.append(_time([sys.executable, "-c", _CHILD, folder]))
            floor_s.append(_time([sys.executable, "-c", "import torch, torch._dynamo"]))
    median = statistics.median(serve_s)
    machine = {"cores": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()}
    print(f"oomkit serve vllm (Llama-3.1-8B config, H100): median {median:.2f} s "
          f"(import torch + torch._dynamo floor {statistics.median(floor_s):.2f} s; "
          f"load {load_before[0]:.1f} -> {machine['load_after'][0]:.1f})")
    print(json.dumps({"serve_vllm_s": serve_s, "import_floor_s": floor_s,
                      "median_serve_vllm_s": median, "machine": machine}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
