"""`oomkit run -- python script.py`: the script runs unmodified; OOMs are dumped and explained."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from oomkit.core.snapshot import load_snapshot
from oomkit.errors import OomkitError
from oomkit.interfaces.cli import main
from oomkit.interfaces.cli.run import split_python_command

PY = sys.executable

OOM_SCRIPT = """
import torch
keep = []
for _ in range(4):
    keep.append(torch.empty(300 * 2**20, dtype=torch.uint8))
"""


def _script(tmp_path, body, name="train.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def _last_json(stdout):
    return json.loads(stdout[stdout.index("{\n") :])


def test_script_runs_as_main_with_its_argv(tmp_path, capfd):
    """argv, __name__ and sys.path[0] are what `python script.py ARGS` gives; exit 0."""
    out = tmp_path / "seen.json"
    script = _script(
        tmp_path,
        f"""
        import json, sys
        json.dump({{"argv": sys.argv, "name": __name__, "path0": sys.path[0]}},
                  open({str(out)!r}, "w"))
        print("hello from the script")
        """,
    )
    code = main(["run", "--snapshot-dir", str(tmp_path / "s"), "--", PY, str(script), "--lr", "3"])
    assert code == 0
    assert json.loads(out.read_text()) == {
        "argv": [str(script), "--lr", "3"],
        "name": "__main__",
        "path0": str(tmp_path),
    }
    captured = capfd.readouterr()
    assert captured.out == "hello from the script\n"
    assert captured.err == "oomkit: no CUDA device; the script ran without memory recording\n"
    assert not (tmp_path / "s").exists()


def test_exit_code_passes_through(tmp_path):
    """sys.exit(3) in the script is oomkit's exit code."""
    script = _script(tmp_path, "import sys\nsys.exit(3)\n")
    assert main(["run", "--", PY, str(script)]) == 3


def test_uncaught_error_exits_1_with_users_traceback(tmp_path, capfd):
    """An uncaught non-OOM error: Python's traceback without oomkit frames, exit 1, no report."""
    script = _script(tmp_path, "def f():\n    raise ValueError('boom')\nf()\n")
    assert main(["run", "--", PY, str(script)]) == 1
    err = capfd.readouterr().err
    assert err.startswith("Traceback (most recent call last):\n")
    assert 'train.py", line 3, in <module>' in err
    assert "ValueError: boom" in err
    assert "_bootstrap.py" not in err and "runpy" not in err
    assert "Cause:" not in err


def test_signal_exit_code(tmp_path):
    """A script killed by SIGTERM exits 128+15, as a shell reports it."""
    script = _script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n")
    assert main(["run", "--", PY, str(script)]) == 143


def test_module_form(tmp_path, monkeypatch):
    """`python -m pkg.mod ARGS` runs the module as __main__ from the working directory."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(
        "import sys\nsys.exit(10 + len(sys.argv[1:]) if __name__ == '__main__' else 99)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--", PY, "-m", "pkg.job", "a", "b"]) == 12


def test_oom_is_dumped_and_explained(tmp_path, monkeypatch, capfd):
    """An OOM under the (test-only) simulated GPU: snapshot written, diagnosis printed, exit 1."""
    monkeypatch.setenv("OOMKIT_RUN_SIMULATED_GPU", "1GiB")
    script = _script(tmp_path, OOM_SCRIPT)
    snaps = tmp_path / "snaps"
    assert main(["run", "--snapshot-dir", str(snaps), "--", PY, str(script)]) == 1
    err = capfd.readouterr().err
    (snapshot,) = snaps.iterdir()
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 300.00 MiB" in err
    assert "Cause: a real shortage of memory" in err
    assert f"Snapshot at the OOM: {snapshot}" in err
    snap = load_snapshot(snapshot)
    assert sum(s.allocated_size for s in snap.segments) == 900 * 2**20


def test_oom_json(tmp_path, monkeypatch, capfd):
    """--json: one object after the script's output with the exit code, snapshot and cause."""
    monkeypatch.setenv("OOMKIT_RUN_SIMULATED_GPU", "1GiB")
    script = _script(tmp_path, "print('step 0')\n" + OOM_SCRIPT)
    snaps = tmp_path / "snaps"
    assert main(["run", "--json", "--snapshot-dir", str(snaps), "--", PY, str(script)]) == 1
    out = capfd.readouterr().out
    assert out.startswith("step 0\n")
    obj = _last_json(out)
    assert obj["exit_code"] == 1 and obj["oom"] is True and obj["outcome"] == "exception"
    assert obj["snapshot_path"] == str(next(snaps.iterdir()))
    assert obj["observed_ooms"] == [
        {
            "device": 0,
            "requested_bytes": 300 * 2**20,
            "device_limit_bytes": 2**30,
            "device_free_bytes": 124 * 2**20,
        }
    ]
    assert obj["diagnosis"]["cause"] == "shortage"
    assert obj["diagnosis"]["remedies"][0]["code"]


