"""What ``oomkit run`` launches: the user's script or module under ``oomkit.watch()``.

Run as a file, not with ``-m``, so that it works with an interpreter where oomkit is not
installed (the parent passes its own package root)::

    python [interpreter options] .../oomkit/runtime/_bootstrap.py CONFIG.json script.py ARGS...
    python [interpreter options] .../oomkit/runtime/_bootstrap.py CONFIG.json -m module ARGS...

The script runs as ``python script.py ARGS`` would run it: ``sys.argv`` is ``[script, *ARGS]``,
``sys.path[0]`` is the script's directory, its module is ``__main__``; an uncaught exception
prints its traceback (without this file's frames) through ``sys.excepthook`` and exits 1, and
``sys.exit`` codes pass through. The outcome goes to ``CONFIG["result_path"]`` as JSON for the
parent, which diagnoses the snapshot and prints the report. Where ``import torch`` (or oomkit
itself) fails with ImportError, the script still runs, unwatched, after a one-line note on
stderr, and its own exit code is the result.

Testing only: with ``OOMKIT_RUN_SIMULATED_GPU=<gpu>`` (e.g. ``1GiB``) in the environment the
script runs inside ``SimulatedCudaDevice(gpu, context_overhead_bytes=0)`` so that CPU tensors
are accounted as CUDA memory and ``torch.OutOfMemoryError`` is raised as on that GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "RESULT_FORMAT_VERSION",
    "SIMULATED_GPU_ENV",
    "main",
    "simulated_device_from_env",
    "user_traceback",
    "write_result",
]

RESULT_FORMAT_VERSION = 1
SIMULATED_GPU_ENV = "OOMKIT_RUN_SIMULATED_GPU"


def user_traceback(
    tb: TracebackType | None, bootstrap_globals: dict[str, Any]
) -> TracebackType | None:
    """The traceback from the first frame that is neither the bootstrap's nor runpy's.

    Args:
        tb: the exception's traceback.
        bootstrap_globals: the calling bootstrap's ``globals()`` (it runs as a file, as
            ``__main__``, like the user's script: identity tells them apart).
    """
    # runpy is frozen in 3.11+ (co_filename "<frozen runpy>"): tell frames by their module.
    while tb is not None and (
        tb.tb_frame.f_globals is bootstrap_globals
        or tb.tb_frame.f_globals.get("__name__") == "runpy"
    ):
        tb = tb.tb_next
    return tb


def simulated_device_from_env(**options: Any) -> Any:
    """Testing only: the ``SimulatedCudaDevice`` that ``OOMKIT_RUN_SIMULATED_GPU`` asks for, or None.

    Its allocator setting comes from ``PYTORCH_CUDA_ALLOC_CONF``, read as the CUDA allocator
    reads it (c10/cuda/CUDAAllocatorConfig.cpp); ``options`` go to the device.
    """
    simulated = os.environ.get(SIMULATED_GPU_ENV)
    if not simulated:
        return None
    from oomkit.runtime.simulated import SimulatedCudaDevice

    return SimulatedCudaDevice(
        simulated,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None,
        context_overhead_bytes=0,
        **options,
    )


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write the child's result JSON atomically (the parent never reads half a file)."""
    partial = path + ".partial"
    with open(partial, "w") as out:
        json.dump(result, out)
    os.replace(partial, path)


def _gpu_json(recorder: Any, device: int) -> dict[str, Any] | None:
    try:
        spec = recorder.gpu_spec(device)
    except Exception:  # noqa: BLE001 - the diagnosis works without it
        return None
    if spec is None:
        return None
    return {
        "name": spec.name,
        "total_memory_bytes": spec.total_memory_bytes,
        "context_overhead_bytes": spec.context_overhead_bytes,
    }


def _watch_unavailable() -> str | None:
    """Why the script cannot be watched here (torch or oomkit not importable), or None.

    Only ImportError counts: any other failure of ``import torch`` is the install's, and shows.
    """
    try:
        import torch  # noqa: F401 - recording memory needs it; the script itself may not
    except ImportError as exc:
        return f"torch is not importable by {sys.executable} ({exc})"
    try:
        import oomkit.runtime.watch  # noqa: F401
    except ImportError as exc:
        return (
            f"oomkit cannot be imported by {sys.executable} ({exc}); install oomkit in the "
            "interpreter that runs the script"
        )
    return None


