"""`oomkit run -- python plain.py` where torch cannot be imported: the script runs, unwatched."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from oomkit.interfaces.cli import main

PY = sys.executable
SRC = str(Path(__file__).resolve().parents[3] / "src")


@pytest.fixture
def no_torch(tmp_path, monkeypatch):
    """Children see a `torch` whose import raises ModuleNotFoundError, as where it is not installed."""
    fake = tmp_path / "no_torch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"
    )
    path = os.pathsep.join([str(fake.parent), SRC, os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path.rstrip(os.pathsep))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _script(directory: Path, body: str) -> Path:
    path = directory / "plain.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_plain_script_runs_and_its_exit_code_passes_through(no_torch, capfd):
    """A script that needs no torch prints its output and exits with its own code (7)."""
    _script(no_torch, "import sys\nprint('plain output', sys.argv[1:])\nsys.exit(7)\n")
    assert main(["run", "--", PY, "plain.py", "a", "b"]) == 7
    captured = capfd.readouterr()
    assert "plain output ['a', 'b']" in captured.out
    assert "Traceback" not in captured.err
    assert "oomkit: torch is not importable by" in captured.err
    assert "running the script without memory recording." in captured.err
    assert captured.err.count("oomkit:") == 1


def test_plain_script_exit_0_and_json(no_torch, capfd):
    """--json says it ran unwatched and why; exit 0 when the script ends normally."""
    _script(no_torch, "print('done')\n")
    assert main(["run", "--json", "--", PY, "plain.py"]) == 0
    out = capfd.readouterr().out
    report = json.loads(out[out.index("{\n") :])
    assert report["exit_code"] == 0 and report["recording"] is False
    assert report["outcome"] == "ok" and report["oom"] is False
    assert "torch is not importable" in report["unwatched_reason"]


def test_a_script_that_imports_torch_fails_as_it_would_alone(no_torch, capfd):
    """The script's own `import torch` fails with its traceback (its frames only), exit 1."""
    _script(no_torch, "import torch\n")
    assert main(["run", "--", PY, "plain.py"]) == 1
    err = capfd.readouterr().err
    assert "ModuleNotFoundError: No module named 'torch'" in err
    assert 'File "' in err and "plain.py" in err and "_bootstrap.py" not in err
