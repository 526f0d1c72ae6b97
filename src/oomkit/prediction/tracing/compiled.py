"""``torch.compile`` inside a traced step: recorded as compiled, or run eagerly; counted either way.

With ``compile=True`` (``oomkit predict --compile``) compiled regions are compiled for real by
dynamo and AOTAutograd, with Inductor's memory plan emulated (:func:`compiled_code_recorded`,
``compile_backend.py``). Otherwise oomkit records what eager PyTorch allocates; it does not model Inductor's generated kernels
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
from typing import TYPE_CHECKING, Any

from oomkit.prediction.tracing.stand_ins import read_site

if TYPE_CHECKING:
    from oomkit.prediction.tracing.compile_backend import InductorStandIn
    from oomkit.prediction.tracing.engine import CudaEmulationEngine

__all__ = ["compiled_code_eager", "compiled_code_recorded"]


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
        entered[_site()] += 1
        return None  # the force_eager stance: run the frame as plain Python

    eval_frame._callback_from_stance = callback_from_stance
    try:
        yield
    finally:
        eval_frame._callback_from_stance = original


@contextlib.contextmanager
def compiled_code_recorded(
    engine: CudaEmulationEngine, entered: Counter[str]
) -> Iterator[InductorStandIn | None]:
    """While open, ``torch.compile`` (Inductor backend) compiles through :class:`InductorStandIn`.

    Dynamo skips compiling while a dispatch mode that does not ignore compile internals is on
    the stack (torch/_dynamo/convert_frame.py ``ConvertFrame.__call__``), so the recorder's
    modes say they ignore them (torch/utils/_python_dispatch.py ``ignore_compile_internals``):
    they are off while dynamo and AOTAutograd trace, and on while the compiled graphs run.
    Inductor is reached through ``torch._inductor.compile_fx.compile_fx`` (the default backend's
    ``_TorchCompileInductorWrapper`` and ``backend="inductor"`` both look it up when they
    compile), which is replaced. Dynamo's caches are reset on entry and exit, so no compiled code
    made for another recording (or holding this one) is run. Other backends run as they are.

    Args:
        engine: the engine whose storages the compiled graphs' buffers are recorded in.
        entered: counts compiled regions entered, by the user's line.

    Yields:
        The stand-in (its ``plans`` say what was compiled), or None for a torch without dynamo.
    """
    try:
        import torch._dynamo
        import torch._dynamo.eval_frame as eval_frame
        import torch._inductor.compile_fx as compile_fx_module
    except ImportError:  # pragma: no cover - a torch without dynamo
        yield None
        return
    from oomkit.prediction.tracing._modes import OpDispatchMode
    from oomkit.prediction.tracing.compile_backend import InductorStandIn
    from oomkit.prediction.tracing.values import KnownValues

    stand_in = InductorStandIn(engine)
    original_compile_fx = compile_fx_module.compile_fx
    original_stance = eval_frame._callback_from_stance
    mode_classes: tuple[type[Any], ...] = (OpDispatchMode, KnownValues)
    saved = [cls.__dict__.get("ignore_compile_internals") for cls in mode_classes]

    def callback_from_stance(callback: Any) -> Any:
        if callback not in (False, None):
            entered[_site()] += 1
        return original_stance(callback)

    torch._dynamo.reset()
    compile_fx_module.compile_fx = stand_in  # type: ignore[assignment]
    eval_frame._callback_from_stance = callback_from_stance
    for mode_class in mode_classes:
        mode_class.ignore_compile_internals = classmethod(lambda cls: True)
    try:
        yield stand_in
    finally:
        for mode_class, before in zip(mode_classes, saved, strict=True):
            if before is None:
                del mode_class.ignore_compile_internals
            else:  # pragma: no cover - neither class defines it today
                mode_class.ignore_compile_internals = before
        eval_frame._callback_from_stance = original_stance
        compile_fx_module.compile_fx = original_compile_fx
        torch._dynamo.reset()


def _site() -> str:
    site = read_site()
    if site is None:
        return "compiled code"
    user = site.user
    return f"{user[0]}:{user[1]} in {user[2]}" if user else site.location
