"""Loading the user's own step for ``oomkit predict path/to/file.py:function`` (``model.function``).

The contract (documented in the README, "Predicting your own step"):

- ``function`` is a module-level callable in ``file.py``; the file is loaded from its path with
  importlib (its folder is put first on ``sys.path`` while it loads, so sibling imports work).
- It may declare any of the keyword parameters ``batch_size``, ``seq_len``, ``image_size`` and
  ``device``; oomkit passes those it declares (``device`` is ``torch.device("meta")``; the
  sizes come from ``--batch``, ``--seq`` and ``--image-size``). A declared size without a default
  must be given on the command line. Other parameters must have defaults.
- It runs inside ``with torch.device("meta"):``, so tensors and modules it creates without a
  device land on the meta device and cost nothing.
- It returns either a zero-argument callable that runs one step, or a pair
  ``(step_fn, objects_to_track)`` where ``objects_to_track`` are the model, optimizer and inputs
  (nested lists/tuples/dicts are fine) to be recorded as allocated before the first step, or a
  trainer: ``(lightning_trainer, module[, data])`` or a ``transformers.Trainer``, run one
  optimizer step per step (``oomkit.prediction.tracing.trainers``).
- The file's import, the builder and the step run on one emulated CUDA GPU, the target
  (``tracing.cuda_device``): ``device = "cuda" if torch.cuda.is_available() else "cpu"`` picks
  CUDA, trainers pick CUDA, and CUDA tensors land on meta.
- User code that exits (``sys.exit``, ``os._exit``) or raises, at import, in the builder or in
  the step, is a ``UserCodeError`` naming the file, the line and the exit code or the
  exception; a step that calls ``trainer.fit`` / ``trainer.train`` itself is refused with the
  trainer contract.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import inspect
import re
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomkit.errors import OomkitError, UserCodeError

__all__ = ["UserStep", "is_user_target", "load_user_step", "SIZE_PARAMETERS"]

# Keyword parameters a user function may declare, with the flag that fills each.
SIZE_PARAMETERS = {"batch_size": "--batch", "seq_len": "--seq", "image_size": "--image-size"}


@dataclass(frozen=True)
class UserStep:
    """What a user function built: the step and the objects that exist before it.

    Attributes:
        step_fn: runs one step under ``torch.device("meta")``.
        track: objects recorded as allocated before the first step.
        description: ``file.py:function(batch_size=8)``.
        raised: the exceptions the user's step raised (so a caller can tell them from oomkit's).
        arguments: the size arguments the function was called with (``{"batch_size": 8}``).
    """

    step_fn: Callable[[], Any]
    track: tuple[Any, ...]
    description: str
    raised: list[BaseException] = field(default_factory=list)
    arguments: Mapping[str, int] = field(default_factory=dict)


def is_user_target(target: str) -> bool:
    """Whether ``target`` names ``file.py:function`` rather than a preset."""
    path, sep, function = target.rpartition(":")
    return bool(sep) and path.endswith(".py") and bool(function)


def _exit_text(exc: SystemExit, stage: str, target: str) -> str:
    """``sys.exit(...)`` in the user's code, said as the user's failure: where and with what."""
    from oomkit.prediction.tracing.step_failure import exit_call, failure_site

    site = failure_site(exc).user or "a line oomkit could not find"
    said = exit_call(exc)
    return (
        f"{target}: {stage} called {said} at {site}, so there is no step to predict. "
        "Keep exits under `if __name__ == '__main__':` (oomkit imports the file and calls the "
        "function; it does not run the file as a script)."
    )


class _SourceOnly(importlib.machinery.SourceFileLoader):
    """The file's source as it is now: no ``__pycache__`` read or written beside it (a bytecode
    cache keyed by mtime and size serves a file rewritten within the same second at the same
    size stale, and writing one puts files in the user's folder)."""

    def get_code(self, fullname: str) -> Any:
        return self.source_to_code(self.get_data(self.path), self.path)


@contextlib.contextmanager
def _file_argv(path_text: str) -> Iterator[None]:
    """``sys.argv`` as ``python file.py`` sets it while the user's code runs, so a ``main()``
    that parses its arguments reads its own defaults, not oomkit's command line."""
    saved = sys.argv
    sys.argv = [path_text]
    try:
        yield
    finally:
        sys.argv = saved


