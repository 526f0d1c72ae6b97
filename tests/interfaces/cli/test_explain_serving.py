"""`oomkit explain` answers a vLLM / SGLang start-up log with its figures and the knob to turn."""

from __future__ import annotations

import json

from oomkit.interfaces.cli import main

NO_BLOCKS = (
    "INFO 04-07 06:07:16 [core.py:53] Initializing a V1 LLM engine (v0.8.1) with config: "
    "model='meta-llama/Llama-3.3-70B-Instruct'\n"
    "ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine.\n"
)


def test_a_vllm_failure_is_answered_with_the_knob(tmp_path, capsys):
    """'No available memory for the cache blocks' exits 1 naming --gpu-memory-utilization."""
    log = tmp_path / "vllm.log"
    log.write_text(NO_BLOCKS)
    assert main(["explain", str(log), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)["serving"]
    assert out["engine"] == "vllm" and out["failure"] is not None
    assert "gpu_memory_utilization" in json.dumps(out["knobs"]) or "gpu-memory-utilization" in json.dumps(out["knobs"])


def test_a_plain_oom_message_is_not_read_as_an_engine_log(capsys):
    """A CUDA OOM message without engine words goes to the OOM diagnosis as before."""
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
            "total capacity of 23.55 GiB of which 1.06 GiB is free. Of the allocated memory 20.31 "
            "GiB is allocated by PyTorch, and 1.72 GiB is reserved by PyTorch but unallocated.")
    assert main(["explain", text, "--json"]) == 0
    assert "serving" not in json.loads(capsys.readouterr().out)
