"""Start-up imports only what a command uses (issue 19): checked by module names, not timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomkit.core.snapshot import write_snapshot
from oomkit.core.trace import TraceEvent

REPO = Path(__file__).resolve().parents[3]

# Run in a fresh interpreter; prints the exit code and the imported module names as JSON.
_PROBE = """
import contextlib, io, json, sys
{setup}
rc = None
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        {call}
    except SystemExit as exc:
        rc = exc.code
print(json.dumps({{"rc": rc, "modules": sorted(sys.modules)}}))
"""

# A whole OOM message as PyTorch 2.x prints it (c10/cuda/CUDACachingAllocator.cpp's OOM text).
_OOM_TEXT = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.65 GiB of which 1.13 GiB is free. Including non-PyTorch memory, this process "
    "has 22.51 GiB memory in use. Of the allocated memory 21.90 GiB is allocated by PyTorch, and "
    "151.04 MiB is reserved by PyTorch but unallocated."
)

# Never imported by the file commands: torch, and the layers they do not use.
HEAVY = ("torch", "oomkit.prediction", "oomkit.runtime", "oomkit.plan")
# Never imported by a command that reads a snapshot or an error text (issue 41 item 4): the typed
# request of predict and fit (pydantic), numpy, the installed packages' metadata, the
# re-prediction machinery (the target, the workload record, measured remedies), the GPU catalog's
# name lookup and CUDA builds, the trace file format, the fork pool (only --jobs above 1 and
# several settings fork), and shutil (argparse's help width is read without it).
UNUSED_BY_FILE_COMMANDS = (
    "torch",
    "pydantic",
    "numpy",
    "importlib.metadata",
    "oomkit.scenario",
    "oomkit.prediction",
    "oomkit.runtime",
    "oomkit.core.target",
    "oomkit.core.gpus.lookup",
    "oomkit.core.gpus.cuda_versions",
    "oomkit.core.gpus.nccl",
    "oomkit.core.trace.io",
    "oomkit.diagnose.remedy_measurement",
    "multiprocessing",
    "concurrent.futures",
    "shutil",
)


def _modules(call: str, setup: str = "") -> tuple[object, set[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(setup=setup, call=call)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["rc"], set(data["modules"])


def _loaded(modules: set[str], prefix: str) -> list[str]:
    return sorted(m for m in modules if m == prefix or m.startswith(prefix + "."))


def _small_snapshot(path: Path) -> Path:
    """A 3-event snapshot: one 512-byte block allocated and freed in a 2 MiB segment."""
    a = 0x7000_0000_0000
    write_snapshot(
        path,
        [{"address": a, "total_size": 2**21, "segment_type": "small", "blocks": [
            {"address": a, "size": 2**21, "state": "inactive"}]}],
        [[TraceEvent("alloc", a, 512), TraceEvent("free_requested", a, 512),
          TraceEvent("free_completed", a, 512)]],
    )
    return path


def test_import_oomkit_imports_no_torch_rich_or_upper_layers():
    """``import oomkit`` loads errors, units and the version only; the API loads on first use."""
    _, modules = _modules("import oomkit")
    for name in (*HEAVY, "rich", "pydantic", "oomkit.interfaces", "oomkit.diagnose",
                 "oomkit.core.replay"):
        assert _loaded(modules, name) == [], name


def test_facade_names_resolve_lazily():
    """Every name in ``oomkit.__all__`` resolves, and only then is its module imported."""
    rc, modules = _modules(
        "import oomkit; missing = [n for n in oomkit.__all__ if getattr(oomkit, n, None) is None]; "
        "assert not missing, missing; assert 'predict' in dir(oomkit); rc = 0"
    )
    assert rc == 0
    assert "oomkit.prediction.predictor" in modules
    assert "torch" not in modules  # predict imports torch only when it runs


def test_replay_file_imports_only_core_and_its_report(tmp_path):
    """``oomkit replay FILE --verify --json`` imports no torch, rich, predictor, runtime, planner
    or report module but the replay one."""
    path = _small_snapshot(tmp_path / "s.pickle")
    rc, modules = _modules(
        f"main(['replay', {str(path)!r}, '--verify', '--json'])",
        setup="from oomkit.interfaces.cli import main",
    )
    assert rc is None  # main returned (0) instead of exiting
    # multiprocessing and concurrent.futures: only a --what-if over several settings forks
    # (issue 41 item 4: together a third of this command's start-up).
    for name in (*HEAVY, "oomkit.diagnose", "rich", "multiprocessing", "concurrent.futures"):
        assert _loaded(modules, name) == [], name
    assert _loaded(modules, "oomkit.interfaces.reports") == [
        "oomkit.interfaces.reports",
        "oomkit.interfaces.reports.replay",
    ]
    assert _loaded(modules, "oomkit.interfaces.cli") == [
        "oomkit.interfaces.cli",
        "oomkit.interfaces.cli._common",
        "oomkit.interfaces.cli._progress",  # --jobs for --what-if; rich.progress stays unloaded
        "oomkit.interfaces.cli._stdout",  # a write that fails: exit 141 or one line
        "oomkit.interfaces.cli.replay",
    ]
    assert _loaded(modules, "rich.progress") == []


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["explain", "CUDA out of memory. Tried to allocate 2.00 GiB"]],
    ids=["help", "explain"],
)
def test_help_and_explain_never_import_torch(argv):
    """``oomkit --help`` and ``oomkit explain TEXT`` run without importing torch."""
    rc, modules = _modules(f"main({argv!r})", setup="from oomkit.interfaces.cli import main")
    assert rc in (0, None)
    assert _loaded(modules, "torch") == []


def test_explain_builds_only_its_own_parser():
    """``oomkit explain TEXT`` imports its own subcommand module, not the other nine."""
    _, modules = _modules(
        "main(['explain', 'CUDA out of memory. Tried to allocate 2.00 GiB'])",
        setup="from oomkit.interfaces.cli import main",
    )
    commands = {m.rsplit(".", 1)[1] for m in _loaded(modules, "oomkit.interfaces.cli")}
    assert "explain" in commands
    assert not commands & {"predict", "demo", "replay", "simulate", "tune", "run", "fit",
                           "experiment", "report"}


def test_help_imports_no_subcommand_module():
    """``oomkit --help`` lists the subcommands without importing any of their modules, nor rich,
    the version's package metadata (importlib.metadata) or any layer but errors and units."""
    rc, modules = _modules("main(['--help'])", setup="from oomkit.interfaces.cli import main")
    assert rc == 0
    assert _loaded(modules, "oomkit.interfaces.cli") == ["oomkit.interfaces.cli"]
    for name in (*HEAVY, "rich", "pydantic", "importlib.metadata", "oomkit.core",
                 "oomkit.diagnose", "shutil"):
        assert _loaded(modules, name) == [], name


