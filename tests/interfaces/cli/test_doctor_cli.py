"""oomkit doctor on the command line: exit codes, JSON, and bad input."""

from __future__ import annotations

import json

import pytest

from oomkit.core.snapshot.writer import write_snapshot
from oomkit.core.trace import TraceEvent
from oomkit.interfaces.cli import main


def test_doctor_json_names_the_variable_read(monkeypatch, capsys):
    """--json: read_from and the findings; exit 1 for an error finding (2.9 + #183387)."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_HIP_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    code = main(["doctor", "--torch-version", "2.9", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1
    assert out["read_from"] == "PYTORCH_ALLOC_CONF" and out["worst"] == "error"
    assert out["config"]["expandable_segments"] is False
    assert out["live"] is None


def test_doctor_clean_environment_exits_0(monkeypatch, capsys):
    """No variable set, --no-live: exit 0 and the 'no problems' line."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)
    assert main(["doctor", "--no-live", "--torch-version", "2.13"]) == 0
    assert "No problems found" in capsys.readouterr().out


def test_doctor_prints_markup_in_values_as_written(monkeypatch, capsys):
    """A value holding rich markup is printed literally, not interpreted."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "[bold]x[/bold]:1")
    main(["doctor", "--no-live", "--torch-version", "2.13"])
    assert "[bold]x[/bold]:1" in capsys.readouterr().out


def test_doctor_snapshot_without_trace_exits_2(tmp_path, capsys):
    """A snapshot with no settings and no trace: one clear message, exit 2."""
    path = write_snapshot(tmp_path / "s.pickle", [], {0: [TraceEvent("snapshot", 0, 0)]})
    assert main(["doctor", str(path)]) == 2
    assert "records no allocator settings and no trace events" in capsys.readouterr().err


def test_doctor_missing_snapshot_exits_2(tmp_path, capsys):
    """A path that does not exist is an argparse error (exit 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["doctor", str(tmp_path / "nope.pickle")])
    assert exc.value.code == 2
    assert "no such file" in capsys.readouterr().err


def test_installed_torch_version_is_read_from_torch_version_py(tmp_path, monkeypatch):
    """The installed torch's version comes from the ``torch/version.py`` an import would load
    (torch not imported, no package metadata); without that file, from the metadata."""
    import importlib.metadata
    import sys

    from oomkit.interfaces.cli.doctor import _installed_torch_version

    real = importlib.metadata.version("torch")
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # find_spec would return its spec
    assert _installed_torch_version() == real
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('never imported')\n")
    (fake / "version.py").write_text(
        "from typing import Optional\n\n__all__ = ['__version__']\n__version__ = '9.9.9+cu999'\n"
        "git_version = 'abc'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    assert _installed_torch_version() == "9.9.9+cu999"
    (fake / "version.py").unlink()
    assert _installed_torch_version() == real  # the metadata, as before


def test_doctor_checks_a_setting_given_with_alloc_conf(monkeypatch, capsys):
    """--alloc-conf STR is checked as if PYTORCH_CUDA_ALLOC_CONF held it, whatever the
    environment sets (its PYTORCH_ALLOC_CONF would shadow it); a bad value is exit 1 naming it;
    a snapshot with it is refused; a setting given as SNAPSHOT points to --alloc-conf."""
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    code = main(["doctor", "--alloc-conf", "expandable_segments:True,max_split_size_mb:128",
                 "--torch-version", "2.13", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (out["source"], out["read_from"]) == ("--alloc-conf", "PYTORCH_CUDA_ALLOC_CONF")
    assert out["config"]["expandable_segments"] is True
    assert out["config"]["max_split_size_bytes"] == 128 * 2**20
    assert main(["doctor", "--alloc-conf", "expandable_segments:Tru", "--torch-version", "2.13"]) == 1
    assert "PYTORCH_CUDA_ALLOC_CONF='expandable_segments:Tru' is rejected" in " ".join(
        capsys.readouterr().out.split()
    )
    with pytest.raises(SystemExit) as exc:
        main(["doctor", "expandable_segments:True"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "is an allocator setting, not a snapshot file" in err
    assert "oomkit doctor --alloc-conf 'expandable_segments:True'" in err
