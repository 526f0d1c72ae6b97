"""Which cuDNN the target's PyTorch runs: the version that steers the SDPA backend choice.

From cuDNN 9.15.1 on, PyTorch runs cuDNN attention first on H100 / B200
(``sdpa_backend.py``), so the cuDNN version decides which kernel -- and which workspaces -- a
training step has there. A GPU name does not say which cuDNN the machine has; the torch build
does: each of torch's default Linux wheels on PyPI pins one ``nvidia-cudnn-cu12`` /
``nvidia-cudnn-cu13`` release exactly. So the default is

1. this process's torch build's own cuDNN when it has one (a CUDA build, GPU or not:
   ``torch.backends.cudnn.version()``), else
2. the cuDNN that the default PyPI Linux wheel of this torch version pins (a CPU build on a
   laptop predicting for a GPU machine running the same torch version from ``pip install torch``).

``--cudnn-version`` / ``SdpaSettings(cudnn_version=...)`` overrides it, e.g. for a cluster that
installs torch from the ``cu126`` index (cuDNN 9.10).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from oomkit.prediction.tracing._torch_version import torch_minor

__all__ = [
    "DEFAULT_WHEEL_CUDNN",
    "CudnnBuild",
    "cudnn_build_for",
    "cudnn_version_text",
    "installed_cudnn_build",
]

# torch version (major, minor) -> the cuDNN release its default Linux x86_64 wheel on PyPI pins.
# Source: each wheel's METADATA ``Requires-Dist: nvidia-cudnn-cu1x==...`` (PyPI, read 2026-11-23:
# torch 2.1.2, 2.3.1, 2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0, 2.11.0, 2.12.0, 2.13.0,
# 2.14.0, 2.15.0). A minor release not listed (2.2) takes the newest entry below it.
DEFAULT_WHEEL_CUDNN: dict[tuple[int, int], str] = {
    (2, 1): "8.9.2.26",
    (2, 3): "8.9.2.26",
    (2, 4): "9.1.0.70",
    (2, 5): "9.1.0.70",
    (2, 6): "9.1.0.70",
    (2, 7): "9.5.1.17",
    (2, 8): "9.10.2.21",
    (2, 9): "9.10.2.21",
    (2, 10): "9.10.2.21",
    (2, 11): "9.19.0.56",
    (2, 12): "9.20.0.48",
    (2, 13): "9.20.0.48",
    (2, 14): "9.24.0.43",
    (2, 15): "9.26.0.51",
}


@dataclass(frozen=True)
class CudnnBuild:
    """The cuDNN a prediction assumes, and where that figure comes from.

    Attributes:
        version: as ``torch.backends.cudnn.version()`` reports it (``CUDNN_VERSION``:
            ``major * 10000 + minor * 100 + patch`` from cuDNN 9, ``major * 1000 + ...``
            before), e.g. ``92000`` for 9.20.0; ``None`` when unknown.
        source: a phrase for reports, e.g. ``"torch 2.13's default Linux wheel"``.
    """

    version: int | None
    source: str


def cudnn_version_text(version: int) -> str:
    """``92000`` -> ``"9.20.0"``, ``8902`` -> ``"8.9.2"`` (cudnn_version.h ``CUDNN_VERSION``)."""
    if version >= 90000:  # cuDNN 9 changed the encoding to major * 10000 + minor * 100 + patch
        return f"{version // 10000}.{version // 100 % 100}.{version % 100}"
    return f"{version // 1000}.{version // 100 % 10}.{version % 100}"


def _version_int(release: str) -> int:
    # "9.20.0.48" -> 92000 (the fourth field is the build number, not part of CUDNN_VERSION).
    major, minor, patch = (int(part) for part in release.split(".")[:3])
    return major * 10000 + minor * 100 + patch if major >= 9 else major * 1000 + minor * 100 + patch


def cudnn_build_for(torch_version: str, build_cudnn_version: int | None = None) -> CudnnBuild:
    """The cuDNN a torch install of ``torch_version`` runs.

    Args:
        torch_version: ``torch.__version__``, e.g. ``"2.13.0+cpu"``.
        build_cudnn_version: ``torch.backends.cudnn.version()`` of that build when it has cuDNN
            (a CUDA build), else ``None``.

    Returns:
        The build's own cuDNN when given, else the one the default PyPI Linux wheel of that torch
        version pins (the newest listed release at or below it), else ``CudnnBuild(None, ...)``.
    """
    if build_cudnn_version is not None:
        return CudnnBuild(build_cudnn_version, "this torch build's cuDNN")
    wanted = torch_minor(torch_version)
    if wanted is None:
        return CudnnBuild(None, f"unknown (torch version {torch_version!r} not understood)")
    known = [minor for minor in DEFAULT_WHEEL_CUDNN if minor <= wanted]
    if not known:
        return CudnnBuild(None, f"unknown (torch {wanted[0]}.{wanted[1]} predates the table)")
    release = DEFAULT_WHEEL_CUDNN[max(known)]
    return CudnnBuild(_version_int(release), f"torch {wanted[0]}.{wanted[1]}'s default Linux wheel")


@functools.cache
def installed_cudnn_build() -> CudnnBuild:
    """``cudnn_build_for`` this process's torch (read once; needs no GPU)."""
    import torch

    build_version = None
    try:
        if torch.backends.cudnn.is_available():
            build_version = torch.backends.cudnn.version()
    except (RuntimeError, OSError):  # a CUDA build whose cuDNN library cannot be loaded
        build_version = None
    return cudnn_build_for(torch.__version__, build_version)
