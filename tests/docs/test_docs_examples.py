"""The commands shown in the README and the documentation site run, and print what is shown.

Every fenced ```console or ```bash block whose first command starts with ``oomkit`` or
``python -m oomkit`` (after any ``VAR=value`` assignments) is an example. Each command of it runs
in a subprocess, in a scratch folder that sees the repository's ``examples/``, ``tests/`` and
``benchmarks/`` and the shared snapshots as ``../shared``, with this checkout's sources first on
``PYTHONPATH``. It must exit with the code an ``<!-- exit: N -->`` comment above the block states
(0 when none does). In a console block, each line shown after a ``$ `` command is output that
command must print (stdout or stderr, whitespace runs compared as one space); a line ``...``
stands for lines left out, and a line ending in `` ...`` for the rest of that line.

A block that costs more than a few seconds, or needs files or a GPU the reader has, carries
``<!-- not-run: REASON -->`` on a line above it; the reason is required, and the block is
reported as skipped with it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*(not-run|exit)\s*:?\s*(.*?)\s*-->\s*$")
_ASSIGNMENTS = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*")
_LANGUAGES = ("console", "bash")
# A command that runs longer than this is a documentation bug: mark it not-run.
TIMEOUT_S = 120


@dataclass(frozen=True)
class Command:
    """One command of an example, with the output lines a console block shows for it."""

    text: str
    expected: tuple[str, ...]


@dataclass(frozen=True)
class Example:
    """One fenced block that starts with an oomkit command."""

    page: str
    line: int
    language: str
    commands: tuple[Command, ...]
    exit_code: int
    not_run: str | None


def _is_oomkit(command: str) -> bool:
    rest = command[_ASSIGNMENTS.match(command).end() :]  # type: ignore[union-attr]
    return rest.startswith("oomkit ") or rest == "oomkit" or rest.startswith("python -m oomkit")


def _markers(lines: list[str], fence_index: int) -> dict[str, str]:
    """The ``<!-- not-run: ... -->`` / ``<!-- exit: N -->`` comments just above a fence (blank
    lines between them allowed)."""
    found: dict[str, str] = {}
    index = fence_index - 1
    while index >= 0 and (not lines[index].strip() or _MARKER.match(lines[index])):
        match = _MARKER.match(lines[index])
        if match:
            found.setdefault(match.group(1), match.group(2))
        index -= 1
    return found


def _join_continuations(lines: list[str]) -> list[str]:
    joined: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1].rstrip() + " "
            continue
        joined.append(pending + line.strip() if pending else line)
        pending = ""
    if pending:
        joined.append(pending)
    return joined


def _console_commands(body: list[str]) -> list[Command]:
    commands: list[list[str]] = []  # [command, output lines...]
    continuing = False
    for line in body:
        if line.startswith("$ "):
            commands.append([line[2:]])
            continuing = line.rstrip().endswith("\\")
        elif continuing and commands:
            commands[-1][0] = commands[-1][0].rstrip()[:-1].rstrip() + " " + line.strip()
            continuing = line.rstrip().endswith("\\")
        elif commands:
            commands[-1].append(line)
    return [Command(c[0].strip(), tuple(c[1:])) for c in commands]


def _bash_commands(body: list[str]) -> list[Command]:
    lines = [line for line in _join_continuations(body) if line.strip()]
    return [Command(line.strip(), ()) for line in lines if not line.lstrip().startswith("#")]


def extract_examples(path: Path) -> list[Example]:
    """Every example block of one Markdown file."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = str(path.relative_to(ROOT))
    examples: list[Example] = []
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if not match:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        language, body = match.group(1), lines[index + 1 : end]
        if language in _LANGUAGES:
            commands = _console_commands(body) if language == "console" else _bash_commands(body)
            if commands and _is_oomkit(commands[0].text):
                markers = _markers(lines, index)
                exit_text = markers.get("exit", "0")
                examples.append(
                    Example(
                        page=page,
                        line=index + 1,
                        language=language,
                        commands=tuple(commands),
                        exit_code=int(exit_text) if exit_text.isdigit() else -1,
                        not_run=markers.get("not-run"),
                    )
                )
        index = end + 1
    return examples


def _all_examples() -> list[Example]:
    return [example for page in PAGES for example in extract_examples(page)]


EXAMPLES = _all_examples()


def _collapse(text: str) -> str:
    return " ".join(text.split())