@pytest.mark.parametrize("columns", ["57", "200", "0", "wide", None])
def test_help_width_is_argparses_own(monkeypatch, columns):
    """The help is as wide as argparse would make it (shutil's terminal columns less 2), with
    ``$COLUMNS`` set, zero, not a number or unset (then the terminal's, else 80)."""
    import shutil

    from oomkit.interfaces.cli import _help_width

    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert _help_width() == shutil.get_terminal_size().columns - 2


def test_summary_help_is_the_full_parsers_help():
    """The summary parser's ``--help`` is character for character the full parser's: each
    one-line summary is the one the subcommand's ``add_parser`` registers."""
    from oomkit.interfaces.cli import build_parser, summary_parser

    assert summary_parser().format_help() == build_parser().format_help()


def test_explain_text_imports_only_the_text_diagnosis():
    """``oomkit explain TEXT`` imports the OOM-text diagnosis and its report (rich's console and
    table), not the snapshot or leak diagnoses, the planner, the predictor or rich's progress."""
    rc, modules = _modules(f"main(['explain', {_OOM_TEXT!r}])",
                           setup="from oomkit.interfaces.cli import main")
    assert rc is None  # main returned (0): a diagnosis was rendered
    for name in (*HEAVY, *UNUSED_BY_FILE_COMMANDS, "oomkit.core.replay",
                 "oomkit.core.allocator", "oomkit.diagnose.memory_health",
                 "oomkit.diagnose.snapshot_diagnosis", "rich.progress", "rich.live"):
        assert _loaded(modules, name) == [], name
    assert "oomkit.diagnose.diagnosis" in modules
    assert "rich.console" in modules
    assert _loaded(modules, "oomkit.interfaces.reports") == [
        "oomkit.interfaces.reports",
        "oomkit.interfaces.reports._untrusted",  # escapes the error text's markup
        "oomkit.interfaces.reports.diagnosis",
    ]


