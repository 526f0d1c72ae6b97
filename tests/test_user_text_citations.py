"""No string a user reads cites a "§" section of oomkit's internal spec (issue 35 item 7).

Every string literal that is not a docstring, in the modules that print or return text for
users: diagnoses, tuning, reports and the commands below. Comments may cite the spec.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "oomkit"
_CLI = ("explain", "diff", "replay", "tune", "doctor", "demo", "report", "simulate", "gpus",
        "presets", "run", "experiment")
MODULES = sorted(
    [*SRC.glob("diagnose/*.py"), SRC / "plan" / "tuning.py"]
    + [p for p in SRC.glob("interfaces/reports/*.py")
       if p.name not in ("prediction.py", "batch_search.py")]
    + [SRC / "interfaces" / "cli" / f"{name}.py" for name in _CLI]
)


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_spec_section_in_user_text(path):
    """No non-docstring string literal holds '§'."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    offending = [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skip
        and "§" in node.value
    ]
    assert offending == []


def test_the_list_covers_the_modules_it_names():
    """Every module named exists (a rename would silently drop it from the check)."""
    assert all(path.is_file() for path in MODULES)
    assert len(MODULES) >= 40
