"""The CUDA memory emulations that ship with oomkit, one module per concept.

``register_defaults(registry)`` adds them all; ``oomkit.prediction.tracing.emulation.DEFAULT_EMULATIONS``
is a registry built that way; its SDPA choice follows ``use_sdpa_settings`` (a user-facing
switch, like ``torch.backends.cuda.sdp_kernel``), else this torch install's cuDNN, and its
cuBLAS rules are this torch install's. A ``Target`` that states its cuDNN or torch version passes
them explicitly: ``trace_step(..., target=t)`` traces with
``emulations_for(t.cudnn_version, t.torch_version)``. To fix a setting for one registry (or a
``CUBLAS_WORKSPACE_CONFIG``), build your own::

    registry = EmulationRegistry()
    register_defaults(registry, sdpa=SdpaSettings(cudnn_version=91501), environ={...})
    trace_step(step, model, emulations=registry)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING

from oomkit.prediction.tracing.emulations.batch_norm import register_batch_norm, uses_cudnn
from oomkit.prediction.tracing.emulations.cublas import (
    CUBLAS_OPS,
    cublas_workspace_bytes,
    cublaslt_unified,
    cublaslt_workspace_bytes,
    register_cublas,
)
from oomkit.prediction.tracing.emulations.cudnn_builds import (
    DEFAULT_WHEEL_CUDNN,
    CudnnBuild,
    cudnn_build_for,
    cudnn_version_text,
    installed_cudnn_build,
)
from oomkit.prediction.tracing.emulations.cudnn_workspace import (
    conv_runs_cudnn,
    conv_workspace_cap_bytes,
    register_cudnn_workspace,
)
from oomkit.prediction.tracing.emulations.dropout import register_dropout
from oomkit.prediction.tracing.emulations.embedding import register_embedding
from oomkit.prediction.tracing.emulations.foreach_norm import register_foreach_norm
from oomkit.prediction.tracing.emulations.grouped_mm import register_grouped_mm
from oomkit.prediction.tracing.emulations.inplace_adds import register_linear
from oomkit.prediction.tracing.emulations.inplace_backward import (
    INPLACE_BRANCHES,
    NOT_EMULATED_BRANCHES,
    InPlaceBranch,
    register_inplace_backward,
)
from oomkit.prediction.tracing.emulations.input_buffer import ACCUMULATE_OP, register_input_buffer
from oomkit.prediction.tracing.emulations.layer_norm import register_layer_norm
from oomkit.prediction.tracing.emulations.reductions import REDUCTION_OPS, register_reductions
from oomkit.prediction.tracing.emulations.rms_norm import register_rms_norm
from oomkit.prediction.tracing.emulations.scalars import register_scalars
from oomkit.prediction.tracing.emulations.sdpa import register_sdpa, sdpa_backend_for
from oomkit.prediction.tracing.emulations.sdpa_backend import (
    SdpaCall,
    SdpaSettings,
    SdpBackend,
    cudnn_version_decides,
    current_sdpa_settings,
    default_sdpa_settings,
    select_sdp_backend,
    use_sdpa_settings,
)
from oomkit.prediction.tracing.emulations.softmax import register_softmax

if TYPE_CHECKING:
    from oomkit.prediction.tracing.emulation import EmulationRegistry

__all__ = [
    "ACCUMULATE_OP",
    "CUBLAS_OPS",
    "DEFAULT_WHEEL_CUDNN",
    "INPLACE_BRANCHES",
    "NOT_EMULATED_BRANCHES",
    "REDUCTION_OPS",
    "CudnnBuild",
    "InPlaceBranch",
    "SdpBackend",
    "SdpaCall",
    "SdpaSettings",
    "cublas_workspace_bytes",
    "cublaslt_unified",
    "cublaslt_workspace_bytes",
    "conv_runs_cudnn",
    "conv_workspace_cap_bytes",
    "cudnn_build_for",
    "cudnn_version_decides",
    "cudnn_version_text",
    "default_sdpa_settings",
    "installed_cudnn_build",
    "register_batch_norm",
    "register_cublas",
    "register_cudnn_workspace",
    "register_defaults",
    "register_dropout",
    "register_embedding",
    "register_foreach_norm",
    "register_grouped_mm",
    "register_inplace_backward",
    "register_input_buffer",
    "register_layer_norm",
    "register_linear",
    "register_reductions",
    "register_rms_norm",
    "register_scalars",
    "register_softmax",
    "register_sdpa",
    "sdpa_backend_for",
    "current_sdpa_settings",
    "emulations_for",
    "select_sdp_backend",
    "use_sdpa_settings",
    "uses_cudnn",
]


def register_defaults(
    registry: EmulationRegistry,
    *,
    sdpa: SdpaSettings | None = None,
    environ: Mapping[str, str] | None = None,
    cudnn_version: int | None = None,
    torch_version: str | None = None,
) -> None:
    """Register every built-in emulation in ``registry``.

    Args:
        registry: where to register (must not already hold these ops).
        sdpa: switches for the SDPA backend choice; default: those in effect at each call
            (``use_sdpa_settings``, else ``default_sdpa_settings()``).
        environ: environment the cuBLAS and cuDNN workspace hooks read
            (``CUBLAS_WORKSPACE_CONFIG``, ``CUDNN_CONV_WSCAP_DBG``, ...); default ``os.environ``.
        cudnn_version: the target's cuDNN version (``Target.cudnn_version``), replacing the
            one of the SDPA switches; ``None`` keeps theirs.
        torch_version: the target's torch (``Target.torch_version``), whose cuBLAS rules apply;
            ``None``: this install's.
    """
    register_sdpa(registry, sdpa, cudnn_version=cudnn_version)
    register_softmax(registry)
    register_cublas(registry, environ, torch_version=torch_version)
    register_embedding(registry)
    register_batch_norm(registry)
    register_dropout(registry)
    register_inplace_backward(registry)
    register_input_buffer(registry)
    register_linear(registry)
    register_layer_norm(registry, torch_version=torch_version)
    register_rms_norm(registry, torch_version=torch_version)
    register_scalars(registry)
    register_reductions(registry)
    register_foreach_norm(registry)
    register_grouped_mm(registry)
    register_cudnn_workspace(registry, environ)


@functools.lru_cache(maxsize=16)
def emulations_for(
    cudnn_version: int | None = None, torch_version: str | None = None
) -> EmulationRegistry | None:
    """The built-in emulations for a target that states its cuDNN or torch version
    (``trace_step`` with a ``Target``): the SDPA choice uses that cuDNN, the cuBLAS rules that
    torch, the other switches those in effect. ``None`` when it states neither (the tracer's
    default registry applies)."""
    from oomkit.prediction.tracing.emulation import EmulationRegistry

    if cudnn_version is None and torch_version is None:
        return None
    registry = EmulationRegistry()
    register_defaults(registry, cudnn_version=cudnn_version, torch_version=torch_version)
    return registry
