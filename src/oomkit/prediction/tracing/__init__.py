"""Record a PyTorch step on the meta device as an allocation trace, with no GPU.

``trace_step(fn, *args, steps=1)`` runs ``fn`` with meta tensors and returns a
``TraceRecording`` of ``oomkit.core.trace.TraceEvent`` allocations and frees, each tagged with its
category, phase, module path and aten op. ``Tracer`` is the context manager underneath.
"""

from __future__ import annotations

# First: an unsupported torch fails here with what to do, not deep inside a trace.
from oomkit.prediction.tracing._torch_version import MIN_TORCH
from oomkit.prediction.tracing.autocast import (
    CudaAutocastEmulation,
    cuda_autocast_construction,
    emulated_autocast_dtype,
)
from oomkit.prediction.tracing.autocast_policy import (
    CAST_POLICIES,
    CUDA_AUTOCAST_POLICY,
    CastPolicy,
    cuda_autocast_policy,
    cuda_cast_policy,
)
from oomkit.prediction.tracing.categories import CATEGORIES, PHASES, Category, Phase, infer_category
from oomkit.prediction.tracing.emulation import (
    CUDA_DIVERGENT_OPS,
    DEFAULT_EMULATIONS,
    EmulationContext,
    EmulationRegistry,
    OpEmulation,
)
from oomkit.prediction.tracing.optimizers import cuda_optimizer_defaults
from oomkit.prediction.tracing.recorder import Tracer
from oomkit.prediction.tracing.recording import TraceRecording
from oomkit.prediction.tracing.script_run import ScriptRun, ScriptSpec, record_script
from oomkit.prediction.tracing.stand_ins import ReadSite, StandIn
from oomkit.prediction.tracing.step_runner import trace_step
from oomkit.prediction.tracing.value_reads import value_tracking
from oomkit.prediction.tracing.values import KnownValue, known_value

__all__ = [
    "ScriptRun",
    "ScriptSpec",
    "record_script",
    "MIN_TORCH",
    "CAST_POLICIES",
    "CUDA_AUTOCAST_POLICY",
    "CastPolicy",
    "CudaAutocastEmulation",
    "cuda_autocast_construction",
    "cuda_autocast_policy",
    "cuda_cast_policy",
    "cuda_optimizer_defaults",
    "emulated_autocast_dtype",
    "CATEGORIES",
    "CUDA_DIVERGENT_OPS",
    "Category",
    "DEFAULT_EMULATIONS",
    "EmulationContext",
    "EmulationRegistry",
    "OpEmulation",
    "PHASES",
    "Phase",
    "KnownValue",
    "ReadSite",
    "StandIn",
    "TraceRecording",
    "Tracer",
    "infer_category",
    "known_value",
    "trace_step",
    "value_tracking",
]
