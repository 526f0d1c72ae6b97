"""The oldest torch the recorder runs on, checked once when ``oomkit.prediction.tracing`` is imported.

Checked on the CUDA wheels from PyPI, without a GPU (2026-11-23): torch 2.5.1, 2.6.0, 2.8.0,
2.10.0 and 2.13.0 record GPT-2 to the same bytes. Older ones cannot:
- 2.4 and earlier: the flash / mem-efficient SDPA forward ops have no meta kernel (only
  FakeTensor rules), ``scaled_dot_product_attention`` has no ``enable_gqa``, and fused Adam's
  device check cannot be reached from ``torch.optim.optimizer``;
- 2.3 and earlier also lack ``_foreach_addcdiv_.ScalarList`` on meta and
  ``_get_capturable_supported_devices``;
- 2.1: a storage's Python object does not live as long as the storage, so frees are never seen.
"""

from __future__ import annotations

import re

from oomkit.errors import TorchRequiredError

__all__ = ["MIN_TORCH", "check_torch_version", "torch_minor"]

MIN_TORCH = (2, 5)


def torch_minor(version: str) -> tuple[int, int] | None:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``None`` for a version that does not parse."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def check_torch_version(version: str) -> None:
    """Raise ``TorchRequiredError`` when ``version`` (``torch.__version__``) is below
    ``MIN_TORCH``; versions that do not parse (a source build) pass."""
    found = torch_minor(version)
    if found is not None and found < MIN_TORCH:
        raise TorchRequiredError(
            f"oomkit.prediction.tracing needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}; this is torch "
            f"{version}, whose meta device cannot stand in for CUDA here (no meta kernels for "
            f"the fused attention ops). Upgrade with `pip install 'torch>={MIN_TORCH[0]}."
            f"{MIN_TORCH[1]}'`; replay, simulate and tune work without torch."
        )


def _require_supported_torch() -> None:
    try:
        import torch
    except ImportError as exc:
        raise TorchRequiredError(
            "oomkit.prediction.tracing records PyTorch code and needs torch; install it with "
            "`pip install oomkit[torch]`"
        ) from exc
    check_torch_version(torch.__version__)


# Importing oomkit.prediction.tracing (which imports this first) fails early on a torch it cannot use.
_require_supported_torch()