def _is_out_of_memory(exc: BaseException) -> bool:
    from oomkit.runtime.device import is_out_of_memory

    return is_out_of_memory(exc)


def main(argv: list[str]) -> int:
    """Run the target named by ``argv`` (``[CONFIG, script, *args]`` or ``[CONFIG, -m, mod, ...]``).

    Returns:
        The exit code: 0, the script's ``sys.exit`` code, or 1 after an uncaught exception.
    """
    config = json.loads(Path(argv[0]).read_text())
    if config.get("oomkit_root") and config["oomkit_root"] not in sys.path:
        # Last, so that the user's own packages win; only needed where oomkit is not installed.
        sys.path.append(config["oomkit_root"])
    module = argv[2] if argv[1] == "-m" else None
    user_args = argv[3:] if module is not None else argv[2:]
    if module is None:
        script = argv[1]
        sys.argv = [script, *user_args]
        # `python script.py` puts the script's directory first on sys.path.
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    else:
        sys.argv = [module, *user_args]  # run_module(alter_sys=True) sets argv[0] to its file
        sys.path[0] = os.getcwd()

    unwatched = _watch_unavailable()
    if unwatched is not None:
        # The script may not need torch (or oomkit's own dependencies): run it as plain Python
        # would, and say once, before its output, why memory is not recorded.
        sys.stderr.write(f"oomkit: {unwatched}; running the script without memory recording.\n")
        sys.stderr.flush()

    result: dict[str, Any] = {
        "format_version": RESULT_FORMAT_VERSION,
        "outcome": "ok",
        "exit_code": 0,
        "recording": False,
        "oom": False,
        "message": None,
        "exception_type": None,
        "snapshot_path": None,
        "observed_ooms": [],
        "error": None,
        "gpu": None,
        "unwatched_reason": unwatched,
    }
    watcher: Any = None
    recorder = None
    try:
        with contextlib.ExitStack() as stack:
            if unwatched is None:
                from oomkit.runtime.watch import Watch, default_recorder

                simulated = simulated_device_from_env(
                    record_history=True, max_entries=config["max_entries"]
                )
                if simulated is not None:
                    stack.enter_context(simulated)
                recorder = default_recorder()
            if recorder is not None:  # without a GPU the script just runs; the parent says so
                watcher = Watch(
                    config["snapshot_dir"], config["max_entries"], diagnose=False, recorder=recorder
                )
                stack.enter_context(watcher)
                result["recording"] = True
            if module is not None:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        result["outcome"] = "exit"
        result["exit_code"] = code if isinstance(code, int) else (0 if code is None else 1)
        raise
    except KeyboardInterrupt:
        result["outcome"] = "interrupted"
        result["exit_code"] = 130
        raise
    except BaseException as exc:  # noqa: BLE001 - reported as Python would, then exit 1
        result["outcome"] = "exception"
        result["exit_code"] = 1
        result["exception_type"] = f"{type(exc).__module__}.{type(exc).__qualname__}"
        result["oom"] = unwatched is None and _is_out_of_memory(exc)
        result["message"] = str(exc.args[0]) if exc.args else str(exc)
        # The default hook prints exc.__traceback__ whatever tb it is given: trim that.
        exc.__traceback__ = user_traceback(exc.__traceback__, globals())
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1
    finally:
        if watcher is not None:
            result["snapshot_path"] = (
                None if watcher.snapshot_path is None else str(watcher.snapshot_path)
            )
            result["error"] = watcher.error
            result["observed_ooms"] = [
                {
                    "device": o.device,
                    "requested_bytes": o.requested_bytes,
                    "device_limit_bytes": o.device_limit_bytes,
                    "device_free_bytes": o.device_free_bytes,
                }
                for o in watcher.ooms
            ]
            if watcher.ooms and recorder is not None:
                result["gpu"] = _gpu_json(recorder, watcher.ooms[-1].device)
        write_result(config["result_path"], result)
    return 0


if __name__ == "__main__":
    # sys.path[0] is this file's directory until main() replaces it; nothing from oomkit is
    # imported before that.
    sys.exit(main(sys.argv[1:]))
