"""scripts/compile_allocator.py: what it compiles and how it keeps bad input's errors."""

from __future__ import annotations

import ast
import importlib.util
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "compile_allocator.py"


def _script():
    spec = importlib.util.spec_from_file_location("compile_allocator", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _annotations(tree: ast.Module, method: str) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "CachingAllocator":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    a = item.args
                    return {
                        arg.arg: ast.unparse(arg.annotation) if arg.annotation else ""
                        for arg in (*a.args, *a.kwonlyargs)
                    }
    raise AssertionError(f"no CachingAllocator.{method}")


def test_public_methods_take_any_private_ones_keep_their_types(tmp_path):
    """The copy to compile: public CachingAllocator methods (and __init__) take Any, so their own
    checks raise AllocatorUsageError; private hot methods keep int/Block types (compiled fast)."""
    script = _script()
    copy = tmp_path / "caching_allocator.py"
    shutil.copy(script.PACKAGE / "caching_allocator.py", copy)
    script._public_arguments_any(copy)
    tree = ast.parse(copy.read_text())
    assert _annotations(tree, "malloc") == {"self": "", "nbytes": "Any", "stream": "Any"}
    assert _annotations(tree, "free") == {"self": "", "ptr": "Any", "deferred": "Any"}
    assert _annotations(tree, "create_pool")["pool_id"] == "Any"
    assert _annotations(tree, "__init__")["capacity_bytes"] == "Any"
    assert _annotations(tree, "_free_block") == {
        "self": "",
        "block": "Block",
        "allocated_size": "int",
    }


def test_the_compiled_modules_are_the_hot_path():
    """The modules compiled are the ones every malloc and free runs, every replay's seeding
    and snapshot (state), a new segment's cudaMalloc (device_memory) and the replay loop
    (engine), and all exist."""
    script = _script()
    assert set(script.MODULES) == {
        *(f"core/allocator/{name}" for name in (
            "block", "active_blocks", "pools", "best_fit", "caching_allocator", "constants", "stats", "settings",
            "state", "device_memory",
        )),
        "core/replay/engine",
    }
    for name in script.MODULES:
        assert (script.SRC / "oomkit" / f"{name}.py").is_file()


def test_seed_segment_and_its_check_take_any_in_the_copy(tmp_path):
    """The copy of state.py to compile: seed_segment (but its first argument, the allocator's
    parts) and _check_seed take Any, so a bad address raises AllocatorUsageError, not TypeError;
    other functions keep their types."""
    script = _script()
    copy = tmp_path / "state.py"
    shutil.copy(script.PACKAGE / "state.py", copy)
    script._function_arguments_any(copy, ("seed_segment", "_check_seed"))
    tree = ast.parse(copy.read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = {
                a.arg: ast.unparse(a.annotation) if a.annotation else "" for a in node.args.args
            }
    assert found["seed_segment"]["target"] == "SeedTarget"
    assert found["seed_segment"]["address"] == found["seed_segment"]["is_small"] == "Any"
    assert set(found["_check_seed"].values()) == {"Any"}
    assert found["snapshot"]["device"] == "int"
