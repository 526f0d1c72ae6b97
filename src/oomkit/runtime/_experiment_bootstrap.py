"""What ``oomkit experiment`` launches once per allocator setting: the user's script, monitored.

Run as a file, not with ``-m`` (as ``_bootstrap.py``), so that it works with an interpreter where
oomkit is not installed (the parent passes its own package root)::

    python [interpreter options] .../_experiment_bootstrap.py CONFIG.json script.py ARGS...
    python [interpreter options] .../_experiment_bootstrap.py CONFIG.json -m module ARGS...

The parent sets ``PYTORCH_CUDA_ALLOC_CONF`` in this process's environment before torch is
imported, so the CUDA caching allocator reads the candidate setting. The script runs as
``python script.py ARGS`` would, inside ``Monitor(auto_step=True, log_path=CONFIG["log_path"])``:
every optimizer step of the unmodified script is one monitor step, a line of the JSONL log. After
``CONFIG["steps"]`` steps the script is stopped (an exception the script does not know, raised from
an optimizer-step post hook) and the process exits 0 at once (``os._exit``, so that data-loader
threads the script started cannot keep it alive). The outcome goes to ``CONFIG["result_path"]``
as JSON: ``outcome`` is ``"completed"`` (the steps were reached), ``"finished"`` (the script ended
first), ``"oom"`` (``torch.OutOfMemoryError``, by type), ``"exception"`` or ``"exit"``
(``sys.exit`` with a non-zero code); ``steps`` is how many steps the monitor recorded;
``device_name`` is the name of the GPU the script used (None when it did not initialise CUDA), so
that the parent can tell when parallel trials ran on different GPU models.

Testing only: with ``OOMKIT_RUN_SIMULATED_GPU=<gpu>`` (e.g. ``1GiB``) the script runs inside
``SimulatedCudaDevice(gpu, alloc_conf=$PYTORCH_CUDA_ALLOC_CONF, context_overhead_bytes=0)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

# The same helpers and test-only variable as `oomkit run`'s bootstrap.
from oomkit.runtime._bootstrap import (
    SIMULATED_GPU_ENV,
    simulated_device_from_env,
    user_traceback,
    write_result,
)

__all__ = ["ALLOC_CONF_ENV", "RESULT_FORMAT_VERSION", "SIMULATED_GPU_ENV", "main"]

RESULT_FORMAT_VERSION = 1
# c10/cuda/CUDAAllocatorConfig.cpp reads this variable when the allocator is first used.
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


class _StepLimitReached(BaseException):
    """Raised from the optimizer-step hook once the monitor holds the requested steps.

    A BaseException so that a script's ``except Exception`` does not swallow it.
    """


def _cuda_device_name() -> str | None:
    """``torch.cuda.get_device_name`` of the script's current GPU; None when it used none.

    Asked only when the script initialised CUDA itself (``torch.cuda.is_initialized``), so that
    this never creates a context the script did not.
    """
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - a broken context after an error: no name, no new error
        return None


def main(argv: list[str]) -> int:
    """Run the target named by ``argv`` (``[CONFIG, script, *args]`` or ``[CONFIG, -m, mod, ...]``).

    Returns:
        The exit code: 0, the script's ``sys.exit`` code, or 1 after an uncaught exception.
    """
    config = json.loads(Path(argv[0]).read_text())
    if config.get("oomkit_root") and config["oomkit_root"] not in sys.path:
        sys.path.append(config["oomkit_root"])  # last: the user's own packages win
    module = argv[2] if argv[1] == "-m" else None
    user_args = argv[3:] if module is not None else argv[2:]
    if module is None:
        sys.argv = [argv[1], *user_args]
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))  # as `python script.py` does
    else:
        sys.argv = [module, *user_args]
        sys.path[0] = os.getcwd()

    import torch.optim.optimizer as optim

    from oomkit.runtime.device import is_out_of_memory
    from oomkit.runtime.monitor import Monitor

    steps_wanted = int(config["steps"])
    result: dict[str, Any] = {
        "format_version": RESULT_FORMAT_VERSION,
        "outcome": "finished",
        "exit_code": 0,
        "steps": 0,
        "exception_type": None,
        "message": None,
    }
    monitor: Any = None
    completed = False
    try:
        with contextlib.ExitStack() as stack:
            simulated = simulated_device_from_env()
            if simulated is not None:
                stack.enter_context(simulated)
            monitor = stack.enter_context(Monitor(log_path=config["log_path"], auto_step=True))

            def stop_after_steps(*_: object) -> None:
                # Registered after the monitor's own hook, so it sees this step's record.
                if len(monitor.records) >= steps_wanted:
                    raise _StepLimitReached

            stack.callback(optim.register_optimizer_step_post_hook(stop_after_steps).remove)
            if module is not None:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
    except _StepLimitReached:
        result["outcome"] = "completed"
        completed = True
    except SystemExit as exc:
        code = exc.code
        exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        result["outcome"] = "finished" if exit_code == 0 else "exit"
        result["exit_code"] = exit_code
        raise
    except BaseException as exc:  # noqa: BLE001 - reported as Python would, then exit 1
        oom = is_out_of_memory(exc)
        result["outcome"] = "oom" if oom else "exception"
        result["exit_code"] = 1
        result["exception_type"] = f"{type(exc).__module__}.{type(exc).__qualname__}"
        result["message"] = str(exc.args[0]) if exc.args else str(exc)
        exc.__traceback__ = user_traceback(exc.__traceback__, globals())
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1
    finally:
        if monitor is not None:
            result["steps"] = len(monitor.records)
        result["device_name"] = _cuda_device_name()
        write_result(config["result_path"], result)
    if completed:
        # Exit now: threads the script started (data loaders) must not keep the trial running.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    # sys.path[0] is this file's directory until main() replaces it; nothing from oomkit is
    # imported before that.
    sys.exit(main(sys.argv[1:]))
