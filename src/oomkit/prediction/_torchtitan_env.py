"""The installed torchtitan, made importable and pointed at the fake process group's host mesh.

Kept apart from ``torchtitan_job.py`` (which mirrors the trainer's build) because these are the
three things about torchtitan itself that a GPU-free run has to arrange:

* which releases are supported (their trainer's build sequence is what ``torchtitan_job.py``
  mirrors, line by line);
* its config registries import ``torchtitan.trainer``, which imports the data loaders
  (torchtitan/hf_datasets/text_datasets.py: ``from datasets import Dataset, load_dataset``),
  so without the Hugging Face ``datasets`` package no job can even be named. A prediction never
  loads data, so a stand-in module answers those three names while torchtitan is imported;
* its quantization converters ask the GPU's compute capability
  (torchtitan/components/quantization/float8.py ``Float8LinearConverter.__init__``:
  ``has_cuda_capability(8, 9)``), which a host without a GPU cannot answer: the target GPU's
  answers (``cuda_capability``);
* torchtitan picks the device of its meshes once, at import (torchtitan/tools/utils.py
  ``get_device_info``: ``_get_available_device_type() or "cuda"``); the fake process group's
  mesh is a ``cpu`` one (prediction/tracing/distributed.py ``fake_process_group``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import sys
import types
from collections.abc import Iterator
from typing import Any

from oomkit._logs import quiet_loggers
from oomkit.errors import OomkitError

__all__ = [
    "SUPPORTED_TORCHTITAN",
    "cuda_capability",
    "import_torchtitan",
    "meshes_on_the_host",
    "quiet_torchtitan_logs",
    "torchtitan_version",
]

# The releases whose trainer.py build sequence torchtitan_job.py mirrors (tested: 0.3.0).
SUPPORTED_TORCHTITAN = ("0.3.0",)


def torchtitan_version() -> str:
    """The installed torchtitan's version.

    Raises:
        OomkitError: torchtitan is not installed, or is a release whose trainer is not mirrored.
    """
    try:
        installed = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError:
        raise OomkitError(
            "--torchtitan runs torchtitan's own code, which is not installed: "
            f"`pip install torchtitan=={SUPPORTED_TORCHTITAN[-1]}` (with torchao for Float8)"
        ) from None
    if installed not in SUPPORTED_TORCHTITAN:
        raise OomkitError(
            f"torchtitan {installed} is installed; oomkit mirrors the trainer of torchtitan "
            f"{', '.join(SUPPORTED_TORCHTITAN)} (torchtitan/trainer.py Trainer.__init__ and "
            f"train_step): install it (`pip install torchtitan=={SUPPORTED_TORCHTITAN[-1]}`), "
            "or predict the model with oomkit's presets (`oomkit predict llama3-8b --fsdp 8`)"
        )
    return installed


def _datasets_stand_in() -> dict[str, types.ModuleType]:
    """A ``datasets`` module with the names torchtitan's text data loaders import."""

    def _no_data(*args: Any, **kwargs: Any) -> Any:
        raise OomkitError("oomkit predicts torchtitan runs without loading data")

    root = types.ModuleType("datasets")
    distributed = types.ModuleType("datasets.distributed")
    root.Dataset = type("Dataset", (), {})  # type: ignore[attr-defined]
    root.load_dataset = _no_data  # type: ignore[attr-defined]
    distributed.split_dataset_by_node = _no_data  # type: ignore[attr-defined]
    root.distributed = distributed  # type: ignore[attr-defined]
    return {"datasets": root, "datasets.distributed": distributed}


def import_torchtitan(name: str) -> types.ModuleType:
    """Import ``name`` from the installed torchtitan (``"torchtitan.config"``).

    Where ``datasets`` is missing, a stand-in answers torchtitan's data loaders' imports while
    ``name`` is imported and is removed from ``sys.modules`` afterwards.

    Raises:
        OomkitError: an unsupported torchtitan (see ``torchtitan_version``).
    """
    torchtitan_version()
    stand_ins: dict[str, types.ModuleType] = {}
    try:
        import datasets  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        stand_ins = _datasets_stand_in()
    with quiet_torchtitan_logs(), _no_triton_kernels_defined():
        if not stand_ins:
            return importlib.import_module(name)
        sys.modules.update(stand_ins)
        try:
            return importlib.import_module(name)
        finally:
            for key, module in stand_ins.items():
                if sys.modules.get(key) is module:
                    del sys.modules[key]


