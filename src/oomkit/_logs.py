"""Other libraries' log lines a prediction does not act on, kept out of the user's terminal."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["quiet_loggers"]


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