def test_explain_snapshot_imports_no_prediction_catalog_or_text_parser(tmp_path):
    """``oomkit explain SNAPSHOT`` diagnoses, prices the allocator settings and renders its
    tables without the re-prediction machinery, the GPU catalog, the traceback reader, or
    compiling one pattern of the OOM-text parser (its records are all it uses)."""
    path = _small_snapshot(tmp_path / "s.pickle")
    rc, modules = _modules(
        f"main(['explain', {str(path)!r}]); "
        # rc: the names of the OOM-text patterns compiled by the time the command is done.
        "import oomkit.diagnose.oom_text as t; from oomkit._lazy import LazyPattern; "
        "rc = sorted(n for n, v in vars(t).items() "
        "if isinstance(v, LazyPattern) and v._compiled is not None)",
        setup="from oomkit.interfaces.cli import main",
    )
    assert rc == []
    for name in (*UNUSED_BY_FILE_COMMANDS, "oomkit.core.gpus.catalog",
                 "oomkit.diagnose.oom_traceback", "oomkit.diagnose.measured_remedy",
                 "rich.progress"):
        assert _loaded(modules, name) == [], name
    # It did diagnose (estimates included), price settings and render.
    for name in ("oomkit.diagnose.snapshot_diagnosis", "oomkit.diagnose._model_remedies",
                 "oomkit.plan.tuning", "rich.table"):
        assert name in modules, name


def test_explain_snapshot_json_imports_no_rich(tmp_path):
    """``oomkit explain SNAPSHOT --json`` renders nothing, so it imports no rich at all."""
    path = _small_snapshot(tmp_path / "s.pickle")
    rc, modules = _modules(f"main(['explain', {str(path)!r}, '--json'])",
                           setup="from oomkit.interfaces.cli import main")
    assert rc is None
    for name in (*UNUSED_BY_FILE_COMMANDS, "rich"):
        assert _loaded(modules, name) == [], name


@pytest.mark.parametrize(
    "argv",
    [["replay", "--verify"], ["tune", "--jobs", "1"]],
    ids=["replay-verify", "tune"],
)
def test_replay_and_tune_tables_import_no_catalog_or_diagnosis(tmp_path, argv):
    """``oomkit replay SNAPSHOT --verify`` and ``oomkit tune SNAPSHOT`` render their rich tables
    without the GPU catalog, any diagnosis, the trace file format or pydantic."""
    path = _small_snapshot(tmp_path / "s.pickle")
    words = [argv[0], str(path), *argv[1:]]
    rc, modules = _modules(f"main({words!r})", setup="from oomkit.interfaces.cli import main")
    assert rc is None
    for name in (*UNUSED_BY_FILE_COMMANDS, "oomkit.core.gpus", "oomkit.diagnose"):
        assert _loaded(modules, name) == [], name
    assert "rich.table" in modules


@pytest.mark.parametrize("json_flag", [False, True], ids=["text", "json"])
def test_diff_imports_no_html_page_builder(tmp_path, json_flag):
    """``oomkit diff A B`` builds no HTML page without ``--html`` (and with ``--json`` renders
    nothing, so no rich)."""
    a = _small_snapshot(tmp_path / "a.pickle")
    b = _small_snapshot(tmp_path / "b.pickle")
    words = ["diff", str(a), str(b), *(["--json"] if json_flag else [])]
    rc, modules = _modules(f"main({words!r})", setup="from oomkit.interfaces.cli import main")
    assert rc is None
    for name in (*UNUSED_BY_FILE_COMMANDS, "oomkit.interfaces.reports.html", "html",
                 *(["rich"] if json_flag else [])):
        assert _loaded(modules, name) == [], name
    assert "oomkit.diagnose.run_diff" in modules


def test_report_reads_monitor_logs_without_the_allocator_or_the_runtime(tmp_path):
    """``oomkit report LOG`` summarises a monitor log without the allocator, the snapshot
    reader, the settings sweep, the rest of the runtime (Monitor, experiments, batch probes) or
    the HTML page builder."""
    from oomkit.runtime.monitor import Monitor

    class _Device:
        name = "fake"

        def memory_stats(self):
            return {"allocated_bytes.all.current": 2**23, "reserved_bytes.all.current": 2**24,
                    "num_ooms": 0}

        def reset_peak_memory_stats(self):
            pass

        def mem_get_info(self):
            return 0, 2**25

    log = tmp_path / "m.jsonl"
    with Monitor(log_path=log, device=_Device()) as monitor:
        for _ in range(3):
            monitor.step()
    rc, modules = _modules(f"main(['report', {str(log)!r}])",
                           setup="from oomkit.interfaces.cli import main")
    assert rc is None
    # The log reader is the runtime's one module it needs.
    assert _loaded(modules, "oomkit.runtime") == ["oomkit.runtime", "oomkit.runtime._monitor_log"]
    unused = [name for name in UNUSED_BY_FILE_COMMANDS if name != "oomkit.runtime"]
    for name in (*unused, "oomkit.core.allocator", "oomkit.core.snapshot", "oomkit.plan",
                 "oomkit.interfaces.reports.html", "logging"):
        assert _loaded(modules, name) == [], name
    assert "oomkit.diagnose.memory_health" in modules and "rich.table" in modules


