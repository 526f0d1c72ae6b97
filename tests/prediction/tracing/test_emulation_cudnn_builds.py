"""The cuDNN a torch install runs: its own, else the one its version's default wheel pins."""

from __future__ import annotations

import pytest

from oomkit.prediction.tracing.emulations import (
    DEFAULT_WHEEL_CUDNN,
    CudnnBuild,
    SdpaCall,
    SdpaSettings,
    cudnn_build_for,
    cudnn_version_text,
    select_sdp_backend,
)

H100 = (9, 0)


def test_version_text_follows_cudnn_version_h():
    """cuDNN 9 encodes major * 10000 + minor * 100 + patch; cuDNN 8 major * 1000 + ..."""
    assert cudnn_version_text(92000) == "9.20.0"
    assert cudnn_version_text(91501) == "9.15.1"
    assert cudnn_version_text(90100) == "9.1.0"
    assert cudnn_version_text(8902) == "8.9.2"


@pytest.mark.parametrize(
    ("torch_version", "expected"),
    [
        ("2.13.0+cpu", 92000),  # nvidia-cudnn-cu13==9.20.0.48
        ("2.13.1", 92000),
        ("2.11.0", 91900),  # nvidia-cudnn-cu13==9.19.0.56: the first CUDA 13 default wheel
        ("2.10.0", 91002),  # nvidia-cudnn-cu12==9.10.2.21
        ("2.7.1", 90501),
        ("2.2.2", 8902),  # not listed: 2.1's 8.9.2.26
        ("2.16.0.dev20270101", 92600),  # newer than the table: the newest entry
    ],
)
def test_a_cpu_build_takes_its_versions_default_wheel(torch_version, expected):
    """Without a cuDNN of its own, the default PyPI Linux wheel's pin for that torch minor."""
    build = cudnn_build_for(torch_version)
    assert build.version == expected
    minor = ".".join(torch_version.split(".")[:2])
    assert build.source == f"torch {minor}'s default Linux wheel"


def test_a_cuda_build_reports_its_own_cudnn():
    """A CUDA build's torch.backends.cudnn.version() wins over the table (e.g. a cu126 install)."""
    assert cudnn_build_for("2.13.0+cu126", 91002) == CudnnBuild(91002, "this torch build's cuDNN")


def test_unknown_versions_have_no_cudnn():
    """Before the table, or an unreadable version: None, and the reason says so."""
    assert cudnn_build_for("2.0.1").version is None
    assert "predates" in cudnn_build_for("2.0.1").source
    assert cudnn_build_for("nightly").version is None


def test_table_versions_never_go_down():
    """Each torch minor pins the same or a newer cuDNN than the one before."""
    versions = [cudnn_build_for(f"{major}.{minor}.0").version for major, minor in DEFAULT_WHEEL_CUDNN]
    assert versions == sorted(versions)


def test_the_default_wheels_cudnn_decides_the_h100_backend():
    """torch 2.10's wheel (cuDNN 9.10.2) runs flash on an H100; 2.11's (9.19.0) runs cuDNN."""
    call = SdpaCall(query_shape=(2, 8, 128, 64), key_shape=(2, 8, 128, 64),
                    value_shape=(2, 8, 128, 64), dtype="bfloat16")
    for torch_version, backend in (("2.10.0", "flash_attention"), ("2.11.0", "cudnn_attention")):
        settings = SdpaSettings(cudnn_version=cudnn_build_for(torch_version).version)
        assert select_sdp_backend(call, H100, settings) == backend
