"""Architecture checks: imports only go down the layers, and every __all__ name imports."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import oomkit

SRC = Path(oomkit.__file__).parent

# Layer of each top-level module or package under src/oomkit (style.md "Layers").
LAYER = {
    "errors": 0,
    "units": 0,
    "allocator": 1,
    "trace": 1,
    "snapshot": 1,
    "replay": 1,
    "workloads": 1,
    "tracing": 1,
    "gpus": 1,
    "models": 1,
    "analysis": 2,
    "runtime": 3,
    "cli": 4,
    "reports": 4,
    "integrations": 4,
    "__init__": 4,
    "__main__": 4,
}
# Third-party packages that only the interface layer may import.
INTERFACE_ONLY = {"rich", "argparse", "typer", "click", "pynvml"}
# The one exception: the monitor (layer 3) reads NVML, only through this small provider module.
ALLOWED = {("pynvml", "runtime/_nvml.py")}


def _module_files():
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        yield rel.parts[0].removesuffix(".py"), path


def test_every_module_has_a_layer():
    """A new top-level module must be placed in a layer deliberately."""
    missing = {top for top, _ in _module_files()} - set(LAYER)
    assert missing == set()


def test_imports_only_go_down():
    """No module imports an oomkit module of a higher layer, nor an interface-only library."""
    offences = []
    for top, path in _module_files():
        layer = LAYER[top]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "oomkit" and len(parts) > 1:
                    if LAYER.get(parts[1], 0) > layer:
                        offences.append(f"{path.relative_to(SRC)} imports {name}")
                elif (
                    parts[0] in INTERFACE_ONLY
                    and layer < 4
                    and (parts[0], path.relative_to(SRC).as_posix()) not in ALLOWED
                ):
                    offences.append(f"{path.relative_to(SRC)} imports {name}")
    assert offences == []


def test_every_public_name_imports():
    """Every name in every package's __all__ exists."""
    packages = [oomkit] + [
        importlib.import_module(f"oomkit.{m.name}")
        for m in pkgutil.iter_modules(oomkit.__path__)
        if m.ispkg
    ]
    for package in packages:
        for name in getattr(package, "__all__", []):
            assert hasattr(package, name), f"{package.__name__}.{name}"
