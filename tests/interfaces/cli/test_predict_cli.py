"""Tests for `oomkit predict`: JSON fields, exit codes, --budget and loading the user's function."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from oomkit.core.target import Target
from oomkit.interfaces.cli import main
from oomkit.scenario.target import installed_torch_version
from oomkit.scenario.user_function import is_user_target

pytest.importorskip("torch")

MiB = 2**20

# A 2-layer MLP trained with SGD: builds on meta, returns (step, objects to track).
USER_FILE = """
import torch

def build(batch_size, seq_len=16, device=None):
    assert device == torch.device("meta")
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(batch_size, seq_len, 32)
    assert x.device.type == "meta"

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, [model, opt, x]

def plain(batch_size=4):
    w = torch.empty(1024, 1024)  # 4 MiB, made under torch.device("meta")
    return lambda: (w * 2).sum()

def broken(batch_size=4):
    raise RuntimeError("no such layer")

def bad_return():
    return 42

def needs_other(hidden):
    return lambda: None

def step_raises():
    def step():
        raise KeyError("boom")
    return step
"""


@pytest.fixture()
def user_file(tmp_path):
    path = tmp_path / "mystep.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_user_function_json_has_every_field(user_file, capsys):
    """--json prints one object with all Prediction fields, bytes as ints, and exit code 0."""
    code = main(["predict", f"{user_file}:build", "--batch", "2", "--gpu", "rtx4090", "--json"])
    out = _json(capsys)
    assert code == 0
    for key in (
        "peak_allocated_bytes", "peak_reserved_bytes", "capacity_bytes", "usable_bytes", "fits",
        "headroom_bytes", "by_category_bytes", "top_modules", "oom", "timeline", "warnings",
        "gpu", "alloc_conf", "step_peaks", "peak_step", "required_bytes", "verdict",
    ):
        assert key in out, key
    assert out["fits"] is True and out["oom"] is None
    assert out["gpu"]["name"] == "RTX 4090"
    assert out["usable_bytes"] == out["capacity_bytes"] - out["context_overhead_bytes"]
    assert out["headroom_bytes"] == out["usable_bytes"] - out["peak_reserved_bytes"]
    assert out["steps"] == 3
    assert out["description"] == f"{user_file}:build(batch_size=2)"
    # Linear(32, 64): 8 KiB weight + 256 B bias; Linear(64, 8): 2 KiB + 32 B (512-B blocks).
    assert out["by_category_bytes"]["parameter"] == 8192 + 512 + 2048 + 512
    # x: 2 x 16 x 32 fp32 = 4 KiB.
    assert out["by_category_bytes"]["input"] == 4096
    assert out["verdict"].startswith("fits on RTX 4090: peak reserved ")
    # Steps count from 1 in the JSON, as in the tables (issue 16 item 12).
    assert [s["step"] for s in out["step_peaks"]] == [1, 2, 3]
    assert out["peak_step"] in (1, 2, 3)
    assert {p["step"] for p in out["timeline"]} <= {None, 1, 2, 3}
    assert out["timeline"][-1]["step"] == 3


def test_function_without_track_and_default_batch(user_file, capsys):
    """A function returning a bare step works; tensors it built are first seen in step 1."""
    assert main(["predict", f"{user_file}:plain", "--gpu", "24GiB", "--steps", "1", "--json"]) == 0
    out = _json(capsys)
    assert out["steps"] == 1
    assert out["peak_allocated_bytes"] >= 4 * MiB


def test_does_not_fit_exits_1(user_file, capsys):
    """A step larger than the GPU exits 1 and names where it would OOM."""
    code = main(
        ["predict", f"{user_file}:build", "--batch", "2048", "--seq", "1024", "--gpu", "1GiB",
         "--context-overhead", "0", "--json"]
    )
    out = _json(capsys)
    assert code == 1
    assert out["fits"] is False
    # x is 256 MiB; the ReLU's 512 MiB output is the first request that cannot be served.
    # Steps count from 1 in the JSON as in the verdict (issue 16 item 12).
    assert (out["oom"]["step"], out["oom"]["module"]) == (1, "1")
    assert out["oom"]["requested_bytes"] == 2048 * 1024 * 64 * 4
    assert out["oom"]["message"].startswith("CUDA out of memory.")
    assert out["headroom_bytes"] < 0
    assert out["verdict"].startswith("would OOM at step 1 in the forward pass in 1 (")


def test_budget_exceeded_exits_1(user_file, capsys):
    """--budget below the predicted peak reserved exits 1 although the GPU fits it."""
    code = main(["predict", f"{user_file}:build", "--batch", "2", "--budget", "1MiB", "--json"])
    out = _json(capsys)
    assert code == 1
    assert out["fits"] is True
    assert out["budget_bytes"] == MiB
    assert out["within_budget"] is False
    assert "over the budget of 1.00 MiB" in out["verdict"]


def test_terminal_report_shows_table_and_verdict(user_file, capsys):
    """The terminal report has the breakdown table, the modules and the verdict line."""
    assert main(["predict", f"{user_file}:build", "--batch", "2", "--gpu", "l4"]) == 0
    out = capsys.readouterr().out
    assert "Memory at peak allocated" in out
    assert "parameter" in out and "reserved" in out
    assert "Top modules at peak allocated" in out
    assert "fits on L4: peak reserved" in out


@pytest.mark.parametrize(
    ("target_suffix", "extra", "message"),
    [
        (":broken", [], "broken() raised RuntimeError: no such layer"),
        (":bad_return", [], "bad_return() returned int; it must return a zero-argument"),
        (":needs_other", [], "parameter 'hidden' without a default"),
        (":build", [], "the function needs batch_size; pass it with --batch N"),
        (":missing", [], "has no function 'missing'. Functions there: bad_return, broken"),
        (":step_raises", [], "the step raised KeyError: 'boom'"),
    ],
)
def test_user_function_errors_are_one_line(user_file, capsys, target_suffix, extra, message):
    """User code that fails gives exit 2 and one line naming the function and the error."""
    assert main(["predict", f"{user_file}{target_suffix}", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("oomkit: error:")
    assert message in err[-1]


def test_missing_file_is_usage_error(tmp_path, capsys):
    """A file that does not exist gives exit 2 and says so."""
    assert main(["predict", str(tmp_path / "nope.py") + ":f"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_import_error_in_user_file(tmp_path, capsys):
    """A file that fails to import gives exit 2 and names the exception."""
    path = tmp_path / "bad.py"
    path.write_text("import not_a_module_anywhere\n")
    assert main(["predict", f"{path}:f"]) == 2
    assert "ModuleNotFoundError" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu", "h1000"], "unknown GPU 'h1000'"),
        (["--alloc-conf", "max_split_size_mb:2"], "max_split_size"),
        (["--hf", "gpt2"], "either a TARGET or --hf"),
    ],
)
def test_bad_input_exits_2(user_file, capsys, argv, message):
    """A bad GPU, allocator setting or target combination exits 2 before tracing."""
    assert main(["predict", f"{user_file}:build", "--batch", "2", *argv]) == 2
    assert message in capsys.readouterr().err


def test_no_target_exits_2(capsys):
    """`oomkit predict` with nothing to predict says what to give."""
    assert main(["predict"]) == 2
    assert "name what to predict" in capsys.readouterr().err


def test_is_user_target():
    """file.py:function is user code; a preset name (even with a colon) is not."""
    assert is_user_target("train.py:build")
    assert is_user_target("C:/x/train.py:build")
    assert not is_user_target("gpt2-124m")
    assert not is_user_target("train.py:")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["predict", "USER", "--batch", "2"], "oomkit predict records the step on PyTorch's "
         "meta device and needs torch; install it with `pip install oomkit[torch]`"),
        (["predict", "gpt2-124m"], "oomkit predict records the step on PyTorch's meta device "
         "and needs torch; install it with `pip install oomkit[torch]`"),
        (["fit", "gpt2-124m", "--gpu", "t4"], "oomkit fit records the step on PyTorch's meta "
         "device and needs torch; install it with `pip install oomkit[torch]`"),
        (["predict", "--hf", "gpt2"], "oomkit predict --hf records the step on PyTorch's meta "
         "device and needs torch; install it with `pip install oomkit[hf]`"),
    ],
)
def test_missing_torch_exits_3(user_file, argv, line):
    """Without torch, predict (user code, a preset, --hf) and fit exit 3 with one clear line,
    never a ModuleNotFoundError traceback (issue 16 item 1)."""
    argv = [str(user_file) + ":build" if a == "USER" else a for a in argv]
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from oomkit.interfaces.cli import main\n"
        f"sys.exit(main({argv!r}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"oomkit: {line} (replay, simulate, tune, demo and explain need none)"
    ]


def test_numpy_warning_silenced_where_torch_is_imported():
    """Where numpy is missing, torch's one-time "Failed to initialize NumPy" UserWarning is not
    printed by predict (issue 16 item 2); other warnings still are."""
    code = (
        "import sys, warnings; sys.modules['numpy'] = None\n"
        "warnings.simplefilter('default')\n"
        "from oomkit.scenario._torch import require_torch\n"
        "require_torch('oomkit predict')\n"
        "import torch\n"
        "assert torch.__version__\n"
        "warnings.warn('still shown', UserWarning)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Failed to initialize NumPy" not in proc.stderr
    assert "UserWarning: still shown" in proc.stderr
    # Without the filter, the same interpreter warns (so the test can fail).
    bare = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['numpy'] = None\nimport torch"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Failed to initialize NumPy" in bare.stderr


def test_preset_json():
    """A built-in preset predicts without a GPU."""
    proc_out = []
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["predict", "gpt2-124m", "--batch", "1", "--seq", "64", "--steps", "1",
                     "--gpu", "rtx4090", "--json"])
    proc_out.append(buf.getvalue())
    out = json.loads(proc_out[0])
    assert code == 0
    assert out["fits"] is True
    assert out["description"].startswith("GPT-2 124M")


def test_verdict_lines_exact():
    """The verdict reads as documented, for a fit and for an OOM."""
    from oomkit.core.gpus import GpuSpec
    from oomkit.core.trace import TraceEvent
    from oomkit.interfaces.reports.prediction import verdict_line
    from oomkit.prediction import predict_recording
    from oomkit.prediction.tracing import TraceRecording

    events = (
        TraceEvent("alloc", 1, 3 * MiB, tags=(("category", "activation"),)),
        TraceEvent(
            "alloc", 2, 30 * MiB,
            tags=(("category", "temporary"), ("module", "h.3.attn"), ("op", "aten.mm.default")),
        ),
    )
    rec = TraceRecording(events=events, step_starts=(0,))
    fits = predict_recording(rec, target=Target.resolve(GpuSpec("Big", 1024 * MiB, 100 * MiB)))
    assert verdict_line(fits) == (
        "fits on Big: peak reserved 50.00 MiB of 924.00 MiB usable, 874.00 MiB headroom"
    )
    oom = predict_recording(
        rec, target=Target.resolve(GpuSpec("Small", 40 * MiB, 10 * MiB)), budget_bytes=16 * MiB
    )
    assert verdict_line(oom) == (
        "would OOM at step 1 in h.3.attn (aten.mm.default) requesting 30.00 MiB on Small: the "
        "step needs about 50.00 MiB reserved, 20.00 MiB more than the 30.00 MiB usable; over the "
        "budget of 16.00 MiB"
    )


def test_cudnn_version_picks_the_sdpa_backend_on_an_h100(capsys):
    """--cudnn-version on an H100: 9.15.1 runs cuDNN attention, 9.10.2 flash; saved for explain."""
    argv = ["predict", "gpt2-124m", "--batch", "1", "--seq", "64", "--steps", "1",
            "--precision", "bf16-mixed", "--gpu", "h100", "--json"]
    assert main([*argv, "--cudnn-version", "91501"]) == 0
    newer = json.loads(capsys.readouterr().out)
    # On sm90 the cuDNN graphs' workspaces are emulated as measured on an H200: no warning.
    assert not any("cuDNN attention" in w for w in newer["warnings"])
    assert newer["workload"]["cudnn_version"] == 91501
    assert newer["kernel_choices"] == {"SDPA cudnn_attention": 12}  # GPT-2's 12 layers, 1 step
    assert newer["assumptions"] == {"cuDNN": "9.15.1 (as given)"}
    assert main([*argv, "--cudnn-version", "91002"]) == 0
    older = json.loads(capsys.readouterr().out)
    assert not any("cuDNN attention" in w for w in older["warnings"])
    assert older["workload"]["cudnn_version"] == 91002
    assert older["kernel_choices"] == {"SDPA flash_attention": 12}
    # A given version equal to this install's own is credited to it: the CUDA wheels of torch
    # 2.8-2.10 load cuDNN 9.10.2 even without a GPU.
    from oomkit.prediction.tracing.emulations import installed_cudnn_build

    build = installed_cudnn_build()
    source = build.source if build.version == 91002 else "as given"
    assert older["assumptions"] == {"cuDNN": f"9.10.2 ({source})"}


def test_default_cudnn_is_this_torch_installs_and_is_saved(capsys):
    """Without the flag: the install's cuDNN (torch 2.13's wheel pins 9.20.0: cuDNN attention)."""
    from oomkit.prediction.tracing.emulations import installed_cudnn_build

    build = installed_cudnn_build()
    if build.version is None or build.version <= 91500:
        pytest.skip(f"this torch's cuDNN ({build}) does not put cuDNN attention first")
    argv = ["predict", "gpt2-124m", "--batch", "1", "--seq", "64", "--steps", "1",
            "--precision", "bf16-mixed", "--gpu", "h100", "--json"]
    assert main(argv) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["workload"]["cudnn_version"] == build.version
    assert default["kernel_choices"] == {"SDPA cudnn_attention": 12}
    assert default["assumptions"]["cuDNN"].endswith(f"({build.source})")


def test_json_saves_the_target_and_the_workload_record(user_file, capsys):
    """--json keeps every old key and adds `target` and a typed `workload` (a function too)."""
    argv = ["predict", f"{user_file}:build", "--batch", "2", "--gpu", "rtx4090", "--steps", "1",
            "--alloc-conf", "expandable_segments:True", "--cudnn-version", "91002", "--json"]
    assert main(argv) == 0
    out = _json(capsys)
    assert out["target"] == {
        "gpu": "RTX 4090",
        "alloc_conf": "expandable_segments:True",
        "context_overhead_bytes": out["context_overhead_bytes"],
        "usable_bytes": out["usable_bytes"],
        "torch_version": installed_torch_version(),
        "cudnn_version": 91002,
        "cuda_version": out["target"]["cuda_version"],
        "cuda_module_loading": "lazy",
        "cuda_context": out["target"]["cuda_context"],
        "parallel": None,
    }
    assert out["target"]["cuda_version"] == "13.0"  # torch 2.13's default wheel (a CPU build here)
    assert "for Ada Lovelace, CUDA 13.0, lazy module loading" in out["target"]["cuda_context"]
    assert out["alloc_conf"] == "expandable_segments:True"
    assert out["workload"] == {
        "kind": "function",
        "name": f"{user_file}:build",
        "options": {
            "batch_size": 2, "seq_len": None, "image_size": None, "precision": None,
            "optimizer": None, "checkpointing": None, "mode": None, "new_tokens": None,
        },
        "steps": 1,
        "cudnn_version": 91002,
    }


def test_bad_target_flags_fail_before_any_model_is_built(user_file, capsys):
    """target_from_args parses --gpu/--alloc-conf once: a typo exits 2 with the parser's message."""
    assert main(["predict", f"{user_file}:build", "--alloc-conf", "max_split_size_mb:2"]) == 2
    assert "max_split_size_mb" in capsys.readouterr().err


