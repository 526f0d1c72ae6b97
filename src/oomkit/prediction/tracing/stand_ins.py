"""Where a tensor value was read, and the stand-in number a read gets when its value is unknown.

The rule (docs/howto/predict-your-script.md, "Values your step reads"): a read of a meta tensor's
value that oomkit cannot know (``loss.item()``, ``float(loss)``, ``f"{loss:.3f}"``,
``loss.tolist()``) returns a :class:`StandIn`: a ``float`` that remembers the line that read it. It
prints and formats as ``nan`` (so a logged stand-in is not mistaken for a real loss), and is 1.0 as
a number, finite, as the finite-values assumption has it (``math.isfinite(loss.item())`` holds, as
in a run that proceeds). Logging, printing, formatting and arithmetic work on it (arithmetic gives
another stand-in). Using it where the value could change what the step allocates raises
:class:`DataDependentValueError`, naming both lines: as a size or index (``int()``, ``__index__``:
``torch.zeros(n)``, ``range(n)``), as a condition (``if``, ``while``, ``and``/``or``), or in a
comparison. ``bool()`` / ``int()`` of the unknown tensor itself raise at once, for the same reason.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from oomkit.errors import DataDependentValueError

__all__ = [
    "ReadSite",
    "STAND_IN_VALUE",
    "StandIn",
    "is_hidden_file",
    "is_library_file",
    "is_torch_plumbing",
    "read_site",
    "refuse_unknown",
    "shown_path",
    "stack_frames",
]


@dataclass(frozen=True)
class ReadSite:
    """The source lines of one read: where it happened and the user's own line that led there.

    Attributes:
        filename: the innermost frame outside oomkit and the standard library (may be inside
            torch or transformers).
        line: its line number.
        function: its function.
        library: whether that frame is library code (torch, site-packages), not the user's.
        user: the user's own innermost frame ``(filename, line, function)`` when ``library``.
    """

    filename: str
    line: int
    function: str
    library: bool
    user: tuple[str, int, str] | None = None

    @property
    def key(self) -> str:
        """``file.py:42``: how ``--value`` names this read."""
        return f"{Path(self.filename).name}:{self.line}"

    @property
    def location(self) -> str:
        """``path/file.py:42 in step``, relative to the working directory when under it."""
        return f"{shown_path(self.filename)}:{self.line} in {self.function}"

    def describe(self) -> str:
        """The read's location, and for a library read the user's line that called it."""
        if self.user is None:
            return self.location
        filename, line, function = self.user
        return f"{self.location} (called from {shown_path(filename)}:{line} in {function})"


def shown_path(filename: str) -> str:
    """``filename`` relative to the working directory when under it, else as given."""
    try:
        relative = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if relative.startswith("..") else relative


@functools.cache
def _oomkit_and_stdlib() -> tuple[tuple[str, ...], tuple[str, ...]]:
    import sysconfig

    import oomkit

    stdlib = []
    for key in ("stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            stdlib.append(str(Path(path)) + os.sep)
    return (str(Path(oomkit.__file__).parent) + os.sep,), tuple(dict.fromkeys(stdlib))


def is_hidden_file(filename: str) -> bool:
    """oomkit's own code and the standard library: never a read's or a failure's site.

    A virtualenv's ``platstdlib`` is the folder that holds ``site-packages``, so installed
    libraries under it are not hidden.
    """
    own, stdlib = _oomkit_and_stdlib()
    if filename.startswith(own) or filename.startswith("<frozen"):
        return True
    path = Path(filename)
    if path.name == "oomkit" and path.parent.name in ("bin", "Scripts"):
        return True  # pip's console-script launcher of the `oomkit` command
    return filename.startswith(stdlib) and not _in_site_packages(filename)


def _in_site_packages(filename: str) -> bool:
    parts = Path(filename).parts
    return "site-packages" in parts or "dist-packages" in parts


@functools.cache
def _library_prefixes() -> tuple[str, ...]:
    import torch

    return (str(Path(torch.__file__).parent) + os.sep,)


def is_library_file(filename: str) -> bool:
    """Installed third-party code (torch, transformers, lightning...), not the user's."""
    return _in_site_packages(filename) or filename.startswith(_library_prefixes())


# torch's own plumbing between a read and its caller: private modules (``torch/_tensor.py``'s
# ``Tensor.__format__`` calls ``item``; ``_ops.py``, ``_meta_registrations.py``, ``_refs``,
# ``utils/_device.py``'s DeviceContext mode), ``torch/__init__.py`` and ``overrides.py``.
# Public modules (``torch/nn``, ``torch/optim``, ``torch/utils/checkpoint.py``) are library code.
_MODE_HANDLERS = frozenset({"__torch_function__", "__torch_dispatch__"})


@functools.cache
def _torch_root() -> Path:
    import torch

    return Path(torch.__file__).parent


@functools.cache
def is_torch_plumbing(filename: str) -> bool:
    """Whether ``filename`` is one of torch's private modules (see ``_MODE_HANDLERS`` above)."""
    try:
        parts = Path(filename).relative_to(_torch_root()).parts
    except ValueError:
        return False
    return (
        parts in (("__init__.py",), ("overrides.py",))
        or any(part.startswith("_") and part != "__init__.py" for part in parts)
    )


