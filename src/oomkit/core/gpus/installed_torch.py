"""The installed torch's version, as ``torch.__version__`` gives it, without importing torch.

Read as text from the ``torch/version.py`` that ``import torch`` would load, which every torch
build writes (tools/generate_torch_version.py: ``__version__ = '2.13.0+cpu'``) and
``torch.__version__`` re-exports. The package metadata (``importlib.metadata``) holds the same
version, but importing it and reading the installed distributions costs about 20 ms of start-up
(email, zipfile, csv), more than the rest of ``doctor --no-live`` (issue 41 item 4) and paid by
every ``--gpu`` target. The metadata stays the fallback where that file cannot be read.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

__all__ = ["installed_torch_version"]

# torch/version.py's assignment line (tools/generate_torch_version.py writes it quoted).
_TORCH_VERSION_LINE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


def installed_torch_version() -> str | None:
    """The installed torch's version (``"2.13.0+cpu"``), torch not imported.

    Returns:
        The ``__version__`` in the ``torch/version.py`` an import would load; where torch is
        found but that file cannot be read or holds no such line, the package metadata's
        version; ``None`` where torch is not installed.
    """
    locations: tuple[str, ...] = ()
    try:
        spec = importlib.util.find_spec("torch")
    except ValueError:  # a ``torch`` in sys.modules without a spec (a stand-in): the metadata
        pass
    else:
        if spec is None:
            return None
        locations = tuple(spec.submodule_search_locations or ())
    for folder in locations:
        try:
            text = (Path(folder) / "version.py").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        found = _TORCH_VERSION_LINE.search(text)
        if found is not None:
            return found.group(1)
    # Imported here: see the module docstring.
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
