"""House rules for every module: a one-line summary docstring, and no module over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import oomkit

SRC = Path(oomkit.__file__).parent
MAX_LINES = 600


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_there_are_modules_to_check():
    """The checks below see the whole package (not 0 of 0)."""
    assert len(_modules()) > 100


def test_every_module_says_what_it_is_for_in_one_line():
    """Each module's docstring opens with a one-line summary, followed by a blank line or nothing."""
    offences = []
    for path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        rel = path.relative_to(SRC).as_posix()
        if not doc:
            offences.append(f"{rel}: no module docstring")
        elif "\n" in doc.split("\n\n")[0].strip():
            offences.append(f"{rel}: the summary is more than one line")
    assert offences == []


def test_no_module_is_over_600_lines():
    """Split a module by concept before it passes 600 lines."""
    long = {
        path.relative_to(SRC).as_posix(): n
        for path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_merge_conflict_markers_are_left_in_the_tree():
    """No line of the sources, tests, docs or README starts a git conflict marker (a marker
    inside a docstring passes ruff and mypy, so only this catches it)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    markers = ("<" * 7 + " ", ">" * 7 + " ", "=" * 7 + "\n")
    found = []
    for folder in ("src", "tests", "docs", "benchmarks", "examples", "scripts"):
        for path in (root / folder).rglob("*"):
            if path.suffix not in (".py", ".md", ".toml", ".txt") or not path.is_file():
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(True), 1):
                if line.startswith(markers):
                    found.append(f"{path.relative_to(root)}:{number}")
    for number, line in enumerate((root / "README.md").read_text(encoding="utf-8").splitlines(True), 1):
        if line.startswith(markers):
            found.append(f"README.md:{number}")
    assert found == []


def test_no_two_test_modules_share_a_name():
    """The test folders have no ``__init__.py`` (pytest's rootdir-based import), so two test
    modules with one file name collide when one run collects both ("import file mismatch"),
    which running either folder alone never shows."""
    from collections import defaultdict

    tests = Path(__file__).resolve().parent
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in tests.rglob("test_*.py"):
        by_name[path.name].append(path.relative_to(tests).as_posix())
    assert len(by_name) > 300
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
