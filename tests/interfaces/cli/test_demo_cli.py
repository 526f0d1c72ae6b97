"""Tests for `oomkit demo`, the README's main job."""

import json

from oomkit.interfaces.cli import main


def test_demo_json_compares_default_and_expandable(capsys):
    """The demo replays the built-in workload under both settings; expandable reserves less."""
    assert main(["demo", "--steps", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    default = out["results"]["default"]
    expandable = out["results"]["expandable_segments:True"]
    assert default["events"] == expandable["events"] > 1000
    assert default["peak_allocated_bytes"] <= default["peak_reserved_bytes"]
    assert expandable["peak_reserved_bytes"] < default["peak_reserved_bytes"]
    assert not default["oom"] and not expandable["oom"]


def test_demo_human_output_names_the_setting(capsys):
    """The terminal report ends with the setting to use and its saving."""
    assert main(["demo", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "Default vs expandable_segments:True" in out
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
