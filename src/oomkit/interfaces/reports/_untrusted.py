"""Text that came from input (file and function names, messages) made safe to print with rich."""

from __future__ import annotations

import re

__all__ = ["as_plot_text", "as_written", "controls_shown"]

# C0 and C1 control characters other than tab and newline: a terminal would act on them (an
# ESC sequence recolours or moves the cursor), so they are shown as \xNN instead.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def controls_shown(text: str) -> str:
    """``text`` with its control characters as ``\\xNN``: for printing with ``markup=False``
    (remedy code that quotes a path from the input), where rich reads no markup."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def as_written(text: str) -> str:
    """``text`` for ``console.print``: rich markup escaped, control characters as ``\\xNN``.

    A frame named ``[bold]x[/bold]`` or holding ``\\x1b[31m`` is then printed as the file says,
    neither styled nor acted on by the terminal.
    """
    # rich only where something is rendered: a report module that imports this one for its
    # terminal output costs `--json` nothing (issue 41 item 4: start-up).
    from rich.markup import escape

    return escape(controls_shown(text))


def as_plot_text(text: str) -> str:
    """``text`` for a matplotlib title or label: control characters as ``\\xNN`` and ``$``
    escaped, so a name like ``$\\frac`` is shown as written, not parsed as mathtext (which
    raises on bad math)."""
    return controls_shown(text).replace("$", r"\$")