def _script_route(path_text: str, name: str) -> str:
    """A hint for a function that failed: where the file calls it under ``if __name__ ==
    '__main__':`` it is likely the training loop itself, which the script route records."""
    try:
        source = Path(path_text).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    guard = re.search(r"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:(.*)""", source, re.M | re.S)
    if guard is None or not re.search(rf"\b{re.escape(name)}\s*\(", guard.group(1)):
        return ""
    return (
        f" {name}() is what `python {path_text}` runs: if it is your training loop, predict the "
        f"file as a script (`oomkit predict {path_text} -- ARGS` runs it as python does and "
        "records its first steps)."
    )


def _load_module(path: Path, target: str) -> Any:
    if not path.is_file():
        raise UserCodeError(
            f"{target}: no such file {str(path)!r}. Give the path of a Python file, relative to "
            f"{Path.cwd()}, then ':' and the function name, e.g. train.py:build_step."
        )
    name = f"oomkit_user_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path, loader=_SourceOnly(name, str(path)))
    if spec is None or spec.loader is None:
        raise UserCodeError(f"{target}: {path} cannot be loaded as a Python module.")
    module = importlib.util.module_from_spec(spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    from oomkit._logs import TORCHAO_IMPORT_LOGGERS, quiet_loggers
    from oomkit.prediction.tracing.step_failure import os_exit_raises

    try:
        # Its imports' torchao "Failed to load ..._C_*.so" is this CPU machine's, not the GPU's.
        with os_exit_raises(), quiet_loggers(*TORCHAO_IMPORT_LOGGERS):
            spec.loader.exec_module(module)
    except SystemExit as exc:
        raise UserCodeError(_exit_text(exc, f"importing {path}", target)) from exc
    except Exception as exc:
        raise UserCodeError(
            f"{target}: importing {path} raised {type(exc).__name__}: {exc}. Fix the file so "
            f"that `python {path}` imports cleanly."
        ) from exc
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    return module


def _arguments(
    fn: Callable[..., Any],
    target: str,
    sizes: dict[str, int | None],
    device: Any,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = {}
    for name, flag in SIZE_PARAMETERS.items():
        param = params.get(name)
        value = sizes.get(name)
        if param is None:
            if takes_any and value is not None:
                kwargs[name] = value
            elif value is not None:  # given, but the function would never see it
                declared = ", ".join(params) or "none"
                raise UserCodeError(
                    f"{target}: the function has no {name} parameter (its parameters: "
                    f"{declared}), so {flag} {value} would change nothing. Add a {name} "
                    f"parameter to the function, or drop {flag}."
                )
            continue
        if value is None:
            if param.default is inspect.Parameter.empty:
                raise UserCodeError(
                    f"{target}: the function needs {name}; pass it with {flag} N."
                )
            continue
        kwargs[name] = value
    if "device" in params or takes_any:
        kwargs["device"] = device
    for name, value in extra.items():
        if name in params or takes_any:
            kwargs[name] = value
    for name, param in params.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name not in kwargs and param.default is inspect.Parameter.empty:
            raise UserCodeError(
                f"{target}: the function has a parameter {name!r} without a default that oomkit "
                f"cannot fill; it passes only {', '.join([*SIZE_PARAMETERS, 'device', *extra])}. Give "
                f"{name!r} a default."
            )
    return kwargs


def load_user_step(
    target: str,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    image_size: int | None = None,
    device: Any = None,
    extra: Mapping[str, Any] | None = None,
    gpu: Any = None,
) -> UserStep:
    """Load ``file.py:function``, call it on the meta device, and return the step it built.

    Args:
        target: ``path/to/file.py:function``.
        batch_size: ``--batch``, passed when the function declares ``batch_size``.
        seq_len: ``--seq``, passed when the function declares ``seq_len``.
        image_size: ``--image-size``, passed when the function declares ``image_size``.
        device: the default device while it runs; ``None`` is ``torch.device("meta")``.
        extra: more keyword arguments, passed where declared (``--fsdp``: ``mesh``,
            ``world_size``).
        gpu: the target ``GpuSpec`` that ``torch.cuda`` reports while the file imports and the
            builder runs (``is_bf16_supported``, ``get_device_properties``); ``None`` is an
            H100 SXM. Pass the same GPU as the prediction's target.

    Returns:
        The step, the objects to track, and a description (``file.py:function(batch_size=8)``).

    Raises:
        UserCodeError: the file or function is missing, the function needs an argument oomkit
            cannot give, it raises or exits (``sys.exit``, at import too), or it returns
            something other than the contract allows. The step's own exits, and its calls of
            ``trainer.fit`` / ``trainer.train``, raise it when the step runs.
        TorchRequiredError: torch is not installed.
    """
    from oomkit.errors import TorchRequiredError

    try:
        import torch
    except ImportError as exc:
        raise TorchRequiredError(
            "oomkit predict runs your code on the meta device and needs torch; install it with "
            "`pip install oomkit[torch]`"
        ) from exc
    from oomkit.prediction.tracing import cuda_autocast_construction
    from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu
    from oomkit.prediction.tracing.data_loaders import loaders_on_the_host
    from oomkit.prediction.tracing.process_settings import made_again, settings_kept
    from oomkit.prediction.tracing.step_failure import os_exit_raises
    from oomkit.prediction.tracing.torch_globals import UsersGlobals
    from oomkit.prediction.tracing.trainers import trainer_step

    path_text, _, name = target.rpartition(":")
    # The file and the builder run as on a CUDA machine: an autocast("cuda") they build once and
    # the step reuses (nanoGPT's ctx) is built enabled, not disabled for want of a GPU.
    # The file runs on the emulated GPU too: `device = "cuda" if torch.cuda.is_available() else
    # "cpu"` at module level picks CUDA, as on the GPU it is meant for.
    # torch's process-wide settings the file and its builder set (a default dtype) carry to its
    # steps, as in its own process, and are the caller's again between them (torch_globals.py).
    users = UsersGlobals()
    # Its memory fraction and allocator settings hold for its steps (process_settings.py).
    with users.running(), cuda_autocast_construction(), as_one_cuda_gpu(gpu):
        with _file_argv(path_text), settings_kept() as at_import:
            module = _load_module(Path(path_text), target)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        found = sorted(
            n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
        )
        raise UserCodeError(
            f"{target}: {path_text} has no function {name!r}. Functions there: "
            f"{', '.join(found) or 'none'}."
        )
    device = torch.device("meta") if device is None else device
    sizes = {"batch_size": batch_size, "seq_len": seq_len, "image_size": image_size}
    kwargs = _arguments(fn, target, sizes, device, extra or {})
    try:
        # One emulated CUDA GPU: a Lightning or Hugging Face trainer built here picks CUDA.
        # A DataLoader's seeds on the host, its workers in this process (data_loaders.py).
        with users.running(), device, cuda_autocast_construction(), as_one_cuda_gpu(gpu):
            with _file_argv(path_text), os_exit_raises(), loaders_on_the_host():
                with _optimizer_steps_counted() as builder_steps, settings_kept() as in_builder:
                    result = fn(**kwargs)
    except OomkitError as exc:
        raise type(exc)(f"{target}: {name}(): {exc}{_script_route(path_text, name)}") from exc
    except SystemExit as exc:
        said = _exit_text(exc, f"{name}()", target)
        raise UserCodeError(said + _script_route(path_text, name)) from exc
    except Exception as exc:
        from oomkit.prediction.tracing.step_failure import failure_text

        detail = failure_text(exc)
        for said in ("the step failed", "the step raised"):
            detail = detail.replace(said, f"{name}() {said.split()[-1]}", 1)
        raise UserCodeError(f"{target}: {detail}{_script_route(path_text, name)}") from exc
    trainer = trainer_step(result, target)
    if trainer is None and result is None and builder_steps[0]:
        raise UserCodeError(
            f"{target}: {name}() ran {builder_steps[0]} optimizer step(s) itself and returned "
            "None: it is a training loop, not a builder. Predict the file as a script "
            f"(`oomkit predict {path_text}`, runs it as python does and records its first "
            "steps), or return the step instead of running it."
        )
    user_step, track = (trainer.step_fn, trainer.track) if trainer else _unpack(result, target, name)
    # The contract: a step runs with meta as the default device. A trainer's loop keeps its
    # CPU-side work (samplers, seeds) on the CPU, as on a GPU machine (trainers.py).
    step_device = contextlib.nullcontext() if trainer else device
    # A step that runs a trainer's whole loop itself is refused with the contract; a trainer
    # returned by the builder runs its loop through trainer_step.
    refused = contextlib.nullcontext() if trainer else _trainer_loops_refused(target)
    raised: list[BaseException] = []
    kept, done = [*at_import, *in_builder], weakref.WeakSet[Any]()

    def step_fn() -> Any:
        # A trainer's loader works on CPU tensors: its workers run as on the GPU machine.
        loaders = contextlib.nullcontext() if trainer else loaders_on_the_host()
        try:
            with users.running(), step_device, refused, os_exit_raises():
                with _file_argv(path_text), loaders:
                    made_again(kept, done)
                    return user_step()
        except SystemExit as exc:
            error = UserCodeError(_exit_text(exc, "the step", target))
            raised.append(error)
            raise error from exc
        except Exception as exc:
            raised.append(exc)
            raise

    arguments = {k: v for k, v in kwargs.items() if k in SIZE_PARAMETERS}
    shown = ", ".join(f"{k}={v}" for k, v in arguments.items())
    description = f"{target}({shown})" + (f" [{trainer.summary}]" if trainer else "")
    return UserStep(step_fn, track, description, raised, arguments)


@contextlib.contextmanager
def _optimizer_steps_counted() -> Any:
    """Counts ``torch.optim`` steps while open (a builder that trains is a script)."""
    import torch.optim.optimizer as optimizer_hooks

    count = [0]

    def counted(*args: Any) -> None:
        count[0] += 1

    handle = optimizer_hooks.register_optimizer_step_post_hook(counted)
    try:
        yield count
    finally:
        handle.remove()


_TRAINER_CONTRACT = (
    "return the trainer from the builder instead of running it in the step: "
    "(lightning_trainer, module[, datamodule_or_dataloader]) or the transformers.Trainer; oomkit "
    "runs one optimizer step of it per step"
)


class _TrainerLoopsRefused:
    """While open, ``Trainer.fit`` (Lightning) and ``Trainer.train`` (Hugging Face) refuse to
    run, saying the trainer contract: a step calling them would run a whole training loop."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._saved: list[tuple[type, str, Any]] = []

    def __enter__(self) -> None:
        found = [
            (getattr(sys.modules.get(package), "Trainer", None), "fit", "Lightning's trainer.fit()")
            for package in ("lightning.pytorch", "pytorch_lightning")
        ]
        hf = sys.modules.get("transformers.trainer")
        found.append((getattr(hf, "Trainer", None), "train", "the transformers trainer.train()"))
        for cls, method, said in found:
            if isinstance(cls, type) and method in vars(cls):
                self._saved.append((cls, method, vars(cls)[method]))
                setattr(cls, method, self._refusal(said))

    def _refusal(self, said: str) -> Callable[..., Any]:
        target = self._target

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise UserCodeError(f"{target}: the step called {said}; {_TRAINER_CONTRACT}.")

        return refuse

    def __exit__(self, *exc_info: object) -> None:
        for cls, method, original in reversed(self._saved):
            setattr(cls, method, original)
        self._saved.clear()


def _trainer_loops_refused(target: str) -> _TrainerLoopsRefused:
    return _TrainerLoopsRefused(target)


def _unpack(result: Any, target: str, name: str) -> tuple[Callable[[], Any], tuple[Any, ...]]:
    if callable(result):
        return result, ()
    if isinstance(result, (tuple, list)) and len(result) == 2 and callable(result[0]):
        track = result[1]
        if isinstance(track, (tuple, list)):
            return result[0], tuple(track)
        return result[0], (track,)
    raise UserCodeError(
        f"{target}: {name}() returned {type(result).__name__}; it must return a zero-argument "
        "step function, (step_fn, objects_to_track) with the model, optimizer and inputs, or a "
        "trainer: (lightning_trainer, module[, datamodule_or_dataloader]) or a "
        "transformers.Trainer."
    )
