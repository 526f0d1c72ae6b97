"""``trace_step``: run a step a few times under a ``Tracer`` on the meta device, and check it.

The step runs with ``torch.device("meta")`` as the default device (as ``oomkit predict
file.py:function`` runs it), so tensors it creates without ``device=`` cost nothing and hold no
values, on one emulated CUDA GPU, the target (``cuda_device.as_one_cuda_gpu``): ``device="cuda"``,
``.to("cuda")`` and ``.cuda()`` land on meta, and ``torch.cuda`` answers as the target would. A model passed in with its parameters on the CPU is refused, and so, when asked
(``oomkit.predict`` asks), is a step that records no device allocation at all: either would have
run for real on the CPU and predicted nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace.step_count import check_step_count
from oomkit.errors import EmptyRecordingError, OomkitError
from oomkit.prediction.tracing.cpu_inputs import cpu_inputs_refused
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu
from oomkit.prediction.tracing.cuda_streams import current_stream_id
from oomkit.prediction.tracing.emulation import OpEmulation
from oomkit.prediction.tracing.recorder import Tracer
from oomkit.prediction.tracing.recording import TraceRecording
from oomkit.prediction.tracing.step_failure import reads_device_values, step_failure
from oomkit.prediction.tracing.storages import tensors_of

__all__ = ["trace_step"]

_BUILD_ON_META = (
    "Build the model, optimizer and inputs under `with torch.device('meta'):` (or pass "
    "device='meta'), then predict: on the meta device tensors cost nothing and oomkit records "
    "what each would allocate on the GPU"
)


def trace_step(
    fn: Callable[..., Any],
    *args: Any,
    steps: int = 1,
    gpu: GpuSpec | None = None,
    emulations: Mapping[str, OpEmulation] | None = None,
    target: Target | None = None,
    values: Mapping[str, Any] | None = None,
    require_allocations: bool = False,
    compile: bool = False,
    **kwargs: Any,
) -> TraceRecording:
    """Run ``fn(*args, **kwargs)`` ``steps`` times on meta tensors and record its allocations.

    Modules, optimizers and tensors in ``args``/``kwargs`` are tracked first, so a model built
    earlier under ``torch.device("meta")`` shows up as allocated before step 0. ``fn``'s return
    value is dropped at once, so what it returns is freed inside its step. ``fn`` runs under
    ``torch.device("meta")``.

    Args:
        fn: one training or inference step; must work on meta tensors.
        args: passed to ``fn``.
        steps: how many times to run ``fn``; use 3 to see optimizer state created in the first
            step and the steady state after it.
        gpu: the target device the CUDA emulations model; ``None`` means an H100 SXM.
        emulations: per-op hooks; ``None`` means ``DEFAULT_EMULATIONS``.
        target: the target machine, instead of ``gpu``: its GPU, and its cuDNN and torch
            versions when stated (``emulations_for``: passed explicitly, not through
            ``use_sdpa_settings``).
        values: tensor values the step reads, by the line that reads them
            (``{"train.py:42": 1024}``); other reads are answered or stood in for
            (``value_reads``).
        require_allocations: refuse a first step that records no device allocation
            (``oomkit.predict`` does: such a step ran elsewhere, for real).
        compile: record code the step compiles with ``torch.compile`` as compiled (real
            dynamo and AOTAutograd partitioner, Inductor's fusion and buffer reuse emulated)
            rather than eagerly.
        kwargs: passed to ``fn``.

    Returns:
        The recording, with ``step_starts`` marking each call of ``fn``.

    Raises:
        ConfigError: ``steps`` is not a whole number from 1 to ``MAX_RECORDED_STEPS``, or
            a stated value is malformed.
        UserCodeError: a model on the traced GPU is given a CPU tensor (CUDA's device check;
            ``cpu_inputs``), naming the line that chose the CPU when one did.
        EmptyRecordingError: a module passed in has parameters off the meta device, or (with
            ``require_allocations``) the first step recorded no device allocation.
        UnsupportedOpError: an op cannot run on the meta device (it reads tensor values, has
            no meta kernel, or moves a tensor to another device); the message names the
            user's line and the library line.
        DataDependentValueError: a tensor value oomkit cannot know is used as a size, a loop
            bound or a condition.
    """
    check_step_count(steps, "trace_step(fn, steps=3)")
    if target is not None:
        gpu = target.gpu
        if emulations is None:
            from oomkit.prediction.tracing.emulations import emulations_for

            emulations = emulations_for(target.cudnn_version, target.torch_version)
    _refuse_host_modules((args, kwargs))
    tracer = Tracer(emulations=emulations, gpu=gpu, values=values, compile=compile, target=target)
    tracer.current_stream = current_stream_id  # the script's own streams (cuda_streams.py)
    try:
        cuda_version = None if target is None else target.cuda_version
        cudnn_version = None if target is None else target.cudnn_version
        with (
            tracer,
            torch.device("meta"),
            as_one_cuda_gpu(tracer.gpu, cuda_version=cuda_version, cudnn_version=cudnn_version),
            cpu_inputs_refused(),
        ):
            tracer.track(args, kwargs)
            for step in range(steps):
                tracer.mark_step()
                fn(*args, **kwargs)
                if step == 0 and require_allocations and not tracer.allocated_anything:
                    raise EmptyRecordingError(
                        "the step allocated nothing on the meta device, so there is nothing to "
                        "predict: its tensors live elsewhere (made with device='cpu' or 'cuda', "
                        f"or passed in from outside), and it ran there for real. {_BUILD_ON_META}"
                    )
    except OomkitError:
        raise
    except Exception as exc:
        failed = tracer.failed_op
        if failed is not None and failed[1] is exc:
            raise step_failure(exc, failed[0]) from exc
        if reads_device_values(exc):
            raise step_failure(exc, None) from exc
        raise
    return tracer.recording


def _refuse_host_modules(objects: Any) -> None:
    """A module whose parameters are on the CPU would train there, for real, and record nothing."""
    off_meta = [
        t
        for t in tensors_of(objects if isinstance(objects, tuple) else (objects,))
        if isinstance(t, torch.nn.Parameter) and t.device.type != "meta"
    ]
    if off_meta:
        devices = sorted({t.device.type for t in off_meta})
        nbytes = sum(t.numel() * t.element_size() for t in off_meta)
        raise EmptyRecordingError(
            f"{len(off_meta)} parameter(s) passed in ({nbytes} bytes) are on "
            f"{', '.join(devices)}, not on the meta device: the step would run there for real "
            f"and oomkit would record nothing. {_BUILD_ON_META}"
        )
