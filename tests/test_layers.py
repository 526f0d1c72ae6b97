"""Architecture checks: imports only go down the layers, and every __all__ name imports.

The layers (docs/ARCHITECTURE.md), lowest first. A module may import only from its own unit or
from a unit of a strictly lower rank: two units of the same rank never import each other.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import oomkit

SRC = Path(oomkit.__file__).parent

# Rank of each unit: a top-level module or package, or a subpackage of the layered folders.
RANK = {
    # base: the error family and the installed version, then unit conversions; every layer uses them
    "errors": 0,
    "_version": 0,
    "_lazy": 0,
    # other libraries' log lines kept quiet while they are imported
    "_logs": 0,
    # which allocator core is installed (compiled or pure), read from the file system
    "_build": 0,
    "units": 1,
    # the files a user names: unreadable inputs, outputs written safely, for every layer
    "_files": 1,
    # "did you mean ...?": the known name closest to a mistyped one, for every layer's messages
    "_names": 1,
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
    # executors: how independent work runs (this process, forked processes, a Ray cluster);
    # processes and signals stay out of core
    "executors": 5,
    # prediction: the GPU-free recorder and the presets, then the predictor that replays them
    "prediction.tracing": 5,
    "prediction.models": 5,
    "prediction": 6,
    # plan: what-if searches (allocator settings, batch size), on replays and predictions
    "plan": 7,
    # diagnose: causes and ranked remedies, priced with plan's searches and re-predictions
    "diagnose": 8,
    # runtime: code that runs inside the user's CUDA process; scenario: the typed request and
    # the library every way in calls (predict, fit), above plan and diagnose
    "runtime": 9,
    "scenario": 9,
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


# The facade and the entry point are above everything; ruff cannot ban them without banning
# `oomkit` itself (banned-api matches a module and every submodule of it).
_FACADE = {"__init__", "__main__"}


def _folder_units() -> list[str]:
    """The units that are folders: each needs a ruff.toml of its own."""
    return sorted(
        unit
        for unit in RANK
        if unit not in _FACADE and (SRC / unit.replace(".", "/")).is_dir()
    )


def _own_modules(unit: str) -> set[str]:
    """The modules and subpackages directly in a folder unit that belong to the unit itself."""
    names = {p.name.removesuffix(".py") for p in (SRC / unit.replace(".", "/")).iterdir()}
    names = {n for n in names if not n.startswith(".")} - {"__init__", "__pycache__", "ruff.toml"}
    return {f"{unit}.{name}" for name in names if unit_of(f"{unit}.{name}") == unit}


def expected_bans(folder: str) -> set[str]:
    """What the folder's ruff.toml must ban (TID251), by the rule test_imports_only_go_down checks.

    A unit of a higher rank is banned; so is another unit of the same rank, except the folder's
    own ancestors and descendants. An ancestor of a higher rank (``prediction`` above
    ``prediction.tracing``) cannot be banned whole (that would ban the folder itself): its own
    modules are. A ban covers its submodules, so a unit inside a banned one is not listed.
    Below the interfaces, the interface-only packages are banned too.
    """
    rank = RANK[folder]
    bans: set[str] = set()
    for unit, other in RANK.items():
        if unit in _FACADE or unit == folder:
            continue
        if folder.startswith(unit + "."):  # an ancestor
            if other > rank:
                bans |= _own_modules(unit)
        elif unit.startswith(folder + "."):  # a descendant
            if other > rank:
                bans.add(unit)
        elif other >= rank:
            bans.add(unit)
    bans = {b for b in bans if not any(b.startswith(p + ".") for p in bans)}
    names = {f"oomkit.{b}" for b in bans}
    return names | (INTERFACE_ONLY if rank < INTERFACES else set())


def test_every_layer_folder_bans_the_layers_above_it():
    """Each layer folder's ruff.toml bans exactly what RANK puts at or above it (no drift)."""
    tomllib = pytest.importorskip("tomllib")
    for folder in _folder_units():
        expected = expected_bans(folder)
        path = SRC / folder.replace(".", "/") / "ruff.toml"
        # Even a folder that bans nothing needs one: ruff would apply its parent folder's.
        assert path.is_file(), f"{folder} needs a ruff.toml banning {sorted(expected)}"
        config = tomllib.loads(path.read_text())
        assert (SRC.parents[1] / "pyproject.toml").samefile(path.parent / config["extend"])
        banned = config.get("lint", {}).get("flake8-tidy-imports", {}).get("banned-api", {})
        assert set(banned) == expected, folder
        assert all(entry["msg"] for entry in banned.values())


def test_the_ban_rule_on_two_folders():
    """The rule, spelled out: core/trace bans its siblings and everything above core."""
    assert expected_bans("core.trace") == {
        "oomkit.core.allocator",
        "oomkit.core.gpus",
        "oomkit.core.snapshot",
        "oomkit.core.workloads",
        "oomkit.core.target",
        "oomkit.core.replay",
        "oomkit.executors",
        "oomkit.prediction",
        "oomkit.plan",
        "oomkit.diagnose",
        "oomkit.runtime",
        "oomkit.scenario",
        "oomkit.interfaces",
        *INTERFACE_ONLY,
    }
    assert expected_bans("prediction.tracing") == {
        "oomkit.executors",
        "oomkit.prediction.models",
        "oomkit.prediction.module_groups",
        "oomkit.prediction.predictor",
        "oomkit.prediction.recording_cache",
        "oomkit.prediction._replay",
        "oomkit.prediction.distributed_memory",
        "oomkit.prediction.envelope",
        "oomkit.prediction.lengths",
        "oomkit.prediction.scripts",
        "oomkit.prediction.own_alloc_conf",
        "oomkit.prediction.summary",
        "oomkit.prediction.serving",
        "oomkit.prediction.workload",
        "oomkit.prediction.torchtitan_job",
        "oomkit.prediction._torchtitan_env",
        "oomkit.prediction._torchtitan_pipeline",
        "oomkit.prediction._torchtitan_cp",
        "oomkit.prediction._torchtitan_cp_compile",
        "oomkit.prediction._torchtitan_float8",
        "oomkit.prediction._torchtitan_init",
        "oomkit.prediction._torchtitan_ranks",
        "oomkit.plan",
        "oomkit.diagnose",
        "oomkit.runtime",
        "oomkit.scenario",
        "oomkit.interfaces",
        *INTERFACE_ONLY,
    }
    assert expected_bans("interfaces.reports") == {
        "oomkit.interfaces.integrations",
        "oomkit.interfaces.cli",
    }