@contextlib.contextmanager
def _no_triton_kernels_defined() -> Iterator[None]:
    """While torchtitan imports, ``torch.utils._triton.has_triton()`` answers False.

    torchtitan's quantization components import torchao's MoE kernels
    (torchao/prototype/moe_training/kernels/float8_rowwise.py), which define their Triton
    kernels at import when ``has_triton()`` is True; triton 3.9's autotuner rejects one of them
    (``key=["num_elements"]`` is not a kernel argument), so the import fails. ``has_triton`` is
    cached (``functools.cache``): once a compiled or CUDA-emulated step has asked it (True under
    oomkit's CUDA emulation), every later import would fail. A prediction runs no Triton kernel.
    """
    import torch.utils._triton as triton_utils

    real = triton_utils.has_triton
    triton_utils.has_triton = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        triton_utils.has_triton = real


def quiet_torchtitan_logs() -> contextlib.AbstractContextManager[None]:
    """torchtitan logs its own advice at WARNING: on its logger ("HF assets path ... does not
    exist!") and on the root logger (torchtitan/components/checkpointer/base.py
    ``initial_load_model_only=True has no effect ...``), which a prediction does not act on;
    torchao, which its converters import, adds its own (``oomkit._logs.TORCHAO_IMPORT_LOGGERS``)."""
    return quiet_loggers("torchtitan", "", "torchao", "torch.utils._pytree")


@contextlib.contextmanager
def meshes_on_the_host() -> Iterator[None]:
    """While open, torchtitan builds its meshes on ``cpu``, the fake process group's device.

    torchtitan/distributed/parallel_dims.py ``build_mesh`` calls
    ``init_device_mesh(device_type, ...)`` with the module-level ``device_type`` it imported
    from torchtitan/tools/utils.py; torchtitan/distributed/utils.py holds the same name.
    """
    parallel_dims = import_torchtitan("torchtitan.distributed.parallel_dims")
    dist_utils = import_torchtitan("torchtitan.distributed.utils")
    saved = [(module, getattr(module, "device_type")) for module in (parallel_dims, dist_utils)]  # noqa: B009
    for module, _ in saved:
        setattr(module, "device_type", "cpu")  # noqa: B010
    try:
        with quiet_torchtitan_logs():
            yield
    finally:
        for module, value in saved:
            setattr(module, "device_type", value)  # noqa: B010


# The modules that ask has_cuda_capability, each holding the name it imported
# (torchtitan/components/quantization/float8.py, mx.py, nvfp4.py; tools/utils.py itself, which
# models/common/config_utils.py imports inside get_attention_config).
_CAPABILITY_ASKERS = (
    "torchtitan.tools.utils",
    "torchtitan.components.quantization.float8",
    "torchtitan.components.quantization.mx",
    "torchtitan.components.quantization.nvfp4",
)


@contextlib.contextmanager
def cuda_capability(capability: tuple[int, int]) -> Iterator[None]:
    """While open, torchtitan's ``has_cuda_capability(major, minor)`` answers for a GPU of
    ``capability`` (torchtitan/tools/utils.py: ``torch.cuda.get_device_capability() >=
    (major, minor)``), e.g. ``(9, 0)`` for an H100.
    """

    def has_cuda_capability(major: int, minor: int) -> bool:
        return capability >= (major, minor)

    saved = []
    for name in _CAPABILITY_ASKERS:
        module = import_torchtitan(name)
        saved.append((module, getattr(module, "has_cuda_capability")))  # noqa: B009
        setattr(module, "has_cuda_capability", has_cuda_capability)  # noqa: B010
    try:
        yield
    finally:
        for module, original in saved:
            setattr(module, "has_cuda_capability", original)  # noqa: B010
