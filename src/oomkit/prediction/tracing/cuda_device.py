"""One CUDA GPU, as training frameworks see it, whose tensors land on the meta device.

Why it is needed: Lightning and Hugging Face trainers choose their device, precision and
autocast from what ``torch.cuda`` reports. Without a GPU they pick the CPU: Lightning's
``Trainer(accelerator="gpu")`` and transformers' ``TrainingArguments(bf16=True)`` refuse to build,
``precision="bf16-mixed"`` becomes CPU autocast (which casts nothing on meta tensors, a silent
fp32 step), and ``Trainer.fit`` moves the meta model to the CPU ("Cannot copy out of meta
tensor"). Inside ``as_one_cuda_gpu()`` they choose what they choose on a one-GPU machine
instead, and every tensor they put on ``cuda`` is put on ``meta``, the recorder's stand-in for it.

What it changes while open (all undone on exit):
- ``torch.cuda`` reports one device of the target GPU (``torch.version.cuda`` the target's
  CUDA runtime, ``torch.backends.cudnn.version()`` the cuDNN the SDPA emulation assumes,
  ``torch.cuda.nccl.version()`` the NCCL whose memory ``core/gpus/nccl.py`` models):
  ``is_available()`` True, ``device_count()`` 1, ``current_device()`` 0, the GPU's name,
  compute capability and memory, bf16 supported on sm >= 8.0 (torch/cuda/__init__.py
  ``is_bf16_supported``); ``set_device`` (an index past ``device_count()`` raises CUDA's invalid
  device ordinal, as a tensor put on one does), ``synchronize``, ``torch.cuda.device(i)`` and
  the CUDA seeds do nothing (there is no device to act on), and ``torch.cuda.Event`` times 0 ms.
  The memory counters
  (``memory_allocated()``, ``memory_reserved()``, their peaks, ``memory_stats()``, the resets)
  read the enclosing recorder's requests so far, replayed on the simulated allocator
  (``step_memory.py``; nothing served outside one); ``mem_get_info`` reads the total less the
  CUDA context and what that allocator holds reserved; ``empty_cache`` is a request of the
  recording, which the report's replay carries out. Side streams are emulated
  (``cuda_streams.py``): what is allocated while one is current goes to its pool.
- ``torch.accelerator`` reports ``cuda`` and answers as ``torch.cuda`` (``cuda_bindings.py``).
- A ``TorchFunctionMode`` puts tensors made or moved to ``cuda`` (``device=`` arguments,
  ``Tensor.to``, ``Tensor.cuda``, ``Module.to`` through them) on ``meta``. A meta tensor sent
  back to the CPU (``Strategy.teardown`` moves the model and optimizer state to the CPU after
  fit) stays where it is: the copy would cost host memory, not GPU memory, and a meta tensor has
  no values to copy (activations offloaded by ``save_on_cpu`` are ``host_offload.py``'s).
  A factory's ``pin_memory=True`` makes an unpinned host tensor, and ``pin_memory()`` of a meta
  tensor is the tensor itself, and of a CPU tensor too (pinned host memory is host memory, which
  the prediction does not count; torch's own ``pin_memory`` needs a real accelerator).
- ``Module.to("cuda")`` keeps shared parameters shared and the optimizers built before it
  pointed at the moved ones, and a bare index (``model.to(local_rank)``) is CUDA's
  (``module_moves.py``).
- Tensors made on ``cuda`` from Python numbers (``torch.tensor(len(loader), device=...)``) are
  ``torch.full`` on meta, so their values stay known to ``values.py``. Reads of
  values (a logged loss's ``.item()``) are ``value_reads``'s: answered, stated or stood in for.

In a distributed recording (``cuda_ranks.as_cuda_rank``) the tensors of the fake process group
live under ``FakeTensorMode`` on its fake device, ``cpu``; there CUDA tensors land on that
device instead of meta (``as_one_cuda_gpu(lands_on="cpu")``), and a move to CUDA of a host
tensor (one made from Python data, ``fake_storages.mark_host``) is a copy onto the device.

Where it may differ: code that reads other GPU properties than those above, or calls CUDA
functions not listed (``torch.cuda.get_rng_state``), still sees no CUDA and raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils import _device as _device_modes

from oomkit.core.gpus import GpuSpec, get_gpu
from oomkit.core.gpus.cuda_versions import cuda_build_for
from oomkit.core.gpus.nccl import NCCL_VERSION
from oomkit.errors import ConfigError
from oomkit.prediction.tracing._from_data import MAX_DATA_VALUE_BYTES
from oomkit.prediction.tracing.cuda_bindings import cuda_bindings
from oomkit.prediction.tracing.cuda_loads import restoring_on
from oomkit.prediction.tracing.cuda_streams import TimingEvent, user_streams
from oomkit.prediction.tracing.data_loaders import pinning_on_the_host
from oomkit.prediction.tracing.data_parallel import data_parallel_on_one_gpu
from oomkit.prediction.tracing.emulations.sdpa_backend import current_sdpa_settings
from oomkit.prediction.tracing.fake_storages import is_fake_or_wrapper, stands_for_cuda
from oomkit.prediction.tracing.hf_loading import hf_loading_onto_cuda
from oomkit.prediction.tracing.host_offload import saving_on_host
from oomkit.prediction.tracing.module_moves import (
    module_moves_keep_sharing,
    module_to_index_is_cuda,
)
from oomkit.prediction.tracing.step_memory import StepMemory
from oomkit.prediction.tracing.values import remember_value

__all__ = [
    "allocator_used",
    "as_one_cuda_gpu",
    "counting_allocations",
    "cuda_default",
    "emptying_cache",
    "entries_recorded",
    "is_cuda",
    "recording_memory",
]

_META = torch.device("meta")
# torch/cuda/__init__.py is_bf16_supported: True from compute capability 8.0 (Ampere) on; below
# it, with including_emulation=True (the default), True when a bf16 tensor can be made on the
# device (_check_bf16_tensor_supported), which every architecture torch builds for allows.
_BF16_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class _DeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports that frameworks read (DataParallel
    compares ``multi_processor_count``: ``GpuSpec.kernel_multiprocessor_count``)."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int


def is_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch.device(0) is cuda:0 (c10/core/Device.cpp: an index alone is CUDA's)
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


def _cuda_checked(device: Any) -> bool:
    """``is_cuda(device)``, where an index past the node's GPUs fails as CUDA's ordinal check
    does when a tensor is put there (c10/cuda/CUDAFunctions.cpp ``c10_cuda_check_implementation``
    of ``cudaSetDevice``: cudaErrorInvalidDevice)."""
    if not is_cuda(device):
        return False
    index = device if isinstance(device, int) else torch.device(device).index
    if index is not None and _open_gpus and index >= _open_gpus[-1][2]:
        raise RuntimeError(
            f"CUDA error: invalid device ordinal (a tensor put on cuda:{index} on a node of "
            f"{_open_gpus[-1][2]} GPU(s): a torchrun worker's GPU is its LOCAL_RANK, not its "
            "RANK)"
        )
    return True


def _on_meta_eagerly(device: Any) -> bool:
    meta = device.type == "meta" if isinstance(device, torch.device) else device == "meta"
    return meta and not torch.compiler.is_compiling()


def _is_cpu(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return isinstance(device, str) and device.split(":")[0] == "cpu"


# Factory functions whose value is the Python number they are given.
_FROM_PYTHON = frozenset({torch.tensor, torch.as_tensor, torch.scalar_tensor})


class _CudaOnMeta(TorchFunctionMode):
    """Puts tensors bound for ``cuda`` on ``meta`` (or on the fake device, ``cpu``, of a
    distributed recording); keeps meta tensors sent to the CPU."""

    def __init__(self, device: torch.device = _META) -> None:
        super().__init__()
        self._device = device

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = _default_device_given(func, dict(kwargs or {}))
        if kwargs.get("pin_memory") and not is_cuda(kwargs.get("device")):
            # A pinned host buffer (torch.empty(n, pin_memory=True)): host memory, not counted,
            # made unpinned (torch's pinned allocator needs a real accelerator), as pin_memory().
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to or func is torch.Tensor.cuda:
            for arg in args[1:2]:  # .to("cuda:9"), .cuda(9): the device, where positional
                _cuda_checked(arg)
        if self._device.type != "meta":
            return self._onto_fake_device(func, args, kwargs)
        asked_cuda = _cuda_checked(kwargs.get("device"))
        if asked_cuda:
            kwargs["device"] = _META
        self_tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_meta = self_tensor is not None and self_tensor.device.type == "meta"
        if func is torch.Tensor.to:
            moved = _cpu_to_meta(args, kwargs)
            if moved is not None:
                return moved
            args = tuple(_META if is_cuda(a) else a for a in args)
            if on_meta:
                # A meta tensor sent to the CPU stays: the CPU is read as its own device.
                args = tuple(_META if _is_cpu(a) else a for a in args)
                if _is_cpu(kwargs.get("device")):
                    kwargs["device"] = _META
        elif func is torch.Tensor.cuda:
            assert self_tensor is not None
            return self_tensor.to(_META, non_blocking=bool(kwargs.get("non_blocking", False)))
        elif func is torch.Tensor.pin_memory or (func is torch.Tensor.cpu and on_meta):
            assert self_tensor is not None
            return self_tensor
        elif func is torch.Tensor.is_pinned:
            return False
        elif func in _FROM_PYTHON and (asked_cuda or _on_meta_eagerly(kwargs.get("device"))):
            # Data put on the device: CUDA by name, or meta, the device CUDA tensors are on,
            # given back by a library (transformers' generate makes its special tokens with
            # torch.tensor(ids, device=input_ids.device)). torch copies data to meta below the
            # dispatcher, where the recorder would not see the allocation. In code dynamo
            # compiles, the graph holds it as a constant (compile_backend.py) instead.
            return _from_python(func, args, kwargs)
        return func(*args, **kwargs)

    def _onto_fake_device(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A distributed recording's rules: CUDA is the fake device, host data is copied there."""
        device = self._device
        asked_cuda = _cuda_checked(kwargs.get("device"))
        if asked_cuda:
            kwargs["device"] = device
        self_tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.Tensor.to and self_tensor is not None:
            to_cuda = any(is_cuda(a) for a in args[1:]) or asked_cuda
            args = tuple(device if is_cuda(a) else a for a in args)
            if to_cuda:
                return _host_copied(func(*args, **kwargs))
        elif func is torch.Tensor.cuda:
            assert self_tensor is not None
            return _host_copied(self_tensor)
        elif func is torch.Tensor.pin_memory:
            assert self_tensor is not None
            return self_tensor
        elif func is torch.Tensor.is_pinned:
            return False
        elif func in _FROM_PYTHON and asked_cuda:
            # torch.tensor(data, device="cuda"): made on the host, then copied to the device.
            return _host_copied(func(*args, **kwargs))
        return func(*args, **kwargs)


