"""Target: the GPU, allocator setting and versions of a prediction, parsed once."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import AllocatorConfig
from oomkit.core.gpus import GpuSpecError, UnknownGpuError, get_gpu
from oomkit.core.target import ParallelLayout, Target
from oomkit.errors import ConfigError

MiB = 2**20


def test_resolve_parses_every_part_once():
    """Target.resolve looks the GPU up, applies the overhead and parses the allocator setting."""
    t = Target.resolve(
        "h100",
        "expandable_segments:True",
        context_overhead_bytes=600 * MiB,
        torch_version="2.6",
        cudnn_version=91002,
        cuda_version="12.6",
    )
    assert t.gpu.name == "H100 SXM 80GB"
    assert t.gpu.compute_capability == (9, 0)
    assert t.allocator_config == AllocatorConfig(expandable_segments=True)
    assert t.alloc_conf == "expandable_segments:True"
    assert t.context_overhead_bytes == 600 * MiB
    assert t.capacity_bytes == 85028896768
    assert t.usable_bytes == 85028896768 - 600 * MiB
    assert (t.torch_version, t.cudnn_version, t.cuda_version) == ("2.6", 91002, "12.6")
    assert t.parallel is None


def test_defaults_are_pytorchs_and_not_stated():
    """Without arguments: an H100 with its own overhead, the default allocator, versions unstated."""
    t = Target.resolve()
    assert t.gpu == get_gpu("h100")
    assert t.context_overhead_bytes == 718_077_952  # Hopper, measured on an H200 (validation/)
    assert t.usable_bytes == 85_028_896_768 - 718_077_952
    assert t.allocator_config == AllocatorConfig()
    assert t.alloc_conf == ""
    assert (t.torch_version, t.cudnn_version) == (None, None)
    # The CUDA is the installed torch's: a CPU build takes its release's default wheel's.
    assert Target.resolve(installed_torch=lambda: "2.13.0+cpu").cuda_version == "13.0"
    assert Target.resolve(installed_torch=lambda: "2.6.0+cu118").cuda_version == "11.8"


def test_target_is_frozen():
    """A Target is a frozen record: a change makes a new one (with_gpu)."""
    t = Target.resolve("h100")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.cudnn_version = 1  # type: ignore[misc]
    moved = t.with_gpu(get_gpu("rtx4090"))
    assert moved.gpu.name == "RTX 4090" and moved.allocator_config is t.allocator_config
    assert t.gpu.name == "H100 SXM 80GB"


def test_bad_parts_raise_the_existing_errors():
    """Each part fails with the error (and message) its own parser raises."""
    with pytest.raises(UnknownGpuError):
        Target.resolve("h1000")
    with pytest.raises(GpuSpecError):
        Target.resolve("1GiB", context_overhead_bytes=2**31)
    with pytest.raises(ConfigError, match="max_split_size_mb"):
        Target.resolve("h100", "max_split_size_mb:2")
    with pytest.raises(ValueError, match="cudnn_version=91002"):
        Target.resolve("h100", cudnn_version=0)


def test_torch_version_picks_the_parser():
    """The allocator setting is parsed as the target's torch release parses it."""
    with pytest.raises(ConfigError):
        Target.resolve("h100", "large_segment_size_mb:64", torch_version="2.5")


def test_parallel_layout_is_validated_and_carried():
    """--fsdp N becomes Target.parallel; 0, negatives and booleans are ConfigErrors."""
    target = dataclasses.replace(Target.resolve("h100"), parallel=ParallelLayout(fsdp=8))
    assert target.parallel is not None and target.parallel.world_size == 8
    assert Target.resolve("h100").parallel is None
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ConfigError, match="at least 1"):
            ParallelLayout(fsdp=bad)


def test_parallel_layout_world_size_and_mesh_shape():
    """World size is the product of the degrees; the mesh keeps dp, fsdp, tp order, drops 1s."""
    layout = ParallelLayout(fsdp=4, tp=8, dp=2)
    assert layout.world_size == 64
    assert layout.mesh_shape == ((2, 4, 8), ("dp", "fsdp", "tp"))
    assert ParallelLayout(fsdp=8).mesh_shape == ((8,), ("fsdp",))
    assert ParallelLayout(tp=2).mesh_shape == ((2,), ("tp",))
    assert ParallelLayout().mesh_shape == ((1,), ("fsdp",))
    for name in ("tp", "dp"):
        with pytest.raises(ConfigError, match=f"--{name} 8"):
            ParallelLayout(**{name: 0})


