"""``torch.compile`` inside a traced step: run eagerly, and counted so that the report says so.

oomkit records what eager PyTorch allocates; it does not model Inductor's generated kernels
(fusion frees intermediates earlier and saves fewer tensors for backward; CUDA graphs keep a
private pool). Dynamo enters compiled code through one function of torch/_dynamo/eval_frame.py,
``_callback_from_stance``, which returns the frame callback for the current stance; under
``torch.compiler.set_stance("force_eager")`` it returns ``None`` and the code runs eagerly. While
:func:`compiled_code_eager` is open that function returns ``None`` for every compiled region, as
``force_eager`` does, and counts the regions entered, by the user's line that entered them.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from oomkit.prediction.tracing.stand_ins import read_site

__all__ = ["compiled_code_eager"]


@contextlib.contextmanager
def compiled_code_eager(entered: Counter[str]) -> Iterator[None]:
    """While open, compiled functions and modules run eagerly; ``entered`` counts them by site.

    Args:
        entered: ``"train.py:30 in step"`` -> how many times compiled code was entered there.
    """
    try:
        import torch._dynamo.eval_frame as eval_frame
    except ImportError:  # pragma: no cover - a torch without dynamo
        yield
        return
    original = getattr(eval_frame, "_callback_from_stance", None)
    if original is None:  # pragma: no cover - torch before set_stance (2.6)
        yield
        return

    def callback_from_stance(callback: Any) -> Any:
        if callback in (False, None):
            return original(callback)
        site = read_site()
        where = "compiled code"
        if site is not None:
            user = site.user
            where = f"{user[0]}:{user[1]} in {user[2]}" if user else site.location
        entered[where] += 1
        return None  # the force_eager stance: run the frame as plain Python

    eval_frame._callback_from_stance = callback_from_stance
    try:
        yield
    finally:
        eval_frame._callback_from_stance = original
