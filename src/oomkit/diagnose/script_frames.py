"""Which frames of a stack are the user's code, and which file is the script Python ran.

One rule for a pasted traceback (``oom_traceback``) and a snapshot's recorded stacks
(``snapshot_diagnosis``): the remedies' commands run the script a stack shows, not a
placeholder. Its own module so that ``oomkit explain SNAPSHOT`` does not import the traceback
reader (issue 41 item 4: start-up).
"""

from __future__ import annotations

from oomkit._lazy import LazyPattern

__all__ = ["is_library_path", "script_of"]

# Paths of code that is not the user's: installed packages, the standard library, frozen modules.
_LIBRARY = LazyPattern(
    r"(?:site-packages|dist-packages)[/\\]|[/\\]lib[/\\]python\d|^<frozen |[/\\]torch[/\\]"
)
# Top-level code that is no script file: a notebook cell (ipykernel's temporary files, IPython's
# <ipython-input-...>), python -c (<string>), <stdin>.
_NOT_A_SCRIPT = LazyPattern(r"^<|[/\\]ipykernel_\d+[/\\]")


def is_library_path(path: str) -> bool:
    """Whether ``path`` is an installed package's, the standard library's or frozen code."""
    return _LIBRARY.search(path) is not None


def script_of(path: str, function: str) -> str | None:
    """The script Python ran, from the outermost Python frame of a stack (``path``, its
    ``function``): the file, where the frame is its top level (``<module>``) outside installed
    libraries; None for ``python -m`` (runpy's frames), a notebook cell, ``python -c``, a
    thread's stack (threading.py) or a stack cut short."""
    if function != "<module>" or is_library_path(path):
        return None
    return None if _NOT_A_SCRIPT.search(path) is not None else path
