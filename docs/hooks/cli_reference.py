"""MkDocs hook: the command-line reference, generated from oomkit's own parser at build time.

``docs/reference/cli.md`` holds the marker ``<!-- cli-reference -->``; this hook replaces it with
one section per subcommand of ``oomkit.interfaces.cli.build_parser()``: its summary, its usage
line and a table of every argument (flags, value, default, help). Nothing is written by hand, so
the page cannot drift from the parser: a flag added to a subcommand appears at the next build.
``tests/docs/test_cli_reference.py`` checks that every flag of every subcommand is on the page.
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path
from typing import Any

__all__ = ["MARKER", "on_page_markdown", "render_cli_reference", "subcommand_parsers"]

MARKER = "<!-- cli-reference -->"

_SRC = Path(__file__).resolve().parents[2] / "src"


def _import_cli() -> Any:
    """``oomkit.interfaces.cli`` from this checkout's sources (first on the path)."""
    if str(_SRC) not in sys.path:
        sys.path.insert(0, str(_SRC))
    import oomkit.interfaces.cli as cli

    return cli


def subcommand_parsers() -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line summary, parser) of every subcommand, in ``oomkit --help``'s order."""
    cli = _import_cli()
    root = cli.build_parser()
    found: list[tuple[str, str, argparse.ArgumentParser]] = []
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            summaries = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, parser in action.choices.items():
                found.append((name, summaries.get(name, ""), parser))
    return found


def _cell(text: str) -> str:
    """Text for one table cell: HTML-escaped, pipes escaped, on one line."""
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def _flags(action: argparse.Action) -> str:
    if action.option_strings:
        return ", ".join(f"`{flag}`" for flag in action.option_strings)
    return f"`{action.metavar or action.dest}`"


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return " \\| ".join(f"`{choice}`" for choice in action.choices)
    if not action.option_strings:
        return ""
    metavar = action.metavar if action.metavar is not None else action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return f"`{_cell(str(metavar))}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS, False, [], ()):
        return ""
    return f"`{_cell(str(action.default))}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.help is None or action.help == argparse.SUPPRESS:
        return ""
    formatter = parser._get_formatter()
    return _cell(formatter._expand_help(action))


def _section(name: str, summary: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## oomkit {name}", ""]
    if summary:
        lines += [_cell(summary[0].upper() + summary[1:]) + ".", ""]
    usage = " ".join(parser.format_usage().split())
    lines += ["```text", usage.removeprefix("usage: "), "```", ""]
    if parser.description:
        lines += [_cell(parser.description), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = group.title or "arguments"
        lines += [f"**{_cell(title[0].upper() + title[1:])}**", ""]
        lines += ["| argument | value | default | meaning |", "|---|---|---|---|"]
        for action in actions:
            row = (_flags(action), _value(action), _default(action), _help(parser, action))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    if parser.epilog:
        lines += [_cell(parser.epilog), ""]
    return lines


def render_cli_reference() -> str:
    """The Markdown of every subcommand's section, generated from the parser."""
    lines: list[str] = []
    for name, summary, parser in subcommand_parsers():
        lines += _section(name, summary, parser)
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """MkDocs event: fill the CLI reference page's marker."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_cli_reference())
