"""torchtitan's weight initialisation on fake tensors: drawn without reading a value.

``init_weights`` draws each weight as its config's ``param_init`` says
(torchtitan/models/common/param_init.py: ``partial(trunc_normal_, std=0.02)`` for a linear);
fake tensors have no values, so the draws that read one are replaced while the job's model
parts initialise (``torchtitan_job.py``, as trainer.py:503-505 calls ``init_weights``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["values_free_init"]


@contextlib.contextmanager
def values_free_init() -> Iterator[None]:
    """While open, weight initialisation reads no tensor value (fake tensors have none).

    torch/nn/init.py ``_no_grad_trunc_normal_`` redraws out-of-range values in a loop that
    asks ``mask.any()``; here it draws once and clamps (same tensors, same sizes: values do
    not change memory). DTensor's random ops would make an ``OffsetBasedRNGTracker``, whose
    offsets read the generator's state (torch/distributed/tensor/_dispatch.py, ``random``
    ops); here they draw locally (``is_rng_supported_mesh`` answers False).
    """
    import torch.distributed.tensor._dispatch as dtensor_dispatch
    import torch.nn.init as nn_init

    def trunc_normal(
        tensor: Any, mean: float, std: float, a: float, b: float, generator: Any = None
    ) -> Any:
        return tensor.normal_(mean, std, generator=generator).clamp_(a, b)

    saved_init = nn_init._no_grad_trunc_normal_
    saved_rng = dtensor_dispatch.is_rng_supported_mesh
    nn_init._no_grad_trunc_normal_ = trunc_normal
    setattr(dtensor_dispatch, "is_rng_supported_mesh", lambda device_mesh: False)  # noqa: B010
    try:
        yield
    finally:
        nn_init._no_grad_trunc_normal_ = saved_init
        dtensor_dispatch.is_rng_supported_mesh = saved_rng
