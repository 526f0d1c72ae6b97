"""torch.optim as it runs on CUDA: the foreach / fused / capturable choices, for meta tensors.

Why it is needed: ``torch.optim`` decides per step which implementation runs from the device of
the parameters (torch/optim/optimizer.py ``_default_to_fused_or_foreach``). With ``foreach`` and
``fused`` left at None it picks the multi-tensor (foreach) path only for devices in
``_get_foreach_kernels_supported_devices()`` (cuda, xpu, mtia, privateuse1; torch/utils/
_foreach_utils.py). On meta it falls back to the single-tensor loop, whose temporaries differ:
Adam's foreach path holds ``_foreach_sqrt(exp_avg_sqs)``, a copy of every ``exp_avg_sq`` at
once, while the loop holds at most two parameter-sized tensors and the previous ``denom``.

While :func:`cuda_optimizer_defaults` is active the device lists also name ``meta``, so:
- ``foreach`` defaults to True as on CUDA, unless the user passed ``foreach=False`` or
  ``fused=True`` (``_default_to_fused_or_foreach`` is only consulted when both are None).
- ``fused=True`` passes ``_device_dtype_check_for_fused``; the meta kernels of
  ``_fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_`` are in-place and allocate nothing, as
  the CUDA kernels do, and ``step`` lives on the device (``capturable or fused``).
- ``capturable=True`` passes the capturable device check (``_get_capturable_supported_devices``).
- ``torch.nn.utils.clip_grad_norm_`` takes the foreach path (``_device_has_foreach_support``).

``step`` stays a CPU tensor without capturable/fused (adam.py ``_init_group``: "Deliberately
host `step` on CPU"), so it costs no device memory; nothing here changes that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch.optim.optimizer as _optimizer
import torch.utils._foreach_utils as _foreach_utils

__all__ = ["EMULATED_DEVICE", "cuda_optimizer_defaults"]

# The device type whose tensors stand for CUDA tensors while tracing.
EMULATED_DEVICE = "meta"


def _with_emulated(
    original: Callable[..., list[str]], emulated: str
) -> Callable[..., list[str]]:
    def devices(*args: object, **kwargs: object) -> list[str]:
        # A fresh list per call: _device_dtype_check_for_fused removes "cuda" from it in place.
        found = list(original(*args, **kwargs))
        if "cuda" in found and emulated not in found:
            found.append(emulated)
        return found

    return devices


@contextlib.contextmanager
def cuda_optimizer_defaults(emulated: str = EMULATED_DEVICE) -> Iterator[None]:
    """While active, optimizers and ``clip_grad_norm_`` treat meta tensors as CUDA tensors.

    ``emulated`` names another device type to treat so (``"cpu"`` for fake tensors on a fake
    process group, ``distributed.py``).

    Patches the device-list functions in the module namespaces that read them at call time
    (``torch.optim.optimizer`` and ``torch.utils._foreach_utils``) and restores them on exit.
    Optimizers built before entering are covered: the choice is made at each ``step()``.
    """
    patches: list[tuple[object, str]] = [
        (_optimizer, "_get_foreach_kernels_supported_devices"),
        (_optimizer, "_get_fused_kernels_supported_devices"),
        (_optimizer, "_get_capturable_supported_devices"),
        (_foreach_utils, "_get_foreach_kernels_supported_devices"),
    ]
    originals = [(module, name, getattr(module, name)) for module, name in patches]
    try:
        for module, name, original in originals:
            setattr(module, name, _with_emulated(original, emulated))
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
