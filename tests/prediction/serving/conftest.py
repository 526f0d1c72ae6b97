"""Tests of the serving engines' start-up accounting. This folder holds ``_serving_configs``
(real models' config.json figures), which pytest's ``prepend`` import mode puts on the path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a config dict as ``<tmp>/<name>/config.json``; return the directory."""

    def write(config: dict, name: str = "model") -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        return str(folder)

    return write