def _default_device_given(func: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the default device a factory would get written in, where it is CUDA.

    A default device is a ``DeviceContext`` mode that adds ``device=`` to a factory call (its
    ``_device_constructors``; torch/utils/_device.py). ``with torch.device("cuda"):`` pushes it
    on top of the mode stack (torch/csrc/Device.cpp), where it runs before this mode;
    ``torch.set_default_device("cuda")`` puts it at the bottom (``DeviceContext.__enter__``),
    where it would run after this mode had looked. While this mode runs, the stack holds the
    modes below it: the highest ``DeviceContext`` there would write the device."""
    if kwargs.get("device") is None and func in _device_modes._device_constructors():
        default = cuda_default()
        if default is not None:
            kwargs["device"] = default
    return kwargs


def cuda_default() -> torch.device | None:
    """The device the topmost ``DeviceContext`` on the mode stack gives, where it is CUDA."""
    modes = _get_current_function_mode_stack()
    found = [mode for mode in modes if isinstance(mode, _device_modes.DeviceContext)]
    return found[-1].device if found and is_cuda(found[-1].device) else None


def _cpu_to_meta(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``cpu_tensor.to("cuda")`` as CUDA does it: allocate on the device, copy into it.

    ``empty_like`` + ``copy_`` rather than one ``_to_copy``: the copy overwrites the new tensor
    with a CPU tensor's values, which ``values.py`` follows, so a batch's attention mask built
    on the CPU by a collator stays known on the device (transformers' mask checks read it).
    Only a plain device move; a move that also casts or changes layout goes the usual way.
    """
    tensor = args[0]
    rest = args[1:]
    if tensor.device.type != "cpu" or not rest or not is_cuda(rest[0]):
        return None
    if len(rest) > 2 or (len(rest) == 2 and not isinstance(rest[1], bool)):
        return None
    if set(kwargs) - {"non_blocking"}:
        return None
    out = torch.empty_like(tensor, device=_META)
    out.copy_(tensor)
    return out


def _host_copied(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as device memory: a host tensor of a fake world is copied to a new device
    tensor, as a host-to-device copy allocates on CUDA; a device tensor is itself."""
    if stands_for_cuda(tensor) or not is_fake_or_wrapper(tensor):
        return tensor  # on the device already, or a real CPU tensor: not a recording's business
    out = torch.empty_like(tensor)
    out.copy_(tensor)
    return out


def _from_python(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``torch.tensor(data, device="cuda")`` on meta, as an allocation the recorder sees.

    A number becomes ``torch.full((), number)``, a factory whose value ``values.py`` follows
    (so Lightning's ``reduce(torch.tensor(len(loader))) == 0`` is answered); other data is made
    on the CPU and copied, as CUDA does; its values are followed up to ``MAX_DATA_VALUE_BYTES``.
    """
    data = args[0] if args else kwargs.get("data")
    if isinstance(data, (bool, int, float)) and len(args) <= 1:
        # torch.tensor's dtype inference for a Python scalar (torch/csrc/utils/tensor_new.cpp
        # infer_scalar_type): bool -> bool, int -> int64, float -> the default dtype.
        inferred = (
            torch.bool
            if isinstance(data, bool)
            else torch.int64
            if isinstance(data, int)
            else torch.get_default_dtype()
        )
        return torch.full(
            (),
            data,
            dtype=kwargs.get("dtype") or inferred,
            device=_META,
            requires_grad=bool(kwargs.get("requires_grad", False)),
        )
    host = func(*args, **{**kwargs, "device": "cpu"})
    out = host.to(_META)
    if host.numel() * host.element_size() <= MAX_DATA_VALUE_BYTES:
        remember_value(out, host, f"torch.{func.__name__}")  # as value_reads' _from_data
    return out


class _NoDeviceSwitch:
    """``torch.cuda.device(i)`` / ``device_of(t)``: one device, nothing to switch to."""

    def __init__(self, device: Any = None) -> None:
        self.idx = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


# The open recorders' memory, innermost last (torch.cuda.memory_allocated() reads the last).
_memories: list[StepMemory] = []


def recording_memory() -> StepMemory:
    """The innermost open recorder's memory; outside any, an allocator that served nothing
    (an ``empty_cache()`` there goes to a log no recording reads)."""
    return _memories[-1] if _memories else StepMemory([])


_memory = recording_memory


def allocator_used() -> bool:
    """Whether the innermost open recorder has requested device memory yet."""
    return bool(_memories) and _memories[-1].used()


def entries_recorded() -> int:
    """Entries the innermost open recorder has logged so far (0 outside any)."""
    return _memories[-1].entries if _memories else 0


# Whether ``torch.cuda.empty_cache()`` is a request of the recording: the innermost
# ``as_one_cuda_gpu``'s or ``emptying_cache``'s choice.
_cache_emptied: list[bool] = []


def _empty_cache() -> None:
    if _cache_emptied and _cache_emptied[-1]:
        _memory().empty_cache()


@contextlib.contextmanager
def emptying_cache(emptied: bool = True) -> Iterator[None]:
    """While open, ``torch.cuda.empty_cache()`` is (``emptied``) or is not a request of the
    enclosing recording, whatever ``as_one_cuda_gpu`` chose: a trainer restarted for each
    recorded step empties no cache at its starts, but its ``training_step`` empties it where
    one run does (``torch_empty_cache_steps``)."""
    _cache_emptied.append(emptied)
    try:
        yield
    finally:
        _cache_emptied.pop()


@contextlib.contextmanager
def counting_allocations(memory: StepMemory) -> Iterator[StepMemory]:
    """While open, ``torch.cuda``'s memory counters (inside ``as_one_cuda_gpu``) read
    ``memory``."""
    _memories.append(memory)
    try:
        yield memory
    finally:
        _memories.remove(memory)


def _free_and_total(gpu: GpuSpec) -> tuple[int, int]:
    """``torch.cuda.mem_get_info()`` (``cudaMemGetInfo``): the device's free and total bytes.
    Free is the total less what is held outside the caching allocator (the CUDA context: the
    target's ``context_overhead_bytes``) and what the allocator holds reserved so far, its
    cached free blocks included (c10/cuda/CUDACachingAllocator.cpp gives them back to the
    device only in ``emptyCache`` and when a ``cudaMalloc`` fails); never below 0 (the replay
    has no memory limit, where the GPU would have run out)."""
    free = gpu.usable_bytes() - _memory().memory_reserved()
    return max(free, 0), gpu.total_memory_bytes


def _check_ordinal(device: Any, devices: int) -> None:
    """``torch.cuda.set_device(device)``: nothing to switch, but an index past the node's
    ``devices`` fails as on the GPU (torch/cuda/__init__.py ``set_device`` -> ``cudaSetDevice``:
    cudaErrorInvalidDevice), e.g. a script that sets its global rank on the second node."""
    index = torch.cuda._utils._get_device_index(device)
    if index >= devices:
        raise RuntimeError(
            f"CUDA error: invalid device ordinal (torch.cuda.set_device({index}) on a node of "
            f"{devices} GPU(s): a torchrun worker sets its LOCAL_RANK, not its RANK)"
        )


@contextlib.contextmanager
def _torch_cuda_reports(
    gpu: GpuSpec, devices: int, cuda_version: str | None, cudnn_version: int | None
) -> Iterator[None]:
    """``torch.cuda``'s queries answer for one ``gpu``; its device actions do nothing but
    ``empty_cache``, a request of the enclosing recording where ``emptying_cache`` says so.
    ``torch.version.cuda`` is ``cuda_version``, as in a CUDA build (a CPU build's is None, and
    libraries branch on it: transformers' ``TrainingArguments(tf32=True)`` refused);
    ``torch.backends.cudnn.version()`` is ``cudnn_version`` where known (a CPU build's None
    failed a script's ``version() >= 8000``), and ``torch.cuda.nccl.version()`` NCCL_VERSION
    (a CPU build has no ``torch._C._nccl_version``: a script logging it raised)."""
    major, minor = gpu.compute_capability or (9, 0)
    sms = gpu.kernel_multiprocessor_count
    properties = _DeviceProperties(gpu.name, gpu.total_memory_bytes, major, minor, sms)
    answers: dict[str, Any] = {
        "is_available": lambda: True,
        "device_count": lambda: devices,
        "current_device": lambda: 0,
        "set_device": lambda device: _check_ordinal(device, devices),
        "synchronize": lambda device=None: None,
        "empty_cache": _empty_cache,
        "get_device_name": lambda device=None: gpu.name,
        "get_device_capability": lambda device=None: (major, minor),
        "get_device_properties": lambda device=None: properties,
        "is_bf16_supported": lambda including_emulation=True: including_emulation
        or (major, minor) >= _BF16_MIN_CAPABILITY,
        # CUDAGeneratorImpl::get_state (aten/src/ATen/cuda/CUDAGeneratorImpl.cpp): the Philox
        # seed and offset, 8 bytes each. Dynamo saves and restores it around each compile.
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8, device="cpu"),
        "set_rng_state": lambda new_state, device="cuda": None,
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8, device="cpu")],
        "set_rng_state_all": lambda new_states: None,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "seed": lambda: None,
        "seed_all": lambda: None,
        "is_initialized": lambda: True,
        "init": lambda: None,
        "mem_get_info": lambda device=None: _free_and_total(gpu),
        "device": _NoDeviceSwitch,
        "device_of": _NoDeviceSwitch,
        "Event": TimingEvent,
        "memory_summary": lambda device=None, abbreviated=False: (
            "memory is measured by oomkit's recorder, not by the code it runs"
        ),
        "memory_allocated": lambda device=None: _memory().memory_allocated(),
        "max_memory_allocated": lambda device=None: _memory().max_memory_allocated(),
        "memory_reserved": lambda device=None: _memory().memory_reserved(),
        "max_memory_reserved": lambda device=None: _memory().max_memory_reserved(),
        "memory_stats": lambda device=None: _memory().memory_stats(),
        "reset_peak_memory_stats": lambda device=None: _memory().reset_peak_memory_stats(),
        "reset_max_memory_allocated": lambda device=None: _memory().reset_peak_memory_stats(),
        "reset_accumulated_memory_stats": lambda device=None: (
            _memory().reset_accumulated_memory_stats()
        ),
    }
    # torch.cuda re-exports torch.cuda.memory's functions, and that module calls its own
    # (memory_cached calls its memory_reserved; memory_stats_as_nested_dict its is_initialized):
    # both modules answer alike, or a script calling torch.cuda.memory.X would read 0.
    modules = (torch.cuda, torch.cuda.memory)
    saved = [
        (module, name, getattr(module, name), answers[name])
        for module in modules
        for name in answers
        if hasattr(module, name)
    ]
    # torch/cuda/nccl.py version() reads torch._C._nccl_version, which a CPU build lacks.
    saved.append((torch.cuda.nccl, "version", torch.cuda.nccl.version, lambda: NCCL_VERSION))
    if cudnn_version is not None:
        # torch/backends/cudnn/__init__.py: version() reads the library (None without it),
        # is_available() torch._C._has_cudnn.
        cudnn = torch.backends.cudnn
        saved.append((cudnn, "version", cudnn.version, lambda: cudnn_version))
        saved.append((cudnn, "is_available", cudnn.is_available, lambda: True))
    for module, name, _, answer in saved:
        setattr(module, name, answer)
    build_cuda, torch.version.cuda = torch.version.cuda, cuda_version
    try:
        with cuda_bindings(_memory):  # what torch's functions call below them (cuda_bindings.py)
            yield
    finally:
        torch.version.cuda = build_cuda
        for module, name, original, _ in saved:
            setattr(module, name, original)


