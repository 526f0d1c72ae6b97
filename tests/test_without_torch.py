"""oomkit imports, and its file-reading commands run, where torch is not installed."""

import json
import subprocess
import sys

# Makes `import torch` fail in the child as it does where torch is not installed.
_BLOCK_TORCH = "import sys; sys.modules['torch'] = None\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _BLOCK_TORCH + code], capture_output=True, text=True, timeout=120
    )


def test_import_without_torch():
    """Every core, analysis and interface package imports without torch."""
    proc = _run(
        "import oomkit, oomkit.allocator, oomkit.trace, oomkit.snapshot, oomkit.replay, "
        "oomkit.analysis, oomkit.cli, oomkit.reports, oomkit.workloads\n"
        "print('torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_demo_runs_without_torch():
    """The demo (a file-free simulation) runs without torch."""
    proc = _run("from oomkit.cli import main; sys.exit(main(['demo', '--steps', '2', '--json']))")
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)["results"]) == {"default", "expandable_segments:True"}
