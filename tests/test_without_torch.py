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
        "import oomkit, oomkit.core.allocator, oomkit.core.trace, oomkit.core.snapshot, oomkit.core.replay, "
        "oomkit.diagnose, oomkit.plan, oomkit.prediction, oomkit.interfaces.cli, oomkit.interfaces.reports, oomkit.core.workloads\n"
        "print('torch' in sys.modules and sys.modules['torch'] is not None)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_demo_runs_without_torch():
    """The demo (a file-free simulation) runs without torch."""
    proc = _run("from oomkit.interfaces.cli import main; sys.exit(main(['demo', '--steps', '2', '--json']))")
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)["results"]) == {"default", "expandable_segments:True"}


def test_explain_snapshot_runs_without_torch(tmp_path):
    """`oomkit explain SNAPSHOT --json` (diagnosis, attribution, replay-priced remedies) needs no torch."""
    from oomkit.core.snapshot import write_snapshot
    from oomkit.core.trace import Frame, TraceEvent

    mib = 2**20
    frames = (Frame("/home/user/train.py", 7, "step"),)
    events = [
        TraceEvent("segment_alloc", 0, 20 * mib),
        TraceEvent("alloc", 0, 12 * mib, frames=frames),
        TraceEvent("oom", 4 * mib, 40 * mib, frames=frames),
    ]
    segments = [
        {
            "address": 0,
            "total_size": 20 * mib,
            "blocks": [
                {"address": 0, "size": 12 * mib, "state": "active_allocated"},
                {"address": 12 * mib, "size": 8 * mib, "state": "inactive"},
            ],
        }
    ]
    path = write_snapshot(tmp_path / "oom.pickle", segments, {0: events})
    proc = _run(
        f"from oomkit.interfaces.cli import main; sys.exit(main(['explain', {str(path)!r}, '--json']))"
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["source"] == "snapshot"
    assert out["figures"]["requested_bytes"] == 40 * mib
    assert out["figures"]["largest_free_block_bytes"] == 8 * mib
    assert out["attribution"]["top_sites"][0]["label"] == "/home/user/train.py:7 in step"


def test_tracing_without_torch_says_what_to_install():
    """Importing oomkit.prediction.tracing without torch raises TorchRequiredError naming oomkit[torch]."""
    proc = _run(
        "from oomkit.errors import TorchRequiredError\n"
        "try:\n"
        "    import oomkit.prediction.tracing\n"
        "except TorchRequiredError as exc:\n"
        "    print(exc)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert "needs torch; install it with `pip install oomkit[torch]`" in proc.stdout
