"""``oomkit predict`` through the recording cache: a hit replays without torch, byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _cli_in_process import CliResult, run_in_process

from oomkit.errors import ScenarioError
from oomkit.scenario.keywords import scenario_from_keywords
from oomkit.scenario.recording_reuse import cache_key, cache_refusal

# The modules of a process that has not imported torch.
FRESH: dict[str, object] = {}
# A small preset step, its defaults left to oomkit (precision, optimizer: notes in the result).
GPT2 = ["gpt2-124m", "--batch", "1", "--seq", "32", "--steps", "2", "--gpu", "h100"]


def oomkit(*argv: str, cache: Path, importtime: bool = False, **env: str):
    command = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "oomkit"]
    environ = {**os.environ, "OOMKIT_CACHE_DIR": str(cache), **env}
    return subprocess.run(
        [*command, *argv], capture_output=True, text=True, env=environ, check=False, timeout=300
    )


def uncached_in_process(argv: list[str]) -> CliResult:
    """``oomkit ARGV`` run in this process with ``OOMKIT_NO_CACHE=1``: recorded (about 0.6 s of
    CPU with torch imported, against 2.8 s for a process of its own), nothing read or kept, and
    the environment put back after (torch sets variables of its own as it runs, such as
    TORCHINDUCTOR_CACHE_DIR, and TORCH* variables are in the key: a process started after must
    get the environment the module's kept recording was keyed with). Only for the uncached run
    a test compares a cached one with, never for the run whose caching or torch import the
    test is about."""
    return run_in_process(argv, environ={"OOMKIT_NO_CACHE": "1"})


def entries(cache: Path) -> list[Path]:
    folder = cache / "recordings"
    return sorted(folder.glob("*.trace.gz")) if folder.is_dir() else []


def imported_torch(stderr: str) -> bool:
    """Whether ``-X importtime``'s lines name torch or any of its submodules."""
    names = [line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if "|" in line]
    return any(name == "torch" or name.startswith("torch.") for name in names)


@pytest.fixture(scope="module")
def gpt2_runs(tmp_path_factory):
    """``predict GPT2 --json`` run cold (recorded and kept, with ``-X importtime``) and uncached
    (``OOMKIT_NO_CACHE=1``), each once for the module: five tests compare with these two runs
    (each a torch import and a recording, about 2.5 s of CPU); a test that writes into the
    cache works on its own copy (``copied_cache``)."""
    base = tmp_path_factory.mktemp("gpt2-runs")
    cold = oomkit("predict", *GPT2, "--json", cache=base / "cache", importtime=True)
    fresh = oomkit("predict", *GPT2, "--json", cache=base / "unused", OOMKIT_NO_CACHE="1")
    return SimpleNamespace(cache=base / "cache", unused=base / "unused", cold=cold, fresh=fresh)


def copied_cache(runs, tmp_path: Path) -> Path:
    """A copy of the cold run's cache folder (its one kept recording) for one test."""
    return Path(shutil.copytree(runs.cache, tmp_path / "cache"))


def test_a_hit_is_byte_identical_and_imports_no_torch(gpt2_runs, tmp_path):
    """Cold (recorded, kept), warm (replayed) and uncached runs give the same --json bytes and
    exit code; the warm run imports no torch, the cold one does."""
    cold = gpt2_runs.cold
    assert cold.returncode == 0, cold.stderr[-2000:]
    assert imported_torch(cold.stderr)
    assert len(entries(gpt2_runs.cache)) == 1
    cache = copied_cache(gpt2_runs, tmp_path)
    warm = oomkit("predict", *GPT2, "--json", cache=cache, importtime=True)
    assert warm.returncode == 0, warm.stderr[-2000:]
    assert not imported_torch(warm.stderr)
    fresh = gpt2_runs.fresh
    assert warm.stdout == cold.stdout == fresh.stdout
    assert not gpt2_runs.unused.exists()  # OOMKIT_NO_CACHE neither reads nor writes
    # The scenario's own switch: recorded (torch imported), nothing kept, the same prediction;
    # its JSON's scenario says run.cache=false, as the request did.
    off = oomkit("predict", *GPT2, "--json", "--set", "run.cache=false",
                 cache=tmp_path / "off", importtime=True)
    assert off.returncode == 0 and imported_torch(off.stderr)
    assert not (tmp_path / "off").exists()
    said = json.loads(off.stdout)
    assert said["scenario"]["run"].pop("cache") is False
    assert said == json.loads(cold.stdout)
    out = json.loads(warm.stdout)
    assert out["workload"]["options"]["batch_size"] == 1 and out["steps"] == 2


def test_the_defaults_chosen_come_back_from_the_cache(tmp_path):
    """A generation without --steps notes the default (1 step): the note is in the hit's
    result as in the miss's."""
    cache = tmp_path / "cache"
    argv = ["predict", "gpt2-124m", "--mode", "generate", "--new-tokens", "4", "--batch", "1",
            "--seq", "16", "--gpu", "h100", "--json"]  # fmt: skip
    cold = oomkit(*argv, cache=cache)
    warm = oomkit(*argv, cache=cache, importtime=True)
    assert cold.returncode == warm.returncode == 0, cold.stderr[-2000:]
    assert not imported_torch(warm.stderr) and warm.stdout == cold.stdout
    assert "1 step, the default for generate" in json.loads(warm.stdout)["assumptions"][
        "default steps"
    ]


def test_the_terminal_report_of_a_hit_is_the_misss(gpt2_runs, tmp_path):
    """Without --json, stdout is the same report; stderr says the recording was replayed.

    The hit replays the module's kept recording (the key is the scenario's, with or without
    --json); the miss records in this process, uncached."""
    cache = copied_cache(gpt2_runs, tmp_path)
    cold = uncached_in_process(["predict", *GPT2])
    warm = oomkit("predict", *GPT2, cache=cache)
    assert cold.returncode == warm.returncode == 0
    assert warm.stdout == cold.stdout
    assert "recording GPT-2 124M" in cold.stderr
    assert "replaying the cached recording of GPT-2 124M" in warm.stderr


def test_a_changed_field_is_a_miss(gpt2_runs, tmp_path):
    """Another batch is another key: recorded (a second entry), and its result is the one a
    uncached prediction of that batch gives (recorded in this process), not the kept batch's."""
    cache = copied_cache(gpt2_runs, tmp_path)
    first = gpt2_runs.cold
    other = [*GPT2[:2], "2", *GPT2[3:]]
    second = oomkit("predict", *other, "--json", cache=cache)
    fresh = uncached_in_process(["predict", *other, "--json"])
    assert second.returncode == fresh.returncode == 0, second.stderr[-2000:]
    assert len(entries(cache)) == 2
    assert second.stdout == fresh.stdout != first.stdout
    assert json.loads(second.stdout)["workload"]["options"]["batch_size"] == 2


def test_a_damaged_entry_is_recorded_again(gpt2_runs, tmp_path):
    """A truncated entry is ignored (the step is recorded, same bytes out) and rewritten."""
    cache = copied_cache(gpt2_runs, tmp_path)
    cold = gpt2_runs.cold
    (path,) = entries(cache)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    again = oomkit("predict", *GPT2, "--json", cache=cache, importtime=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert imported_torch(again.stderr)  # recorded, not replayed
    assert again.stdout == cold.stdout
    assert path.read_bytes() != data[: len(data) // 2]
    warm = oomkit("predict", *GPT2, "--json", cache=cache, importtime=True)
    assert not imported_torch(warm.stderr) and warm.stdout == cold.stdout


def test_a_step_that_does_not_fit_exits_1_from_the_cache_too(tmp_path):
    """The verdict and exit code of an OOM are replayed as recorded (1 on both runs)."""
    cache = tmp_path / "cache"
    small = [*GPT2[:-1], "1GiB", "--no-remedies", "--json"]
    cold = oomkit("predict", *small, cache=cache)
    warm = oomkit("predict", *small, cache=cache)
    assert cold.returncode == warm.returncode == 1
    assert warm.stdout == cold.stdout
    assert json.loads(warm.stdout)["fits"] is False


def test_oomkit_no_cache_writes_nothing(gpt2_runs):
    """OOMKIT_NO_CACHE=1: recorded, nothing kept."""
    done = gpt2_runs.fresh
    assert done.returncode == 0, done.stderr[-2000:]
    assert entries(gpt2_runs.unused) == []


def test_a_local_hf_config_is_keyed_by_its_bytes(tmp_path):
    """--hf DIR: kept and replayed; an edit to config.json is a miss with the new model's
    result."""
    model = tmp_path / "tiny-gpt2"
    model.mkdir()
    config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64,
        "n_layer": 2, "n_head": 4, "vocab_size": 1000, "n_positions": 128,
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    cache = tmp_path / "cache"
    argv = ["predict", "--hf", str(model), "--batch", "2", "--seq", "32", "--steps", "1", "--json"]
    cold = oomkit(*argv, cache=cache)
    assert cold.returncode == 0, cold.stderr[-2000:]
    warm = oomkit(*argv, cache=cache, importtime=True)
    assert warm.stdout == cold.stdout and not imported_torch(warm.stderr)
    (model / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    edited = oomkit(*argv, cache=cache, importtime=True)
    assert imported_torch(edited.stderr)
    assert len(entries(cache)) == 2
    assert json.loads(edited.stdout)["peak_allocated_bytes"] > json.loads(cold.stdout)[
        "peak_allocated_bytes"
    ]


def test_users_code_is_never_cached(tmp_path):
    """A file.py:function step runs the user's code: recorded, nothing kept."""
    step = tmp_path / "step.py"
    step.write_text(
        "import torch\n"
        "def build(batch_size=2):\n"
        "    with torch.device('meta'):\n"
        "        model = torch.nn.Linear(64, 64)\n"
        "        x = torch.randn(batch_size, 64)\n"
        "    def step():\n"
        "        model(x).sum().backward()\n"
        "    return step, (model, x)\n"
    )
    cache = tmp_path / "cache"
    done = oomkit("predict", f"{step}:build", "--steps", "1", "--json", cache=cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert entries(cache) == []


@pytest.mark.parametrize(
    ("keywords", "reason"),
    [
        ({"what": "step.py:build"}, "your own code"),
        ({"what": "train.py"}, "your own code"),
        ({"what": "gpt2-124m", "compile": True}, "--compile"),
        ({"what": "gpt2-124m", "fsdp": 2}, "sharded"),
        ({"what": "gpt2-124m", "eval": "evals.py:run"}, "--eval"),
        ({"hf": "openai-community/gpt2"}, "local directory"),
    ],
)
def test_what_is_not_cached_says_why(keywords, reason):
    """Each request the key cannot settle is refused, with its reason; no key is made."""
    what = keywords.pop("what", None)
    scenario = scenario_from_keywords(what, **keywords)
    assert reason in (cache_refusal(scenario, environ={}, modules=FRESH) or "")
    assert cache_key(scenario, environ={}, modules=FRESH) is None


def test_a_process_that_imported_torch_records_afresh():
    """In-process, with torch imported (its global state may differ), the cache is not used;
    OOMKIT_NO_CACHE turns it off."""
    scenario = scenario_from_keywords("gpt2-124m", batch=1)
    imported = {"torch": object()}
    assert cache_refusal(scenario, environ={}, modules=imported) == (
        "torch is already imported in this process (its state may differ)"
    )
    assert cache_refusal(scenario, environ={}, modules=FRESH) is None
    off = {"OOMKIT_NO_CACHE": "1"}
    assert cache_refusal(scenario, environ=off, modules=FRESH) == "OOMKIT_NO_CACHE is set"


def test_the_key_holds_the_environment_the_recorder_reads():
    """CUBLAS_WORKSPACE_CONFIG changes the key; an unrelated variable does not."""
    scenario = scenario_from_keywords("gpt2-124m", batch=1)

    def key(scenario, **environ):
        return cache_key(scenario, environ=environ, modules=FRESH)

    base = key(scenario, HOME="/a")
    assert base is not None and len(base) == 64
    assert key(scenario, HOME="/b") == base
    assert key(scenario, CUBLAS_WORKSPACE_CONFIG=":16:8") != base
    assert key(scenario_from_keywords("gpt2-124m", batch=2), HOME="/a") != base


def test_the_api_refuses_a_cache_that_is_not_a_bool():
    """oomkit.predict(..., cache="no") names the keyword."""
    import oomkit

    with pytest.raises(ScenarioError, match=r"cache=\.\.\.\) takes True or False"):
        oomkit.predict("gpt2-124m", cache="no")


def kept_recording(**context_changes):
    import dataclasses

    from oomkit.core.trace import TraceEvent
    from oomkit.prediction.recording_cache import CachedRecording
    from oomkit.prediction.workload import WorkloadSpec

    tags = (("category", "activation"), ("phase", "forward"))
    context = {
        "description": "GPT-2 124M, batch 1",
        "workload": dataclasses.asdict(WorkloadSpec("preset", "gpt2-124m", batch_size=1)),
        "notes": {"default steps": "3"},
        "cudnn_version": 92000,
        **context_changes,
    }
    return CachedRecording(
        events=(
            TraceEvent("alloc", 1, 3 * 2**20, tags=tags),
            TraceEvent("free_requested", 1, 3 * 2**20, tags=tags),
            TraceEvent("free_completed", 1, 3 * 2**20, tags=tags),
        ),
        step_starts=(0,),
        context=context,
    )


def test_a_hit_replays_the_kept_recording_on_the_scenarios_target(tmp_path):
    """In-process: the kept events replayed on the scenario's GPU, with its notes, workload,
    cuDNN version and the scenario itself."""
    from oomkit.prediction.recording_cache import store_recording
    from oomkit.scenario.recording_reuse import cached_prediction

    key = "0" * 64
    assert store_recording(key, kept_recording(), tmp_path)
    scenario = scenario_from_keywords("gpt2-124m", batch=1, gpu="rtx4090")
    hit = cached_prediction(scenario, key, directory=tmp_path)
    assert hit.peak_allocated_bytes == 3 * 2**20  # a multiple of 512 B: not rounded up
    # CUDACachingAllocator.cpp get_allocation_size: 1-10 MiB requests get a 20 MiB segment
    assert hit.peak_reserved_bytes == 20 * 2**20
    assert hit.gpu.name == "RTX 4090" and hit.target.cudnn_version == 92000
    assert hit.workload.batch_size == 1 and hit.description == "GPT-2 124M, batch 1"
    assert hit.assumptions["default steps"] == "3"
    assert hit.scenario["model"] == {"preset": "gpt2-124m"}


@pytest.mark.parametrize(
    "damage",
    [
        {"notes": {"default steps": 3}},
        {"notes": ["x"]},
        {"description": None},
        {"cudnn_version": "92000"},
        {"workload": {"kind": "preset", "name": "x", "no_such_field": 1}},
        {"workload": ["preset"]},
    ],
)
def test_a_kept_context_of_the_wrong_shape_is_a_miss(tmp_path, damage):
    """A context that is not the one record_and_keep writes: ``None``, not an exception."""
    from oomkit.prediction.recording_cache import store_recording
    from oomkit.scenario.recording_reuse import cached_prediction

    key = "1" * 64
    assert store_recording(key, kept_recording(**damage), tmp_path)
    scenario = scenario_from_keywords("gpt2-124m", batch=1, gpu="rtx4090")
    assert cached_prediction(scenario, key, directory=tmp_path) is None


@pytest.mark.parametrize("code", ["auto_map", "modeling.py"])
def test_an_hf_directory_with_its_own_code_is_not_cached(tmp_path, code):
    """A config naming its own classes (auto_map), or a folder holding Python files: the
    model's code is not oomkit's or transformers', so it is never cached."""
    config = {"model_type": "gpt2", "n_layer": 2}
    if code == "auto_map":
        config["auto_map"] = {"AutoModelForCausalLM": "modeling.MyModel"}
    else:
        (tmp_path / code).write_text("class MyModel: ...\n")
    (tmp_path / "config.json").write_text(json.dumps(config))
    scenario = scenario_from_keywords(hf=str(tmp_path), batch=1)
    assert "local directory" in (cache_refusal(scenario, environ={}, modules=FRESH) or "")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    if code != "auto_map":
        (tmp_path / code).unlink()
    assert cache_refusal(scenario, environ={}, modules=FRESH) is None
