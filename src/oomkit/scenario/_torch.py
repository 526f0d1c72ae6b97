"""Importing torch for the commands that record a step: exit 3 and a message where it is missing."""

from __future__ import annotations

import warnings

from oomkit.errors import TorchRequiredError

__all__ = ["require_torch", "NUMPY_WARNING"]

# torch/csrc/utils/tensor_numpy.cpp (is_numpy_available): a torch built with NumPy support warns
# "Failed to initialize NumPy: No module named 'numpy'" once, while `import torch` runs, where
# numpy is not installed (torch does not depend on it). oomkit never converts a tensor to or from
# numpy, so the warning says nothing about its results: only that one warning is silenced.
NUMPY_WARNING = r"Failed to initialize NumPy"


def require_torch(
    command: str,
    *,
    extra: str = "torch",
    why: str = "records the step on PyTorch's meta device",
) -> None:
    """Import torch for ``command`` (e.g. ``"oomkit predict"``), or say how to install it
    (``pip install oomkit[EXTRA]``).

    torch is imported once here, before any module of oomkit's recorder, so that its one-time
    NumPy warning is silenced (see ``NUMPY_WARNING``) and a missing torch is a message and
    exit 3 (``TorchRequiredError``), never a ``ModuleNotFoundError`` traceback.

    Raises:
        TorchRequiredError: torch cannot be imported.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NUMPY_WARNING, category=UserWarning)
            import torch  # noqa: F401  (imported for its side effect: loaded once, quietly)
    except ImportError as exc:
        raise TorchRequiredError(
            f"{command} {why} and needs torch; install it "
            f"with `pip install oomkit[{extra}]` (replay, simulate, tune, demo and explain need "
            "none)"
        ) from exc