def stack_frames(skip: int = 1) -> list[types.FrameType]:
    """The current stack, innermost first, without oomkit's, the standard library's and torch's
    plumbing frames (``is_torch_plumbing``, mode handlers)."""
    frames = []
    frame: types.FrameType | None = sys._getframe(skip)
    while frame is not None:
        code = frame.f_code
        if not (
            is_hidden_file(code.co_filename)
            or is_torch_plumbing(code.co_filename)
            or code.co_name in _MODE_HANDLERS
        ):
            frames.append(frame)
        frame = frame.f_back
    return frames


def read_site(frames: list[types.FrameType] | None = None) -> ReadSite | None:
    """Where the current read happens (see :class:`ReadSite`); ``None`` with no frame outside
    oomkit (a read oomkit itself made)."""
    frames = stack_frames(2) if frames is None else frames
    if not frames:
        return None
    inner = frames[0]
    library = is_library_file(inner.f_code.co_filename)
    user = None
    if library:
        for frame in frames[1:]:
            if not is_library_file(frame.f_code.co_filename):
                user = (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
                break
    return ReadSite(
        inner.f_code.co_filename, inner.f_lineno, inner.f_code.co_name, library, user
    )


def _advice(site: ReadSite, what: str) -> str:
    state = (
        f"state the value: --value {site.key}=NUMBER on the command line, or "
        f"values={{{site.key!r}: NUMBER}} in oomkit.predict"
    )
    if site.library:
        return (
            f"The read is inside a library, not yours to move; {state}, or pass inputs whose "
            "values oomkit can follow (masks made with torch.ones / torch.full / torch.triu "
            "in the builder or the step, not loaded or random; from Python, made inside the "
            "step or under oomkit.prediction.tracing.value_tracking())."
        )
    return (
        f"To predict anyway, {state}, or compute {what} from sizes you know (shapes, "
        "arguments) instead of from tensor values."
    )


def refuse_unknown(kind: str, use: str, site: ReadSite | None) -> NoReturn:
    """Raise for ``kind`` (``bool()``) of an unknown tensor used as ``use`` (``a condition``)."""
    where = site.describe() if site is not None else "the step"
    raise DataDependentValueError(
        f"{where}: {kind} of a tensor whose values oomkit cannot know without a GPU is "
        f"used as {use}, which can change what the step allocates. "
        + (_advice(site, "it") if site is not None else "")
    )


# The number a stand-in is: finite, and no divisor of zero.
STAND_IN_VALUE = 1.0


class StandIn(float):
    """Stands in for a tensor value oomkit cannot know (1.0, shown as ``nan``); remembers where
    it was read.

    Arithmetic gives another stand-in; use as a size, index, condition or in a comparison raises
    :class:`DataDependentValueError` naming the read and the use.
    """

    __slots__ = ("site",)
    site: ReadSite | None

    def __new__(cls, site: ReadSite | None) -> StandIn:
        obj = super().__new__(cls, STAND_IN_VALUE)
        obj.site = site
        return obj

    def __repr__(self) -> str:
        return "nan"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return format(math.nan, spec)

    def _refuse(self, use: str) -> NoReturn:
        used = read_site(stack_frames(3))
        read = self.site.describe() if self.site is not None else "the step"
        at = f"{used.location}: " if used is not None else ""
        raise DataDependentValueError(
            f"{at}a tensor value read at {read} is used as {use}, which can change what the step "
            "allocates; on the meta device oomkit does not know it (the read got a stand-in "
            "that may only be logged or printed). "
            + (_advice(self.site, "it") if self.site is not None else "")
        )

    def __bool__(self) -> bool:
        self._refuse("a condition")

    def __int__(self) -> int:
        self._refuse("an integer (a size, an index or a loop bound)")

    def __index__(self) -> int:
        self._refuse("an integer (a size, an index or a loop bound)")

    def __trunc__(self) -> int:
        self._refuse("an integer (a size, an index or a loop bound)")

    def __floor__(self) -> int:
        self._refuse("an integer (a size, an index or a loop bound)")

    def __ceil__(self) -> int:
        self._refuse("an integer (a size, an index or a loop bound)")

    def __round__(self, ndigits: Any = None) -> Any:
        if ndigits is None:
            self._refuse("an integer (a size, an index or a loop bound)")
        return StandIn(self.site)

    def _compare(self, other: Any) -> NoReturn:
        self._refuse("a comparison (a condition)")

    __lt__ = __le__ = __gt__ = __ge__ = _compare

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        self._refuse("a comparison (a condition)")

    def __ne__(self, other: object) -> bool:
        if other is self:
            return False
        self._refuse("a comparison (a condition)")

    def __hash__(self) -> int:
        return object.__hash__(self)


def _derived(self: StandIn, *other: Any) -> Any:
    if other and not isinstance(other[0], (int, float)):
        return NotImplemented
    return StandIn(self.site)


for _name in (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __floordiv__ "
    "__rfloordiv__ __mod__ __rmod__ __pow__ __rpow__ __neg__ __pos__ __abs__"
).split():
    setattr(StandIn, _name, _derived)
del _name
