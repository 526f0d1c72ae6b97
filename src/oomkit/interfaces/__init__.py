"""Interfaces: the CLI (``cli``), reports (terminal, JSON, HTML) and framework callbacks.

The Python API facade is ``oomkit/__init__.py``. Nothing is imported here.
"""

from __future__ import annotations

__all__: list[str] = []
