"""Frame file and function names that carry HTML, markup or escapes are shown as written."""

from __future__ import annotations

import html
import pickle
import sys
from pathlib import Path

import pytest

from oomkit.interfaces.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from _hostile_support import assert_within_bounds, base_snapshot, run_bounded  # noqa: E402

# (file name, function name) pairs a hostile snapshot could carry.
NAMES = {
    "script_tag": ("/home/u/<script>alert('x')</script>.py", "step"),
    "img_onerror": ("/home/u/train.py", '<img src=x onerror="alert(1)">'),
    "close_style": ("/home/u/</style><script>alert(2)</script>.py", "fwd"),
    "attribute_break": ('/home/u/a" onmouseover="alert(3).py', "x' onfocus='alert(4)"),
    "entities": ("/home/u/&lt;b&gt;&amp;.py", "f&#60;script&#62;"),
    "javascript_url": ("javascript:alert(5)//.py", "<a href=javascript:alert(6)>go</a>"),
    "svg_onload": ("/home/u/<svg onload=alert(7)>.py", "<iframe src=//evil>"),
}


def _snapshot(tmp_path: Path, filename: str, function: str) -> Path:
    data = base_snapshot()
    for frame in data["segments"][0]["blocks"][0]["frames"]:
        frame.update(filename=filename, name=function)
    for entry in data["device_traces"][0]:
        for frame in entry.get("frames", []):
            frame.update(filename=filename, name=function)
    path = tmp_path / "hostile_names.pickle"
    path.write_bytes(pickle.dumps(data))
    return path


@pytest.mark.parametrize("name", sorted(NAMES))
def test_explain_html_escapes_frame_names(tmp_path, name):
    """explain SNAPSHOT --html: the names appear escaped, never as markup; the page runs no script."""
    filename, function = NAMES[name]
    path = _snapshot(tmp_path, filename, function)
    page_path = tmp_path / "report.html"
    result = run_bounded(lambda: main(["explain", str(path), "--html", str(page_path)]))
    assert_within_bounds(result)
    assert result.value == 0, result.error
    page = page_path.read_text()
    basename = filename.rsplit("/", 1)[-1]
    for raw in (basename, function):
        if any(c in raw for c in "<>&\"'"):
            assert raw not in page
    assert html.escape(function) in page or html.escape(function, quote=False) in page
    lowered = page.lower()
    # No element or attribute from the input: only the escaped text.
    for tag in ("<script", "<img", "<iframe", "<svg onload", "<a href", 'href="javascript:', "<b>"):
        assert tag not in lowered


@pytest.mark.parametrize(
    ("filename", "shown"),
    [
        ("/home/u/[bold]MARKUP[/bold].py", "[bold]MARKUP[/bold].py"),
        ("/home/u/\x1b[31mRED\x1b[0m.py", "\\x1b[31mRED\\x1b[0m.py"),
        ("/home/u/[link=http://evil]x[/link].py", "[link=http://evil]x[/link].py"),
    ],
)
def test_explain_terminal_prints_names_as_written(tmp_path, capsys, monkeypatch, filename, shown):
    """Rich markup and terminal escapes in a file name are printed as the file says."""
    monkeypatch.setenv("COLUMNS", "250")
    path = _snapshot(tmp_path, filename, "step")
    result = run_bounded(lambda: main(["explain", str(path)]))
    assert_within_bounds(result)
    assert result.value == 0, result.error
    out = capsys.readouterr().out
    assert shown in out
    assert "\x1b" not in out
