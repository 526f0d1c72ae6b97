"""Why a traced step failed, said where it happened and with advice that fits the failure.

A failure names the user's own line (the innermost frame outside torch, installed libraries,
oomkit and the standard library) and, when the exception came from deeper, the library frame it
came from. The advice depends on what failed:

- ``Cannot copy out of meta tensor`` / ``can't convert meta ... to numpy``: values copied off
  the traced device (``.numpy()``, a copy to the host used as data), which the meta device does
  not have. Moves themselves work (``.to("cuda")``, ``.cpu()``: ``cuda_device.as_one_cuda_gpu``);
  reading the values does not, except ``.item()`` and its kind (``value_reads``).
- an op that reads tensor values (``.item()`` in C++, ``nonzero``, boolean-mask indexing,
  ops with no meta kernel): in the user's code, move it out or give it fixed sizes; inside torch
  or a library, it is not the user's to move: state the value or pass inputs oomkit can follow.
- anything else: the exception as raised, at its lines.

User code that exits is said the same way: ``sys.exit`` raises ``SystemExit``, and, while
``os_exit_raises`` is open, ``os._exit`` raises ``OsExit`` (a ``SystemExit``) instead of ending
the process at once with the user's code and no word from oomkit.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass

from oomkit.errors import UnsupportedOpError
from oomkit.prediction.tracing.stand_ins import (
    is_hidden_file,
    is_library_file,
    is_torch_plumbing,
    shown_path,
)

__all__ = [
    "FailureSite",
    "OsExit",
    "exit_call",
    "failure_site",
    "failure_text",
    "os_exit_raises",
    "reads_device_values",
    "step_failure",
]

# What torch says when values leave the meta device: a copy (_to_copy's meta kernel) and
# Tensor.numpy (torch/csrc/utils/tensor_numpy.cpp tensor_to_numpy).
# What TORCH_CHECK and torch._check* raise when an op refuses its arguments, exactly these
# classes (c10/util/Exception.h: Error -> RuntimeError, IndexError, ValueError, TypeError).
_ARGUMENT_CHECKS = (RuntimeError, IndexError, ValueError, TypeError)
_DEVICE_MOVES = ("Cannot copy out of meta tensor", "can't convert meta device type tensor to numpy")


# What a CPU build of torch says when code reaches CUDA that the emulated GPU does not answer
# (cuda_bindings.py lists what it does): a missing torch._C binding (torch/cuda/__init__.py
# ExternalStream: _cuda_getCurrentStream), a dummy class (torch._utils _dummy_type: CUDAGraph,
# MemPool).
_CUDA_ONLY = (
    "module 'torch._C' has no attribute '_cuda",
    "Tried to instantiate dummy base class",
    "requires CUDA support",
)


# What torch says when a CPU tensor meets a meta one in an op: the meta kernels' device check
# (torch/_prims_common/__init__.py check_same_device, torch/_meta_registrations.py) and the
# dispatcher's (aten/src/ATen/TensorIterator.cpp, "Expected all tensors to be on the same
# device").
_HOST_MEETS_DEVICE = (
    "Tensor on device cpu is not on the expected device meta",
    "Tensor on device meta is not on the expected device cpu",
    "but found at least two devices, meta and cpu",
    "but found at least two devices, cpu and meta",
)


# Training libraries whose own engine oomkit does not run, with what to do instead: a failure
# anywhere inside one is said as that, not as the library's internal error.
_NOT_MODELLED: dict[str, str] = {
    "deepspeed": (
        "DeepSpeed's engine is not modelled: deepspeed.initialize builds CUDA kernels of its own "
        "(fused Adam, JIT-compiled with the CUDA toolkit) and keeps ZeRO's partitions in flat "
        "buffers of its own, neither of which runs without a GPU. FSDP2 shards as ZeRO-3 does "
        "(parameters, gradients and optimizer state over the ranks): write the step with "
        "torch's fully_shard and predict it with --world-size N (a script) or --fsdp N (a "
        "builder). ZeRO-1 shards the optimizer state and ZeRO-2 the gradients too, both keeping "
        "whole parameters: between --dp N and --fsdp N"
    ),
    # Its 8-bit optimizers run (their kernels have fake implementations); its 4-bit layers
    # quantize their weights in Params4bit.to("cuda"), which here moves them to meta unquantized.
    "bitsandbytes/nn": (
        "bitsandbytes' 4-bit layers (load_in_4bit, Params4bit) are not run by oomkit: they "
        "quantize their weights when moved to a CUDA device, and oomkit's CUDA tensors are "
        "meta tensors, which hold no values to quantize. Predict QLoRA with oomkit's emulation "
        "of their storage instead: `oomkit predict --hf MODEL --lora R --quantize nf4 "
        "[--double-quant]` (a preset takes the same flags)"
    ),
}


def _not_modelled_library(exc: BaseException) -> str | None:
    """What to say when ``exc`` came from inside a library of ``_NOT_MODELLED``."""
    tb = exc.__traceback__
    while tb is not None:
        folder = "/" + tb.tb_frame.f_code.co_filename.replace("\\", "/").rsplit("/", 1)[0] + "/"
        for name, said in _NOT_MODELLED.items():
            if f"/{name}/" in folder:
                return said
        tb = tb.tb_next
    return None


def _missing_weights(exc: BaseException) -> bool:
    """transformers' from_pretrained finding no weight files for a model whose config it
    read (modeling_utils.py ``_get_resolved_checkpoint_files``: "no file named
    model.safetensors, or pytorch_model.bin, found in directory ...")."""
    if not isinstance(exc, OSError) or "no file named" not in str(exc):
        return False
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if filename.endswith("transformers/modeling_utils.py"):
            return True
        tb = tb.tb_next
    return False


def reads_device_values(exc: BaseException) -> bool:
    """Whether ``exc`` is torch refusing to hand out a meta tensor's values (``.numpy()``)."""
    return any(marker in str(exc) for marker in _DEVICE_MOVES)


@dataclass(frozen=True)
class FailureSite:
    """Where an exception was raised: the user's line and the library line below it.

    Attributes:
        user: ``path/file.py:42 in step``: the innermost frame of the user's own code.
        library: the innermost frame outside oomkit and the standard library when that is
            library code (torch, transformers); ``None`` when the user's line raised itself.
        key: ``file.py:42`` of the library frame, else of the user's (how ``--value`` names it).
    """

    user: str | None
    library: str | None
    key: str | None


def _where(frame: types.FrameType, line: int) -> str:
    return f"{shown_path(frame.f_code.co_filename)}:{line} in {frame.f_code.co_name}"


def failure_site(exc: BaseException) -> FailureSite:
    """The user's and the library's lines of ``exc``'s traceback."""
    user = library = key = None
    tb = exc.__traceback__
    while tb is not None:
        frame, line = tb.tb_frame, tb.tb_lineno
        filename = frame.f_code.co_filename
        if not (is_hidden_file(filename) or is_torch_plumbing(filename)):
            base = filename.replace("\\", "/").rsplit("/", 1)[-1]
            if is_library_file(filename):
                library, key = _where(frame, line), f"{base}:{line}"
            else:
                user, library, key = _where(frame, line), None, f"{base}:{line}"
        tb = tb.tb_next
    return FailureSite(user, library, key)


def _what(exc: BaseException) -> str:
    """``ValueError: message``; without a message (a bare ``assert``), the line that raised it:
    ``AssertionError (assert steps % world == 0)``, as Python's own traceback would show it."""
    said = str(exc).strip()
    if said:
        return f"{type(exc).__name__}: {said}"
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    line = "" if tb is None else linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
    line = line.strip()
    if not line:
        return type(exc).__name__
    return f"{type(exc).__name__} ({line if len(line) <= 200 else line[:199] + '…'})"


def failure_text(exc: BaseException, failed_op: str | None = None) -> str:
    """Where ``exc`` stopped the step, what it was, and the advice that fits (module docstring).

    Args:
        exc: what the step raised.
        failed_op: the aten op that raised it on the meta device, if one did; without one, an
            exception whose message mentions the meta device gets the same advice (torch has no
            exception type for "this needs values"; the text is the only sign).
    """
    site = failure_site(exc)
    at = f"at {site.user or 'a line oomkit could not find'}"
    if site.library is not None:
        at += f" (inside {site.library})"
    where = f"the step failed {at}"
    text = _what(exc)
    library = _not_modelled_library(exc)
    if library is not None:
        return f"the step raised {text}, {at}. {library}"
    if reads_device_values(exc):
        return (
            f"{where}: a device move that reads values ({text}). Tensors on the traced GPU "
            "live on the meta device, which holds no values: .to('cuda') and .cpu() work, but "
            "reading what a copy holds (.numpy(), data copied to the CPU and used there) does "
            "not. Keep the step's tensors on the device. To log a value, .item() is enough: it "
            "gets a stand-in"
        )
    if any(marker in str(exc) for marker in _HOST_MEETS_DEVICE):
        return (
            f"{where}: a tensor on the CPU met the step's tensors, which are on the traced GPU "
            f"(the meta device) ({text}). A model, its optimizer or an input was built on the "
            "CPU before the trace and used by the step (a `model = Net()` outside it). Build "
            "it under `with torch.device('meta'):`, or predict a builder or your script "
            "(`oomkit predict file.py:function`, `oomkit predict train.py`), where "
            "`.to('cuda')` puts it on the traced GPU"
        )
    if any(marker in str(exc) for marker in _CUDA_ONLY):
        return (
            f"the step raised {text}, {at}: a CUDA API that oomkit's emulated GPU does not "
            "answer (CUDA graphs, memory pools and raw allocations are not modelled; side "
            "streams, the memory counters, empty_cache, the memory fraction, snapshots and "
            "NVTX are). Predict the step without that call, or measure it on a GPU with "
            "`oomkit run`"
        )
    if _missing_weights(exc):
        return (
            f"the step raised {text}, {at}. oomkit runs from_pretrained as written, so the "
            "checkpoint's weight files must be on this machine (their values are not needed, "
            "but transformers reads them). To predict the model from its config.json alone: "
            "`oomkit predict --hf DIR` with the script's batch and lengths"
        )
    if failed_op is None and "meta" not in str(exc).lower():
        return f"the step raised {text}, {at}"
    if type(exc) in _ARGUMENT_CHECKS and "meta" not in str(exc).lower():
        # An op that refused its arguments without naming the meta device (a shape or dtype
        # check, which meta kernels run as CUDA's do): the step's own error, not a value read.
        # (A fake tensor's data-dependent refusals are RuntimeError's subclasses: not these.)
        return (
            f"the step raised {text}, {at}, in {failed_op}: the op refused its arguments, "
            "which it checks on the meta device as on the GPU (shapes, dtypes, sizes), so a "
            "GPU run would raise it too. Fix it in the step"
        )
    op = f"{failed_op} " if failed_op else ""
    if site.library is not None:
        advice = (
            "This read of tensor values is inside a library, not yours to move: pass it "
            "inputs whose values oomkit can follow (masks made with torch.ones / torch.full / "
            "torch.triu in the builder or the step, not random or loaded), or predict without "
            "the feature that reads them"
        )
    else:
        advice = (
            "Move data-dependent code (.item() used as a size, nonzero, boolean-mask indexing) "
            "out of the step or give it fixed sizes; a value that is only logged may be read "
            "with .item() (it gets a stand-in)"
        )
    return (
        f"{where}: {op}cannot run on the meta device ({text}): its result depends on tensor "
        f"values, which meta tensors do not have. {advice}"
    )


def step_failure(exc: BaseException, failed_op: str | None) -> UnsupportedOpError:
    """An ``UnsupportedOpError`` saying where ``exc`` stopped the step and what to do.

    Args:
        exc: what the step raised.
        failed_op: the aten op that raised it on the meta device, if one did.
    """
    return UnsupportedOpError(failure_text(exc, failed_op))


class OsExit(SystemExit):
    """``os._exit(code)`` called by the user's code while ``os_exit_raises`` was open."""


def exit_call(exc: SystemExit) -> str:
    """How the user's code exited, as written: ``sys.exit(3)``, ``sys.exit()``, ``os._exit(7)``."""
    name = "os._exit" if isinstance(exc, OsExit) else "sys.exit"
    return f"{name}()" if exc.code is None else f"{name}({exc.code!r})"


@contextlib.contextmanager
def os_exit_raises() -> Iterator[None]:
    """``os._exit`` raises ``OsExit`` while open, on this thread of this process; a forked child
    (a DataLoader worker, which leaves through ``os._exit``) and other threads keep the real one."""
    real = os._exit
    pid, thread = os.getpid(), threading.get_ident()

    def raising(code: int) -> None:
        if os.getpid() != pid or threading.get_ident() != thread:
            real(code)
        raise OsExit(code)

    setattr(os, "_exit", raising)  # noqa: B010 - os._exit is typed NoReturn
    try:
        yield
    finally:
        setattr(os, "_exit", real)  # noqa: B010
