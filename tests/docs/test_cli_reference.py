"""The command-line reference page is generated from the parser and holds every flag."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOK = ROOT / "docs" / "hooks" / "cli_reference.py"


def _hook():
    spec = importlib.util.spec_from_file_location("oomkit_docs_cli_reference", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_flag_of_every_subcommand_is_on_the_generated_page() -> None:
    from oomkit.interfaces.cli import _COMMANDS

    hook = _hook()
    page = hook.render_cli_reference()
    parsers = hook.subcommand_parsers()
    assert [name for name, _, _ in parsers] == list(_COMMANDS)
    missing = []
    for name, _, parser in parsers:
        section = page.split(f"## oomkit {name}\n", 1)[1].split("\n## oomkit ", 1)[0]
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            names = action.option_strings or [action.metavar or action.dest]
            for flag in names:
                if f"`{flag}`" not in section:
                    missing.append(f"{name} {flag}")
            if action.help not in (None, argparse.SUPPRESS) and "%(" not in action.help:
                if " ".join(action.help.split())[:40].replace("|", "\\|") not in " ".join(
                    section.split()
                ).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&"):
                    missing.append(f"{name} {names[0]}: help text")
    assert missing == []


def test_the_page_marker_is_replaced_by_the_mkdocs_hook() -> None:
    hook = _hook()
    source = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert hook.MARKER in source
    built = hook.on_page_markdown(source, page=None, config=None, files=None)
    assert hook.MARKER not in built
    assert "## oomkit predict" in built and "`--gpu`" in built
    # A page without the marker is left as it is.
    assert hook.on_page_markdown("# other\n", page=None, config=None, files=None) == "# other\n"


def test_table_cells_escape_pipes_and_markup() -> None:
    hook = _hook()
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--gpu", metavar="NAME|SIZE", help="a <b>GPU</b> | or a size")
    action = parser._actions[-1]
    assert hook._value(action) == "`NAME\\|SIZE`"
    assert hook._help(parser, action) == "a &lt;b&gt;GPU&lt;/b&gt; \\| or a size"