@contextlib.contextmanager
def _cuda_default_reads_cuda() -> Iterator[None]:
    """``torch.get_default_device()`` under a CUDA default reads ``cuda:0``, as on the GPU: for an
    index-less default torch asks ``torch.tensor([]).device`` (torch/__init__.py), which lands
    on meta here, so a script's ``dev.type == "cuda"`` had read ``meta``."""
    original = torch.get_default_device

    def get_default_device() -> torch.device:
        default = cuda_default()
        return original() if default is None else torch.device("cuda", default.index or 0)

    torch.get_default_device = get_default_device
    try:
        yield
    finally:
        torch.get_default_device = original


# The GPUs, landing devices, device counts and CUDA and cuDNN versions of the open
# as_one_cuda_gpu blocks, innermost last: a nested block without a GPU (a trainer's step inside
# a trace, a builder inside a distributed recording) reports the one its caller chose, and puts
# CUDA tensors where its caller does.
_open_gpus: list[tuple[GpuSpec, torch.device, int, str | None, int | None]] = []


@contextlib.contextmanager
def as_one_cuda_gpu(
    gpu: GpuSpec | None = None,
    *,
    lands_on: str | None = None,
    cache_emptied: bool = True,
    devices: int | None = None,
    cuda_version: str | None = None,
    cudnn_version: int | None = None,
) -> Iterator[None]:
    """While open, frameworks see one CUDA ``gpu`` and their CUDA tensors land on meta.

    Args:
        gpu: the GPU reported; ``None`` means the GPU of an enclosing block, else an H100 SXM
            (the recorder's default).
        lands_on: where CUDA tensors are put: ``"meta"``, or ``"cpu"``, the fake device of a
            distributed recording (module docstring); ``None`` means an enclosing block's
            choice, else meta.
        cache_emptied: ``torch.cuda.empty_cache()`` is a request of the enclosing recording
            (``StepMemory.empty_cache``); False: it does nothing (a trainer restarted for each
            recorded step empties the cache where one run does not).
        devices: what ``torch.cuda.device_count()`` answers (a torchrun worker sees its node's
            GPUs, ``cuda_ranks.py``); ``None`` means an enclosing block's, else 1. Each is the
            same ``gpu``, and its tensors land where CUDA's do.
        cuda_version: what ``torch.version.cuda`` answers (the target's CUDA runtime,
            ``"13.0"``); ``None`` means an enclosing block's, else this torch build's
            (``cuda_build_for``: a CPU build's release's default wheel's).
        cudnn_version: what ``torch.backends.cudnn.version()`` answers (the target's,
            ``Target.cudnn_version``); ``None`` means an enclosing block's, else the one the
            SDPA emulation assumes (``current_sdpa_settings``: this torch build's, or its
            release's default wheel's).

    Raises:
        ConfigError: ``lands_on`` is another device.
    """
    enclosing = (
        _open_gpus[-1]
        if _open_gpus
        # The CUDA of this torch's build, or of its release's default wheel (a CPU build).
        else (
            get_gpu("h100-sxm"),
            _META,
            1,
            cuda_build_for(torch.__version__).cuda_version,
            current_sdpa_settings().cudnn_version,
        )
    )
    if lands_on not in (None, "meta", "cpu"):
        raise ConfigError(
            f"lands_on must be 'meta' or 'cpu' (a distributed recording's fake device); got "
            f"{lands_on!r}. Example: as_one_cuda_gpu(gpu, lands_on='cpu')"
        )
    device = enclosing[1] if lands_on is None else torch.device(lands_on)
    gpu = enclosing[0] if gpu is None else gpu
    devices = enclosing[2] if devices is None else devices
    cuda_version = enclosing[3] if cuda_version is None else cuda_version
    cudnn_version = enclosing[4] if cudnn_version is None else cudnn_version
    _open_gpus.append((gpu, device, devices, cuda_version, cudnn_version))
    try:
        with (
            emptying_cache(cache_emptied),
            _torch_cuda_reports(gpu, devices, cuda_version, cudnn_version),
            module_moves_keep_sharing(),
            module_to_index_is_cuda(),
            _cuda_default_reads_cuda(),
            restoring_on(device),
            user_streams(),
            data_parallel_on_one_gpu(),
            hf_loading_onto_cuda(),
            saving_on_host(),
            pinning_on_the_host(),
            _CudaOnMeta(device),
        ):
            yield
    finally:
        _open_gpus.pop()

