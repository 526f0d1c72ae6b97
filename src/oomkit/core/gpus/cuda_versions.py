"""Which CUDA a torch install runs: the build's own, else its release's default PyPI wheel's.

The CUDA version decides the CUDA context's loading mode (``overhead.py``). It is read without
importing torch: a wheel's version carries its CUDA as a local tag (``2.8.0+cu126``); a CPU build
(``+cpu``) or an untagged PyPI wheel takes the CUDA that ``pip install torch`` of that release
installs on Linux (``CUDA_STABLE`` in that release's
``.github/scripts/generate_binary_build_matrix.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

# Re-exported: read from torch/version.py, torch and importlib.metadata not imported.
from oomkit.core.gpus.installed_torch import installed_torch_version

__all__ = [
    "DEFAULT_WHEEL_CUDA",
    "CudaBuild",
    "cuda_build_for",
    "installed_cuda_build",
    "installed_torch_version",
]

# torch (major, minor) -> the CUDA of its default Linux x86_64 wheel on PyPI. Sources: the
# release's generate_binary_build_matrix.py ``CUDA_STABLE`` (2.7: "12.6"; 2.8-2.10: "12.8";
# 2.11-2.13: "13.0", pytorch/pytorch v2.13.0 line 28) and, before that script named it, the
# ``nvidia-cuda-runtime-cu1x`` pin in the PyPI wheel's METADATA (1.13/2.0: 11.7.99; 2.1-2.4:
# 12.1.105; 2.5/2.6: 12.4.127). Before 1.13 PyPI shipped CUDA 10.2 (RELEASE.md, "Special support
# cases": CUDA 11 binaries exceeded PyPI's size limit), from 1.10, the oldest release oomkit
# models (allocator/versions.py OLDEST_MODELLED_TORCH). A release not listed takes the newest
# entry below it.
DEFAULT_WHEEL_CUDA: dict[tuple[int, int], str] = {
    (1, 10): "10.2",
    (1, 13): "11.7",
    (2, 0): "11.7",
    (2, 1): "12.1",
    (2, 5): "12.4",
    (2, 7): "12.6",
    (2, 8): "12.8",
    (2, 11): "13.0",
}


@dataclass(frozen=True)
class CudaBuild:
    """The CUDA version assumed and where it comes from.

    Attributes:
        cuda_version: ``"13.0"``; ``None`` when unknown (a ROCm build, an unparsable version).
        source: a phrase for reports (``"torch 2.13's default Linux wheel"``).
    """

    cuda_version: str | None
    source: str


def _minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def cuda_build_for(torch_version: str) -> CudaBuild:
    """The CUDA of a torch install of ``torch_version`` (``torch.__version__``, e.g.
    ``"2.6.0+cu124"``, ``"2.13.0+cpu"``, ``"2.1"``)."""
    local = re.search(r"\+cu(\d+)(\d)\b", torch_version)
    if local is not None:
        return CudaBuild(f"{int(local.group(1))}.{local.group(2)}", f"torch {torch_version}")
    if "+rocm" in torch_version:
        return CudaBuild(None, f"torch {torch_version} is a ROCm build")
    wanted = _minor(torch_version)
    if wanted is None:
        return CudaBuild(None, f"torch version {torch_version!r} not understood")
    known = [minor for minor in DEFAULT_WHEEL_CUDA if minor <= wanted]
    if not known:
        return CudaBuild(None, f"torch {wanted[0]}.{wanted[1]} predates the table")
    cuda = DEFAULT_WHEEL_CUDA[max(known)]
    return CudaBuild(cuda, f"torch {wanted[0]}.{wanted[1]}'s default Linux wheel")


def installed_cuda_build(
    torch_version: Callable[[], str | None] = installed_torch_version,
) -> CudaBuild:
    """The CUDA of the installed torch (its version read from torch/version.py, torch not imported).

    Args:
        torch_version: returns the installed torch's version or ``None`` when torch is absent
            (a provider, so tests pass their own).

    Returns:
        ``cuda_build_for`` the installed version; without torch, the newest release's default
        wheel's CUDA.
    """
    version = torch_version()
    if version is None:
        newest = max(DEFAULT_WHEEL_CUDA)
        return CudaBuild(
            DEFAULT_WHEEL_CUDA[newest], "torch not installed: the newest default wheel's"
        )
    return cuda_build_for(version)
