"""The installed oomkit's version, read from its package metadata (pyproject.toml ``version``)."""

from __future__ import annotations

from importlib import metadata

__all__ = ["UNKNOWN_VERSION", "__version__", "installed_version"]

# PEP 440 local version for a source tree imported without being installed (``PYTHONPATH=src``):
# there is no metadata to read; ``pip install -e .`` writes it.
UNKNOWN_VERSION = "0+unknown"


def installed_version(distribution: str = "oomkit") -> str:
    """The version pip installed ``distribution`` at, or ``UNKNOWN_VERSION`` when not installed.

    Args:
        distribution: the distribution's name in the package metadata.

    Returns:
        The metadata's ``Version`` (pyproject.toml ``[project] version``), e.g. ``"0.1.0"``.
    """
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


__version__ = installed_version()