@settings(max_examples=40, deadline=None)
@given(overhead=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                          st.text(max_size=5), st.decimals(allow_nan=True)))
def test_a_context_overhead_is_a_whole_number_of_bytes(overhead):
    """A float (NaN had been an AssertionError), a bool or text: GpuSpecError naming it."""
    with pytest.raises(GpuSpecError, match="context_overhead_bytes must be a whole number of "
                                           "bytes; got"):
        Target.resolve("h100", context_overhead_bytes=overhead)


@pytest.mark.parametrize("gpu", [5, 2.5, None, b"h100", ["h100"]])
def test_a_gpu_of_another_type_is_an_unknown_gpu(gpu):
    """Not a name, a size or a GpuSpec: UnknownGpuError (an int had been an AttributeError)."""
    with pytest.raises(UnknownGpuError, match="a GPU is a catalog name .* or a GpuSpec; got"):
        get_gpu(gpu)


@settings(max_examples=30, deadline=None)
@given(major=st.integers(2, 120), minor=st.integers(0, 99))
def test_a_torch_newer_than_main_is_refused(major, minor):
    """--torch-version 99.0 had been modelled as main, its CUDA called "torch 99.0's default
    Linux wheel"; a release past main (2.15) is refused, any up to it is taken."""
    from oomkit.core.allocator.versions import _MAIN_VERSION, NEWEST_RELEASED_TORCH

    version = f"{major}.{minor}"
    if (major, minor) > _MAIN_VERSION:
        with pytest.raises(ConfigError, match=rf"torch {version} is newer than any PyTorch "
                                              rf"oomkit models \(releases up to "
                                              rf"{NEWEST_RELEASED_TORCH}"):
            Target.resolve("h100", torch_version=version)
    else:
        assert Target.resolve("h100", torch_version=version).torch_version == version


def test_the_torch_version_flag_of_every_command_refuses_past_main():
    """replay, tune, simulate and doctor take --torch-version through one argparse type, and
    predict / fit through the scenario's field: both refuse a release past main, as Target does."""
    import argparse

    from oomkit.interfaces.cli._common import torch_version_arg
    from oomkit.scenario import Scenario

    assert torch_version_arg("nightly") == "nightly"
    with pytest.raises(argparse.ArgumentTypeError, match="torch 3.0 is newer than any PyTorch"):
        torch_version_arg("3.0")
    with pytest.raises(ValueError, match="torch 3.0 is newer than any PyTorch"):
        Scenario.model_validate({"model": {"preset": "x"}, "target": {"torch_version": "3.0"}})


@settings(max_examples=30, deadline=None)
@given(major=st.integers(0, 1), minor=st.integers(0, 99), patch=st.integers(0, 9))
def test_a_torch_older_than_1_10_is_refused_everywhere(major, minor, patch):
    """--torch-version 1.0 had been modelled with 1.10's rules and "CUDA 10.2, torch 1.0's
    default Linux wheel" (torch 1.0's wheel had CUDA 9.0): a release before 1.10, the oldest
    the allocator reference describes, is refused by Target, the commands' --torch-version and
    the scenario's field alike; 1.10 and later are taken."""
    import argparse

    from oomkit.interfaces.cli._common import torch_version_arg
    from oomkit.scenario import Scenario

    version = f"{major}.{minor}.{patch}"
    if (major, minor) < (1, 10):
        message = rf"torch {version} is older than any PyTorch oomkit models: .* from 1\.10 on"
        with pytest.raises(ConfigError, match=message):
            Target.resolve("h100", torch_version=version)
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            torch_version_arg(version)
        with pytest.raises(ValueError, match=message):
            Scenario.model_validate({"model": {"preset": "x"}, "target": {"torch_version": version}})
    else:
        assert Target.resolve("h100", torch_version=version).torch_version == version
        assert torch_version_arg(version) == version


@settings(max_examples=30, deadline=None)
@given(
    gpu=st.one_of(st.text(max_size=12), st.integers(), st.none(), st.floats(allow_nan=True)),
    conf=st.one_of(st.text(max_size=30), st.none(), st.integers()),
)
def test_target_built_directly_from_names_is_a_config_error_naming_resolve(gpu, conf):
    """Target("rtx4090") had been taken and failed deep in a recording ("'str' object has no
    attribute 'compute_capability'"); a GPU or setting that is not parsed is refused at once,
    with Target.resolve as the way to name it."""
    with pytest.raises(ConfigError, match=r"takes a GpuSpec; .*Target\.resolve\("):
        Target(gpu)
    with pytest.raises(ConfigError, match=r"takes an AllocatorConfig; .*alloc_conf="):
        Target(get_gpu("rtx4090"), conf)
    assert Target(get_gpu("rtx4090")).alloc_conf == ""
