"""The recorder refuses a torch older than 2.5 with what to do, and accepts newer ones."""

from __future__ import annotations

import pytest

from oomkit.errors import TorchRequiredError
from oomkit.prediction.tracing import MIN_TORCH
from oomkit.prediction.tracing._torch_version import check_torch_version


def test_older_torch_is_refused_with_the_upgrade_command():
    """torch 2.4.1 has no meta kernels for the fused attention ops: a clear error, not a trace."""
    assert MIN_TORCH == (2, 5)
    with pytest.raises(TorchRequiredError, match=r"needs torch >= 2\.5; this is torch 2\.4\.1"):
        check_torch_version("2.4.1+cu121")
    with pytest.raises(TorchRequiredError, match=r"pip install 'torch>=2\.5'"):
        check_torch_version("1.13.1")


@pytest.mark.parametrize("version", ["2.5.1", "2.13.0+cpu", "2.16.0.dev20270101", "3.0.0", "git"])
def test_supported_or_unparsable_versions_pass(version):
    """2.5 and later pass; a version string that does not parse (a source build) is let through."""
    check_torch_version(version)
