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
    """--gpu rtx4090 is the device (its total, its 430 MiB context subtracted); --capacity 24GiB
    the allocator's limit; the default is --capacity 80GiB."""
    for argv, capacity, context in (
        (["--gpu", "rtx4090"], 25_756_696_576, 430 * 2**20),
        (["--capacity", "24GiB"], 24 * 2**30, 0),
        ([], 80 * 2**30, 0),
    ):
        assert main(["demo", "--steps", "2", "--json", *argv]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["capacity_bytes"], out["context_overhead_bytes"]) == (capacity, context)
        assert out["usable_bytes"] == capacity - context


def test_demo_says_default_ooms_and_expandable_fits(capsys):
    """At 8 GiB the default settings OOM and expandable_segments:True fits: the verdict says so,
    not "does not lower peak reserved memory" (issue 16 item 7)."""
    assert main(["demo", "--capacity", "8GiB", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert results["default"]["oom"] and not results["expandable_segments:True"]["oom"]
    assert main(["demo", "--capacity", "8GiB"]) == 0
    out = capsys.readouterr().out
    assert "does not lower" not in out
    assert out.splitlines()[-1] == (
        "The default settings run out of memory on this device and expandable_segments:True "
        "does not (peak reserved 7.44 GiB): PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )


def test_demo_says_when_both_settings_oom(capsys):
    """At 7 GiB both settings OOM: the verdict says expandable does not rescue it."""
    assert main(["demo", "--capacity", "7GiB"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "Both settings run out of memory on this device: expandable_segments:True does not "
        "rescue it. Give a larger --gpu or --capacity, or fewer --steps."
    )
