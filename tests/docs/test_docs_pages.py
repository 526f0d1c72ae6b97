"""The README and the documentation pages: short README, intact tables, no internal citations."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
USER_PAGES = (README, *sorted((ROOT / "docs").rglob("*.md")))


def _stray_rows(html: str) -> list[str]:
    """Lines of rendered paragraphs that start with a pipe: table rows that did not render."""
    return [
        line
        for paragraph in re.findall(r"<p>(.*?)</p>", html, flags=re.S)
        for line in paragraph.splitlines()
        if line.lstrip().startswith("|")
    ]


def test_the_readme_reads_in_two_minutes() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_renders_as_a_table(page: Path) -> None:
    """A table cut by a heading or a paragraph renders its later rows as a paragraph of literal
    pipes (CommonMark, as GitHub and MkDocs render it)."""
    markdown_it = pytest.importorskip("markdown_it")
    html = (
        markdown_it.MarkdownIt("commonmark")
        .enable("table")
        .render(page.read_text(encoding="utf-8"))
    )
    assert _stray_rows(html) == []


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_section_sign_citations(page: Path) -> None:
    """Users have no internal spec to look up: cite PyTorch's file and function, or an issue."""
    assert "§" not in page.read_text(encoding="utf-8")


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []


def test_the_stray_table_check_catches_a_cut_table() -> None:
    markdown_it = pytest.importorskip("markdown_it")
    cut = "| a | b |\n|---|---|\n| 1 | 2 |\n\n#### heading\ntext\n| 3 | 4 |\n| 5 | 6 |\n"
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(cut)
    assert _stray_rows(html) == ["| 3 | 4 |", "| 5 | 6 |"]
    whole = "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n"
    assert _stray_rows(markdown_it.MarkdownIt("commonmark").enable("table").render(whole)) == []


def test_the_rendered_docstrings_cite_no_spec_section():
    """Every object the Python API page renders (its ``:::`` entries and their members) names
    PyTorch's source, never a section of our internal spec."""
    import importlib
    import inspect
    import re

    page = (Path(__file__).parents[2] / "docs/reference/python-api.md").read_text()
    offences = []
    for dotted in re.findall(r"^::: (\S+)", page, flags=re.M):
        module_name, _, attr = dotted.rpartition(".")
        try:
            obj = importlib.import_module(dotted)
        except ImportError:
            obj = getattr(importlib.import_module(module_name), attr)
        if inspect.ismodule(obj):
            members = [getattr(obj, name) for name in getattr(obj, "__all__", [])]
        else:
            members = [obj, *(m for _, m in inspect.getmembers(obj) if callable(m))]
        for member in members:
            doc = inspect.getdoc(member) or ""
            if "§" in doc:
                offences.append(getattr(member, "__qualname__", repr(member)))
    assert offences == []
