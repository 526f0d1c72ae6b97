"""Architecture checks: imports only go down the layers, and every __all__ name imports.

The layers (docs/ARCHITECTURE.md), lowest first. A module may import only from its own unit or
from a unit of a strictly lower rank: two units of the same rank never import each other.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import oomkit

SRC = Path(oomkit.__file__).parent

# Rank of each unit: a top-level module or package, or a subpackage of the layered folders.
RANK = {
    # base: the error family, then unit conversions; every layer uses them
    "errors": 0,
    "units": 1,
    # core: trace records, the allocator simulator and the GPU catalog know nothing of each other;
    # snapshot files and the built-in workload produce traces; the target joins a GPU and an
    # allocator config; replay drives the simulator from traces and snapshots
    "core": 2,
    "core.trace": 2,
    "core.allocator": 2,
    "core.gpus": 2,
    "core.snapshot": 3,
    "core.workloads": 3,
    "core.target": 3,
    "core.replay": 4,
    # prediction: the GPU-free recorder and the presets, then the predictor that replays them
    "prediction.tracing": 5,
    "prediction.models": 5,
    "prediction": 6,
    # plan: what-if searches (allocator settings, batch size), on replays and predictions
    "plan": 7,
    # diagnose: causes and ranked remedies, priced with plan's searches and re-predictions
    "diagnose": 8,
    # runtime: code that runs inside the user's CUDA process
    "runtime": 9,
    # interfaces: reports and callbacks, then the CLI, then the Python API facade
    "interfaces": 10,
    "interfaces.reports": 10,
    "interfaces.integrations": 10,
    "interfaces.cli": 11,
    "__init__": 12,
    "__main__": 12,
}
# Third-party packages that only the interface layer may import.
INTERFACE_ONLY = {"rich", "argparse", "typer", "click", "pynvml"}
# The one exception: the monitor (runtime) reads NVML, only through this small provider module.
ALLOWED = {("pynvml", "runtime/_nvml.py")}
INTERFACES = RANK["interfaces"]


def unit_of(dotted: str) -> str:
    """The unit a module belongs to: the longest RANK key that prefixes its dotted path."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in RANK:
            return key
    raise KeyError(dotted)


def _module_files():
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
        yield ".".join(parts), path


def _oomkit_imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_every_module_has_a_layer():
    """A new top-level module or layered subpackage must be placed in a layer deliberately."""
    missing = set()
    for dotted, _ in _module_files():
        try:
            unit_of(dotted)
        except KeyError:
            missing.add(dotted)
    assert missing == set()
    # Every subpackage of the layered folders has its own rank, so that siblings are ordered.
    for folder in ("core", "interfaces"):
        for sub in (SRC / folder).iterdir():
            name = sub.name.removesuffix(".py")
            if name not in {"__init__", "__pycache__", "ruff.toml"}:
                assert f"{folder}.{name}" in RANK, f"{folder}/{sub.name} has no rank"


def test_the_ranks_are_strict():
    """The unit lookup sees the order: a core file is below every prediction file, and so on."""
    assert unit_of("core.allocator.caching_allocator") == "core.allocator"
    assert unit_of("prediction.predictor") == "prediction"
    assert unit_of("prediction.tracing.recorder") == "prediction.tracing"
    assert RANK["core.replay"] > RANK["core.snapshot"] > RANK["core.trace"]
    assert RANK["core.replay"] < RANK["prediction.tracing"] < RANK["prediction"] < RANK["plan"]
    assert RANK["plan"] < RANK["diagnose"] < RANK["runtime"] < RANK["interfaces.cli"]


def test_imports_only_go_down():
    """No module imports an oomkit module of its own rank or higher outside its own unit."""
    offences = []
    for dotted, path in _module_files():
        unit = unit_of(dotted)
        rank = RANK[unit]
        rel = path.relative_to(SRC).as_posix()
        for name in _oomkit_imports(path):
            parts = name.split(".")
            if parts[0] == "oomkit" and len(parts) > 1:
                target = unit_of(".".join(parts[1:]))
                own = target == unit or target.startswith(unit + ".") or unit.startswith(target + ".")
                if not own and RANK[target] >= rank:
                    offences.append(f"{rel} imports {name}")
                elif own and target != unit and RANK[target] > rank:
                    offences.append(f"{rel} imports {name}")
            elif parts[0] in INTERFACE_ONLY and rank < INTERFACES and (parts[0], rel) not in ALLOWED:
                offences.append(f"{rel} imports {name}")
    assert offences == []


def test_every_public_name_imports():
    """Every name in every package's __all__ exists."""
    names = ["oomkit"] + [
        m.name for m in pkgutil.walk_packages(oomkit.__path__, "oomkit.") if m.ispkg
    ]
    for name in names:
        try:
            package = importlib.import_module(name)
        except ImportError as exc:  # an optional framework (lightning, transformers) is missing
            assert "oomkit" not in str(exc), exc
            continue
        for public in getattr(package, "__all__", []):
            assert hasattr(package, public), f"{package.__name__}.{public}"
