"""``oomkit._lazy``: a pattern compiles when first matched and then matches as ``re`` does."""

from __future__ import annotations

import re
import sys

from hypothesis import given
from hypothesis import strategies as st

from oomkit._lazy import LazyPattern

# A size as PyTorch's format_size prints it (diagnose/oom_text.py's _SIZE).
_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|KiB|MiB|GiB)"


def test_nothing_is_compiled_until_the_first_match():
    """Building a LazyPattern compiles nothing; the first match compiles it once, then reuses."""
    pattern = LazyPattern(r"Tried to allocate " + _SIZE)
    assert pattern._compiled is None
    m = pattern.search("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has")
    assert m is not None and m.groups() == ("2.00", "GiB")
    compiled = pattern._compiled
    assert isinstance(compiled, re.Pattern)
    assert pattern.compiled is compiled  # compiled once
    assert pattern.match("Tried to allocate 512 bytes").group(1) == "512"


def test_flags_are_kept():
    """The flags given are the compiled pattern's: MULTILINE anchors at each line."""
    prefix = LazyPattern(r"^[ \t]*#+ ?", re.MULTILINE)
    assert prefix.sub("", "# a\n## b\nc") == "a\nb\nc"
    assert prefix.compiled.flags & re.MULTILINE
    words = LazyPattern(r"vllm|sglang", re.IGNORECASE)
    assert words.search("INFO VLLM started").group() == "VLLM"
    assert repr(words) == f"LazyPattern('vllm|sglang', {re.IGNORECASE!r})"


@given(st.text(alphabet="0123456789. bytesKiMGB\n", max_size=60))
def test_matches_what_re_compile_matches(text):
    """search, match, finditer and sub answer what the compiled pattern answers, on any text."""
    lazy, eager = LazyPattern(_SIZE), re.compile(_SIZE)
    assert [m.span() for m in lazy.finditer(text)] == [m.span() for m in eager.finditer(text)]
    for got, want in ((lazy.search(text), eager.search(text)), (lazy.match(text), eager.match(text))):
        assert (got and got.span()) == (want and want.span())
    assert lazy.sub("<size>", text) == eager.sub("<size>", text)
    assert lazy.sub(lambda m: m.group(2), text, count=1) == eager.sub(lambda m: m.group(2), text, 1)


def test_an_export_named_as_its_submodule_stays_the_export(tmp_path, monkeypatch):
    """A lazily exported function whose module has its name (oomkit.runtime's ``resilient`` and
    ``watch``): importing the submodule first must not leave ``from package import name``
    giving the submodule (the import system binds the submodule on the package)."""
    import importlib
    import types

    package = tmp_path / "lazypkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        "from oomkit._lazy import lazy_exports\n"
        "__getattr__, __dir__ = lazy_exports(globals(), {'tool': 'lazypkg.tool', "
        "'helper': 'lazypkg.parts'})\n"
    )
    (package / "tool.py").write_text("def tool():\n    return 'the function'\n")
    (package / "parts.py").write_text("def helper():\n    return 'helped'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("lazypkg", "lazypkg.tool", "lazypkg.parts"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    importlib.import_module("lazypkg.tool")  # the submodule first, as a user's import may
    from lazypkg import helper, tool

    assert tool() == "the function" and not isinstance(tool, types.ModuleType)
    assert helper() == "helped"
    assert sys.modules["lazypkg.tool"].tool is tool  # the submodule itself is still importable
    pkg = sys.modules["lazypkg"]
    pkg.other = 3  # other attributes are set as usual
    assert pkg.other == 3


def test_oomkit_runtime_resilient_is_the_function_after_its_module_is_imported():
    """The regression itself: an integration imported oomkit.runtime.resilient's module first,
    then ``from oomkit.runtime import resilient`` was the module ('module' object is not
    callable)."""
    import importlib
    import types

    importlib.import_module("oomkit.runtime.resilient")
    importlib.import_module("oomkit.runtime.watch")
    from oomkit.runtime import resilient, watch

    assert callable(resilient) and not isinstance(resilient, types.ModuleType)
    assert callable(watch) and not isinstance(watch, types.ModuleType)