def test_doctor_without_the_live_allocator_reads_no_package_metadata():
    """``oomkit doctor --no-live`` finds the installed torch's version without importing torch
    or the package metadata (importlib.metadata and its email and zipfile modules)."""
    rc, modules = _modules("main(['doctor', '--no-live'])",
                           setup="from oomkit.interfaces.cli import main")
    assert rc is None
    for name in (*UNUSED_BY_FILE_COMMANDS, "email", "zipfile"):
        assert _loaded(modules, name) == [], name
    assert "oomkit.diagnose.settings_doctor" in modules


# console_main: what the `oomkit` command and `python -m oomkit` run.


def test_console_main_exits_with_mains_code_and_freezes_what_is_alive(monkeypatch):
    """The exit code is main's; every object alive is frozen out of the collections Python's
    shut-down runs (with torch imported they cost 0.5-0.8 s of a command's wall time)."""
    import gc

    import oomkit.interfaces.cli as cli

    monkeypatch.setattr(cli, "main", lambda: 3)
    gc.unfreeze()
    try:
        with pytest.raises(SystemExit) as exited:
            cli.console_main()
        assert exited.value.code == 3
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_console_main_runs_the_cyclic_collector_rarely(monkeypatch):
    """Before the command runs, the youngest generation is collected every 200,000 allocations
    instead of CPython's 700 (mypy's thresholds): a command's imports make no garbage cycles."""
    import gc

    import oomkit.interfaces.cli as cli

    seen: list[tuple[int, ...]] = []
    monkeypatch.setattr(cli, "main", lambda: seen.append(gc.get_threshold()) or 0)
    # The test process keeps its generations and its exit handlers.
    monkeypatch.setattr(gc, "freeze", lambda: None)
    monkeypatch.setattr(cli.atexit, "register", lambda handler: handler)
    before = gc.get_threshold()
    try:
        with pytest.raises(SystemExit):
            cli.console_main()
        assert seen == [(200_000, 30, 30)]
    finally:
        gc.set_threshold(*before)


def test_what_teardown_writes_is_not_printed_and_atexit_messages_are(tmp_path):
    """After the command, module teardown's writes to stderr (nanobind's "leaked instances"
    report of objects the freeze keeps) are silenced; the message of an atexit handler that a
    command registered (torch's, Ray's) still shows."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    code = (
        "import atexit, os, runpy, sys\n"
        "class Late:\n"
        "    def __del__(self):\n"
        "        os.write(2, b'TEARDOWN-NOISE\\n')\n"
        "late = Late()\n"
        "sys.modules['late_holder'] = type(sys)('late_holder')\n"
        "sys.modules['late_holder'].late = late\n"
        "del late\n"
        "import oomkit.interfaces.cli as cli\n"
        "command = cli.main\n"
        "def main():\n"  # as torch, imported by a command, registers its handlers
        "    atexit.register(lambda: print('ATEXIT-MESSAGE', file=sys.stderr))\n"
        "    return command()\n"
        "cli.main = main\n"
        "sys.argv = ['oomkit', 'gpus', '--json']\n"
        "runpy.run_module('oomkit', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "ATEXIT-MESSAGE" in done.stderr
    assert "TEARDOWN-NOISE" not in done.stderr
    assert json.loads(done.stdout)["gpus"]
    # Without console_main's handler the same object does write at teardown: the test can fail.
    plain = subprocess.run(
        [sys.executable, "-c", code.replace("runpy.run_module('oomkit', run_name='__main__')",
                                            "pass")],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )
    assert "TEARDOWN-NOISE" in plain.stderr


def test_the_oomkit_command_runs_console_main_and_keeps_its_exit_code(tmp_path):
    """`python -m oomkit` (as the installed script) exits with the command's code, its output
    whole, and what atexit handlers do still happens after the freeze."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    marker = tmp_path / "atexit-ran"
    code = (
        "import atexit, pathlib, runpy, sys; "
        f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes'); "
        "sys.argv = ['oomkit', 'gpus', '--json']; runpy.run_module('oomkit', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert any(gpu["name"] == "H100 SXM 80GB" for gpu in json.loads(done.stdout)["gpus"])
    assert marker.read_text() == "yes"
    bad = subprocess.run([sys.executable, "-m", "oomkit", "predict", "no-such-preset"],
                         capture_output=True, text=True, env=env, timeout=60, check=False)
    assert bad.returncode == 2
    assert "no-such-preset" in bad.stderr
