"""Fixtures of the CLI tests."""

from __future__ import annotations

import pytest
from _parallel_helpers import use_tiny_llama


@pytest.fixture
def tiny_llama(monkeypatch):
    """The FSDP2, TP and DDP preset builders get a tiny Llama for any preset name."""
    use_tiny_llama(monkeypatch)