def test_caught_oom_is_mentioned(tmp_path, monkeypatch, capfd):
    """A script that catches its OOM exits 0; oomkit says one was caught and where the dump is."""
    monkeypatch.setenv("OOMKIT_RUN_SIMULATED_GPU", "1GiB")
    script = _script(
        tmp_path,
        """
        import torch
        try:
            torch.empty(2 * 2**30, dtype=torch.uint8)
        except torch.OutOfMemoryError:
            pass
        """,
    )
    snaps = tmp_path / "snaps"
    assert main(["run", "--snapshot-dir", str(snaps), "--", PY, str(script)]) == 0
    err = capfd.readouterr().err
    assert f"the script caught 1 out-of-memory error(s); snapshot of the last: {snaps}" in err
    assert "Cause:" not in err


def test_a_script_named_first_runs_with_this_python_as_predict_takes_it(tmp_path, capfd):
    """`oomkit run train.py -- --lr 3` (the form predict and fit take) is `oomkit run -- python
    train.py --lr 3` with the Python running oomkit; it had been refused as "not a Python
    script". A `--` the script is given later is its own."""
    out = tmp_path / "seen.json"
    script = _script(
        tmp_path,
        f"""
        import json, sys
        json.dump({{"argv": sys.argv, "python": sys.executable}}, open({str(out)!r}, "w"))
        """,
    )
    assert main(["run", "--snapshot-dir", str(tmp_path / "s"), str(script), "--", "--lr", "3",
                 "--", "x"]) == 0
    assert json.loads(out.read_text()) == {
        "argv": [str(script), "--lr", "3", "--", "x"],
        "python": PY,
    }
    capfd.readouterr()
    assert split_python_command([str(script), "-v"]) == (PY, [], [str(script), "-v"])
    with pytest.raises(OomkitError, match="nothere.py: no such script"):
        split_python_command(["nothere.py", "--", "-v"])


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["torchrun", "train.py"], "runs Python scripts; got `torchrun`"),
        ([], "no command to run"),
        ([PY, "nothere.py"], "nothere.py: no such script"),
        ([PY, "-c", "print(1)"], "`python -c CODE` is not supported"),
        ([PY, "-m"], "`python -m` needs a module name"),
        ([PY, "--frobnicate", "x.py"], "unknown Python option '--frobnicate'"),
    ],
)
def test_bad_commands_are_usage_errors(command, message, capsys):
    """Commands that are not a runnable Python script exit 2 with a one-line reason."""
    assert main(["run", "--", *command]) == 2
    assert message in capsys.readouterr().err


def test_split_python_command_options(tmp_path):
    """Interpreter options stay before the bootstrap; the script and its args follow."""
    script = _script(tmp_path, "")
    assert split_python_command(
        ["--", "python3", "-u", "-X", "dev", "-W", "ignore", str(script), "-v"]
    ) == (
        "python3",
        ["-u", "-X", "dev", "-W", "ignore"],
        [str(script), "-v"],
    )
    assert split_python_command(["python3.11", "-OB", "-m", "pkg", "-u"]) == (
        "python3.11",
        ["-OB"],
        ["-m", "pkg", "-u"],
    )
    with pytest.raises(OomkitError, match="no script given"):
        split_python_command(["python", "-u"])


def test_missing_interpreter_is_a_usage_error(tmp_path, capsys):
    """A python that cannot be started is reported, exit 2."""
    script = _script(tmp_path, "")
    assert main(["run", "--", str(tmp_path / "python3.99"), str(script)]) == 2
    assert "could not start" in capsys.readouterr().err
