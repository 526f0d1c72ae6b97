"""Dump, or compare against a dump, every shared snapshot's ``oomkit replay FILE --verify --json``.

A speed change to the allocator or the replay must not change any result (issue 41): run
``python benchmarks/verify_outputs.py dump DIR`` before the change and
``python benchmarks/verify_outputs.py compare DIR`` after it; ``compare`` exits 1 naming every
snapshot whose output (stdout and exit status) is not byte-identical.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SNAPSHOTS = REPO.parent / "shared" / "snapshots"


def snapshots(directory: Path) -> list[Path]:
    """Every ``.pickle``/``.pkl`` file one folder below ``directory``, sorted."""
    return sorted(p for p in directory.glob("*/*") if p.suffix in (".pickle", ".pkl"))


def output_of(path: Path) -> bytes:
    """``oomkit replay PATH --verify --json``'s stdout, then its exit status."""
    done = subprocess.run(
        [sys.executable, "-m", "oomkit", "replay", str(path), "--verify", "--json"],
        capture_output=True,
        env=os.environ.copy(),
        check=False,
    )
    return done.stdout + f"\nexit={done.returncode}\n".encode()


def _name(path: Path) -> str:
    return f"{path.parent.name}__{path.name}.out"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("dump", "compare"))
    parser.add_argument("directory", type=Path, help="where the dump is (or goes)")
    parser.add_argument("--snapshots", type=Path, default=DEFAULT_SNAPSHOTS)
    args = parser.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    differing = []
    for path in snapshots(args.snapshots):
        out = output_of(path)
        target = args.directory / _name(path)
        digest = hashlib.sha256(out).hexdigest()[:12]
        if args.mode == "dump":
            target.write_bytes(out)
            print(f"{digest} {path.parent.name}/{path.name}", flush=True)
        else:
            same = target.is_file() and target.read_bytes() == out
            print(f"{'same' if same else 'DIFFERS'} {digest} {path.parent.name}/{path.name}")
            if not same:
                differing.append(path)
    if differing:
        print(f"{len(differing)} snapshot(s) differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
