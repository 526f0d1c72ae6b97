"""``from_pretrained(..., device_map=...)`` onto the emulated GPU, as transformers loads it.

Two things in transformers' loading do not reach oomkit's emulated CUDA as written:

- **Device indices.** A device map names GPUs by index: ``device_map=0``, ``{"": 0}``, and what
  ``"auto"`` / ``"balanced"`` / ``"sequential"`` infer (accelerate's ``infer_auto_device_map``
  answers ``{"": 0}`` when the model fits the GPU). transformers then calls
  ``torch.device(0)`` (modeling_utils.py ``is_accelerator_device`` and the expanded map), which
  asks torch for its accelerator, and a CPU build of torch has none. While open, the maps that
  ``check_and_set_device_map`` and ``_get_device_map`` (transformers/integrations/accelerate.py)
  give back name each GPU ``cuda:N``, which is the same device.
- **Loader threads.** transformers 5 copies each weight to its device in a thread pool
  (core_model_loading.py ``convert_and_load_state_dict_in_model``: ``ThreadPoolExecutor``),
  where oomkit's torch-function mode, which is per thread, does not see the copy.
  ``HF_DEACTIVATE_ASYNC_LOAD=1``, transformers' own switch, loads them in the calling thread:
  the same copies of the same weights to the same device, one at a time.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from oomkit.prediction.tracing.import_hooks import patched_on_import

__all__ = ["hf_loading_onto_cuda"]

# transformers/core_model_loading.py: is_env_variable_true("HF_DEACTIVATE_ASYNC_LOAD").
_SYNC_LOAD = "HF_DEACTIVATE_ASYNC_LOAD"
# The module that binds both device-map functions (imported from integrations/accelerate.py).
_MODELING = "transformers.modeling_utils"
_MAP_FUNCTIONS = ("check_and_set_device_map", "_get_device_map")


def _named(device: Any) -> Any:
    """A GPU index as ``cuda:N`` (bools, strings and devices as they are)."""
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return f"cuda:{device}"
    return device


def _map_named(device_map: Any) -> Any:
    if isinstance(device_map, dict):
        return {key: _named(device) for key, device in device_map.items()}
    return _named(device_map)


def _patch_modeling(module: ModuleType) -> Callable[[], None]:
    originals = {name: getattr(module, name) for name in _MAP_FUNCTIONS if hasattr(module, name)}

    def wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def named(*args: Any, **kwargs: Any) -> Any:
            return _map_named(original(*args, **kwargs))

        return named

    for name, original in originals.items():
        setattr(module, name, wrapped(original))

    def undo() -> None:
        for name, original in originals.items():
            setattr(module, name, original)

    return undo


@contextlib.contextmanager
def hf_loading_onto_cuda() -> Iterator[None]:
    """While open, transformers' ``from_pretrained`` loads onto the emulated GPU (module
    docstring); transformers is not imported here."""
    before = os.environ.get(_SYNC_LOAD)
    os.environ[_SYNC_LOAD] = "1"
    try:
        with patched_on_import(_MODELING, _patch_modeling):
            yield
    finally:
        if before is None:
            os.environ.pop(_SYNC_LOAD, None)
        else:
            os.environ[_SYNC_LOAD] = before
