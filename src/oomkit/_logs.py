"""Other libraries' log lines a prediction does not act on, kept out of the user's terminal."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["TORCHAO_IMPORT_LOGGERS", "quiet_loggers"]

# Loggers that speak while torchao is imported on a machine without its CUDA kernels: torchao's
# "Failed to load ..._C_*.so" (torchao/__init__.py: its C++ extensions are optional; no
# prediction uses them) and torch's pytree note on torchao's Enum registrations
# (torch/utils/_pytree.py register_constant). peft imports torchao when it is installed.
TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """While open, the named loggers (``""``: the root logger) pass only errors; their levels
    are restored after.

    Args:
        names: logger names, e.g. ``"torchao"`` (its "Failed to load ..._C_*.so" on a machine
            without its CUDA kernels) or ``"torch.utils._pytree"``.
    """
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
