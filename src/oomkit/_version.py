"""The oomkit version: the one place it is written (pyproject.toml reads it, ``dynamic``)."""

from __future__ import annotations

__all__ = ["__version__"]

# A constant, not importlib.metadata: reading the package metadata cost ~25 ms of every CLI
# start-up (it imports email, zipfile, csv, pathlib; issue 19 item 4). setuptools reads this line
# for the distribution's version (pyproject.toml [tool.setuptools.dynamic] version attr), so the
# installed metadata and ``oomkit.__version__`` cannot differ.
__version__ = "0.1.0"
