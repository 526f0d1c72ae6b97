"""The known name closest to a mistyped one, for "did you mean ...?" in error messages.

One rule for every guess oomkit makes of a name it does not know: a CLI flag, a config file's
section or key, a keyword of ``oomkit.predict``. ``difflib``'s ratio of at least 0.75 is close
enough that ``bach`` gives ``batch`` and ``margn`` ``margin``, but ``lr`` not ``lora``.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["closest_name"]

# difflib.SequenceMatcher.ratio() a guess needs (its default, 0.6, took `lr` for `lora`).
_CUTOFF = 0.75


def closest_name(word: str, known: Iterable[str]) -> str | None:
    """The one name of ``known`` closest to ``word``, where one is close enough; else None."""
    import difflib  # only for a mistyped name (start-up: issue 41 item 4)

    close = difflib.get_close_matches(word, list(known), n=1, cutoff=_CUTOFF)
    return close[0] if close else None