def _scratch(tmp_path: Path) -> Path:
    """A working folder with the repository's example inputs and ../shared beside it."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("examples", "tests", "benchmarks"):
        (work / name).symlink_to(ROOT / name)
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED)
    return work


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OOMKIT_DOCS_PYTHON"] = sys.executable
    env["HF_HUB_OFFLINE"] = "1"
    return env


# `oomkit` and `python` in an example are this interpreter with this checkout's sources.
_PRELUDE = (
    'oomkit() { "$OOMKIT_DOCS_PYTHON" -m oomkit "$@"; }\npython() { "$OOMKIT_DOCS_PYTHON" "$@"; }\n'
)


def run_command(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run one documented command the way a reader's shell would."""
    return subprocess.run(
        ["bash", "-c", _PRELUDE + command],
        cwd=cwd,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _params() -> list:
    params = []
    for example in EXAMPLES:
        marks = []
        if example.not_run is not None:
            marks.append(pytest.mark.skip(reason=f"not-run: {example.not_run}"))
        params.append(pytest.param(example, id=f"{example.page}:{example.line}", marks=marks))
    return params


@pytest.fixture
def shared_recording_cache(tmp_path_factory, monkeypatch) -> None:
    """The pages show some commands more than once (the demo's predict in the README and the
    getting-started page): their recordings are kept in one cache folder for every example of
    the run (all xdist workers), so a repeated command replays the first one's recording, as it
    would in a reader's shell (prediction/recording_cache.py; a hit prints what a miss does)."""
    folder = tmp_path_factory.getbasetemp().parent / "docs-recording-cache"
    monkeypatch.setenv("OOMKIT_CACHE_DIR", str(folder))


# The results of each block's commands, by the commands and the exit code the page states: two pages that show the same block
# (README.md and docs/howto/predict-your-script.md run one script the same way; the recording
# cache keeps no user code) run it once per process, each in a fresh scratch folder alike, and
# each page's shown lines and exit code are checked against that one real run.
_RUNS: dict[tuple[tuple[str, ...], int], list[subprocess.CompletedProcess[str]]] = {}


def _run_block(example: Example, tmp_path: Path) -> list[subprocess.CompletedProcess[str]]:
    """Each command of ``example`` run in order in a new scratch folder (or the results of the
    same commands run earlier in this process), up to the first whose exit code is not the
    page's."""
    texts = tuple(c.text for c in example.commands)
    key = (texts, example.exit_code)
    if key not in _RUNS:
        work = _scratch(tmp_path)
        results = []
        for text in texts:
            results.append(run_command(text, work))
            if results[-1].returncode != example.exit_code:
                break
        _RUNS[key] = results
    return _RUNS[key]


@pytest.mark.parametrize("example", _params())
def test_documented_command_runs_and_prints_what_is_shown(
    example: Example, tmp_path: Path, shared_recording_cache: None
) -> None:
    if any("../shared/" in c.text for c in example.commands) and not SHARED.is_dir():
        pytest.skip("the shared snapshots are not beside this checkout")
    for command, result in zip(example.commands, _run_block(example, tmp_path), strict=False):
        output = result.stdout + result.stderr
        where = f"{example.page}:{example.line}: {command.text}"
        assert result.returncode == example.exit_code, (
            f"{where} exited {result.returncode}, the page says {example.exit_code}\n{output[-3000:]}"
        )
        printed = _collapse(output)
        for line in command.expected:
            shown = _collapse(line)
            if shown in ("", "..."):
                continue
            if shown.endswith(" ..."):  # a line cut short: what is shown is its start
                shown = shown[: -len(" ...")]
            assert shown in printed, f"{where}: not printed: {line!r}\n{output[-3000:]}"


def test_examples_are_found_and_most_of_the_cheap_ones_run() -> None:
    """The extractor sees the pages' examples: a change of format that hid them all would
    otherwise pass silently."""
    run = [e for e in EXAMPLES if e.not_run is None]
    assert len(EXAMPLES) >= 30
    assert len(run) >= 10
    assert {e.page for e in run} >= {"README.md", "docs/getting-started.md"}


def test_every_marker_has_a_reason_and_a_block() -> None:
    """``not-run`` needs a reason, ``exit`` a number, and each stands just above a fenced
    block (a stray marker would silently apply to nothing)."""
    problems = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            match = _MARKER.match(line)
            if not match:
                continue
            kind, value = match.groups()
            if kind == "not-run" and len(value.split()) < 2:
                problems.append(f"{page.name}:{number}: not-run without a reason")
            if kind == "exit" and not value.isdigit():
                problems.append(f"{page.name}:{number}: exit without a number")
            following = number
            while following < len(lines) and (
                not lines[following].strip() or _MARKER.match(lines[following])
            ):
                following += 1
            if following >= len(lines) or not lines[following].startswith("```"):
                problems.append(f"{page.name}:{number}: marker not followed by a fenced block")
    assert problems == []


def test_extractor_reads_console_and_bash_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- exit: 1 -->\n```console\n$ oomkit predict x \\\n  --gpu t4\nline one\n...\n```\n\n"
        "<!-- not-run: needs a GPU machine -->\n\n```bash\n# comment\nPYTORCH_ALLOC_CONF=a oomkit doctor\n"
        "oomkit replay s.pickle \\\n    --verify\n```\n\n```bash\nmake demo\n```\n",
        encoding="utf-8",
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = extract_examples(page)
    finally:
        ROOT = saved
    assert [(e.language, e.exit_code, e.not_run) for e in found] == [
        ("console", 1, None),
        ("bash", 0, "needs a GPU machine"),
    ]
    assert found[0].commands == (Command("oomkit predict x --gpu t4", ("line one", "...")),)
    assert [c.text for c in found[1].commands] == [
        "PYTORCH_ALLOC_CONF=a oomkit doctor",
        "oomkit replay s.pickle --verify",
    ]