def test_torch_version_rules_the_alloc_conf_check(user_file, capsys):
    """--torch-version 2.0 rejects expandable_segments (added in 2.1) before anything is traced."""
    argv = ["predict", f"{user_file}:build", "--batch", "2", "--gpu", "rtx4090",
            "--alloc-conf", "expandable_segments:True", "--json"]
    assert main([*argv, "--torch-version", "2.0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "invalid allocator setting 'expandable_segments:True' (torch 2.0 rules)" in captured.err
    assert main([*argv, "--torch-version", "2.1"]) == 0
    assert _json(capsys)["alloc_conf"] == "expandable_segments:True"


def test_torch_version_reaches_predict(user_file, capsys, monkeypatch):
    """The version --torch-version names is the one predict() models; without the flag, the
    installed torch's, which records the step (issue 16 item 15: not the newest release)."""
    import oomkit.prediction.predictor as predictor

    versions = []
    real = predictor.predict

    def spy(*args, **kwargs):
        versions.append(kwargs["target"].torch_version)
        return real(*args, **kwargs)

    monkeypatch.setattr(predictor, "predict", spy)
    argv = ["predict", f"{user_file}:build", "--batch", "2", "--gpu", "rtx4090", "--json"]
    assert main([*argv, "--torch-version", "2.5"]) == 0
    assert main(argv) == 0
    capsys.readouterr()
    import torch

    assert versions == ["2.5", ".".join(torch.__version__.split(".")[:2])]


PRINTING_FILE = """
import torch

print("imported the training script")

def build(batch_size):
    model = torch.nn.Linear(64, 64)
    x = torch.randn(batch_size, 64)
    print(f"number of parameters: {sum(p.numel() for p in model.parameters())}")

    def step():
        print("step")
        model(x).sum().backward()

    return step, (model, x)
"""


def test_json_is_one_object_whatever_the_user_code_prints(tmp_path, capsys):
    """The script's prints (import, builder, steps) go to stderr; stdout is the JSON alone."""
    path = tmp_path / "printing.py"
    path.write_text(textwrap.dedent(PRINTING_FILE))
    assert main(["predict", f"{path}:build", "--batch", "2", "--steps", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["workload"]["name"] == f"{path}:build"
    assert "imported the training script\nnumber of parameters: 4160\n" in captured.err
    assert captured.err.count("step\n") == 2
    assert main(["fit", f"{path}:build", "--gpu", "1GiB", "--steps", "1", "--max-batch", "4",
                 "--margin", "0", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["batch_size"] == 4
    assert "number of parameters: 4160" in captured.err


def test_preset_flags_on_a_user_function_are_refused_by_name(user_file, capsys):
    """--precision/--optimizer/--checkpointing/--mode would change nothing there: exit 2."""
    target = f"{user_file}:build"
    argv = ["predict", target, "--batch", "2", "--precision", "fp32", "--optimizer", "sgd"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--precision and --optimizer apply to presets and --hf only: {target} runs" in err
    assert "then drop them." in err
    assert main(["fit", target, "--checkpointing"]) == 2
    assert "--checkpointing applies to presets and --hf only" in capsys.readouterr().err
    assert main(["predict", target, "--batch", "2", "--mode", "inference", "--json"]) == 2
    assert "then drop it." in capsys.readouterr().err
    assert main(["predict", target, "--batch", "2", "--json"]) == 0
