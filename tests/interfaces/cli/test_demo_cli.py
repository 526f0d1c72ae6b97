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


def test_demo_gpu_and_capacity_name_the_device(capsys):
    """--gpu rtx4090 is its total memory; --capacity 24GiB still works; the default is 80 GiB."""
    for argv, capacity in (
        (["--gpu", "rtx4090"], 25_756_696_576),
        (["--capacity", "24GiB"], 24 * 2**30),
        ([], 80 * 2**30),
    ):
        assert main(["demo", "--steps", "2", "--json", *argv]) == 0
        assert json.loads(capsys.readouterr().out)["capacity_bytes"] == capacity
