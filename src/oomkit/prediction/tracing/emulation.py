"""Per-op emulation of CUDA memory behaviour that the meta device does not reproduce.

The meta device allocates exactly the outputs of each aten op. A CUDA kernel may also take a
workspace (cuBLAS, cuDNN, SDPA backends) or keep a cache (autocast's weight casts). An
*emulation* is a hook keyed by the aten overload name (``"aten.mm.default"``) that runs in place
of the plain meta op: it calls ``ctx.run()`` for the meta outputs and may add synthetic
allocations around it with ``ctx.allocate`` / ``ctx.free``.

Hooks are keyed by aten overload name (run by the dispatch mode) or by a dotted torch function
name (``"torch.nn.functional.scaled_dot_product_attention"``, run by a TorchFunctionMode in place
of the Python function). ``DEFAULT_EMULATIONS`` holds the modules of ``tracing/emulations/``.
Ops with no hook are recorded exactly as meta runs them; ops listed in ``CUDA_DIVERGENT_OPS``
additionally produce one warning per op in the recording.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from oomkit.core.gpus import GpuSpec
from oomkit.prediction.tracing.categories import Category, Phase

if TYPE_CHECKING:
    from oomkit.prediction.tracing.engine import CudaEmulationEngine

__all__ = [
    "EmulationContext",
    "OpEmulation",
    "EmulationRegistry",
    "DEFAULT_EMULATIONS",
    "CUDA_DIVERGENT_OPS",
]


@dataclass
class EmulationContext:
    """What an emulation hook sees of one op call, and how it adds synthetic allocations.

    Attributes:
        op_name: the aten overload name (``"aten.mm.default"``) or torch function name.
        func: the op; ``run()`` calls it with ``args`` and ``kwargs``.
        gpu: the target device the emulation models (compute capability, architecture).
    """

    op_name: str
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    _engine: CudaEmulationEngine = field(repr=False)
    gpu: GpuSpec | None = None

    def __post_init__(self) -> None:
        if self.gpu is None:
            self.gpu = self._engine.gpu

    @property
    def phase(self) -> Phase:
        """Where the step is: ``forward``, ``backward`` (autograd's thread on CUDA), ..."""
        return self._engine.sink.phase()

    @property
    def state(self) -> dict[str, Any]:
        """Per-engine scratch space shared by all hooks (e.g. which cuBLAS handles exist)."""
        return self._engine.state

    def run(self) -> Any:
        """Run the op on meta; its outputs are recorded as usual when the hook returns them."""
        return self.func(*self.args, **self.kwargs)

    def record_outputs(self, outputs: Any) -> None:
        """Record the op's outputs as allocated now rather than when the hook returns.

        For a kernel that allocates its outputs before (or while) its workspaces are live, so
        the workspaces' frees come after the outputs, as on CUDA.
        """
        self._engine.record_outputs(outputs, self.op_name)

    def allocate(self, size_bytes: int, category: Category, what: str | None = None) -> int:
        """Record a synthetic allocation of ``size_bytes``; returns its id for :meth:`free`.

        Args:
            size_bytes: the requested size, in bytes.
            category: ``workspace``, ``autocast_cache``, ...
            what: tagged as ``("emulated", what)``, e.g. ``"cublas_workspace"``.

        Raises:
            torch.OutOfMemoryError: under ``SimulatedCudaDevice``, when it does not fit.
        """
        return self._engine.allocate_synthetic(size_bytes, category, self.op_name, what)

    def free(self, alloc_id: int) -> None:
        """Record the free of a synthetic allocation made by :meth:`allocate`."""
        self._engine.free_synthetic(alloc_id)

    def contiguous_copies(self, what: str, *tensors: Any) -> list[int]:
        """A kernel's ``expect_contiguous()`` / ``contiguous()`` of each tensor given (``None``
        skipped): a temporary copy, tagged ``what``, of each one that is not contiguous; their
        ids, in order, for :meth:`free_last_first`."""
        return [
            self.allocate(t.numel() * t.element_size(), "temporary", what)
            for t in tensors
            if t is not None and not t.is_contiguous()
        ]

    def free_last_first(self, ids: list[int]) -> None:
        """Free synthetic allocations as C++ destroys locals: the last made first."""
        for alloc_id in reversed(ids):
            self.free(alloc_id)

    def allocation_phase(self, tensor: Any) -> Phase | None:
        """The phase in which ``tensor``'s storage was allocated; None when it is not accounted
        (another device, no storage, not seen yet)."""
        from oomkit.prediction.tracing.storages import tensor_storage

        storage = tensor_storage(tensor, self._engine.device_type)
        if storage is None:
            return None
        alloc = self._engine.table.lookup(storage)
        return None if alloc is None else alloc.phase

    def note_choice(self, choice: str) -> None:
        """Count a kernel choice the emulation made (``"SDPA flash_attention"``): the recording
        lists them so a report can say what it assumed."""
        self._engine.kernel_choices[choice] += 1

    def note_site(self, kind: str, params: tuple[int, ...], output: Any) -> None:
        """Note that this call's temporaries depend on sizes (``params``), by the plan of
        ``kind`` (``oomkit.prediction.tracing.emulation_sites.SITE_PLANS``), around the allocation of
        ``output`` (recorded already: ``record_outputs``). A batch search then synthesizes
        them at batches on the other side of the size that picks the path."""
        self._engine.note_site(kind, params, output)

    def note_assumption(self, name: str, value: str) -> None:
        """Record a fact about the target the emulation's choice rests on (``"cuDNN"`` ->
        ``"9.20.0 (torch 2.13's default Linux wheel)"``), so a report can state it."""
        self._engine.assumptions[name] = value

    def not_emulated(self, what: str) -> None:
        """Count this call as only partly emulated: the recording warns, naming the op and ``what``.

        Args:
            what: the CUDA memory this hook leaves out, e.g. ``"cuDNN graph workspace"``.
        """
        self._engine.partial_calls[(self.op_name, what)] += 1


class OpEmulation(Protocol):
    """A hook that runs one aten op the way CUDA would, memory-wise; returns the op's outputs."""

    def __call__(self, ctx: EmulationContext) -> Any: ...


class EmulationRegistry(Mapping[str, OpEmulation]):
    """Emulation hooks by aten overload name (``str(torch.ops.aten.mm.default)``)."""

    def __init__(self, hooks: Mapping[str, OpEmulation] | None = None) -> None:
        self._hooks: dict[str, OpEmulation] = dict(hooks or {})

    def register(self, op_name: str) -> Callable[[OpEmulation], OpEmulation]:
        """Decorator: ``@registry.register("aten.mm.default")``.

        Raises:
            ValueError: ``op_name`` already has a hook in this registry.
        """

        def decorate(hook: OpEmulation) -> OpEmulation:
            if op_name in self._hooks:
                raise ValueError(
                    f"{op_name} already has an emulation hook; make a new EmulationRegistry "
                    "to replace it"
                )
            self._hooks[op_name] = hook
            return hook

        return decorate

    def __getitem__(self, op_name: str) -> OpEmulation:
        return self._hooks[op_name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._hooks)

    def __len__(self) -> int:
        return len(self._hooks)


# Ops whose CUDA memory is known to differ from what meta records, with the reason. A run of one
# of these with no emulation hook adds a warning to the recording.
CUDA_DIVERGENT_OPS: Mapping[str, str] = {
    # CublasHandlePool.cpp getChosenWorkspaceSize / getCUDABlasLtWorkspace: cuBLAS takes a
    # per-stream workspace from the caching allocator on first use (emulations/cublas.py).
    "aten.mm.default": "cuBLAS workspace",
    "aten.addmm.default": "cuBLAS workspace",
    "aten.bmm.default": "cuBLAS workspace",
    "aten.baddbmm.default": "cuBLAS workspace",
    # sdp_utils.cpp select_sdp_backend: CUDA picks flash/efficient/cuDNN kernels with their own
    # outputs (logsumexp, philox state); meta runs the math decomposition (emulations/sdpa.py).
    # Composite, so it is seen by a TorchFunctionMode; a call nested in another torch function
    # (F.multi_head_attention_forward in nn.MultiheadAttention) runs with the mode popped, and is
    # caught because DivergenceFunctionMode.reach_backward swaps the module attribute the caller
    # looks up (_modes.py).
    "torch.nn.functional.scaled_dot_product_attention": (
        "SDPA backend choice (meta runs the math path, which materialises the attention matrix)"
    ),
    # attention_backward.cu _efficient_attention_backward: grad_out copy, fp32 delta and a kernel
    # workspace (emulations/sdpa.py; the workspace is a warning only where the kernel is unknown).
    "aten._scaled_dot_product_efficient_attention_backward.default": (
        "mem-efficient attention backward's delta and kernel workspace"
    ),
    # cudnn/MHA.cpp run_cudnn_SDP_fprop / bprop: a cuDNN graph workspace sized by cuDNN.
    "aten._scaled_dot_product_cudnn_attention.default": "cuDNN attention workspace",
    "aten._scaled_dot_product_cudnn_attention_backward.default": "cuDNN attention workspace",
    # Normalization.cpp _batch_norm_impl_index: training-mode batch norm on CUDA runs
    # cudnn_batch_norm, whose reserve space (saved for backward) and workspace are sized by
    # cuDNN at run time (cudnnGetBatchNormalizationTrainingExReserveSpaceSize);
    # emulations/batch_norm.py.
    "aten.native_batch_norm.default": "cuDNN batch-norm reserve space and workspace",
    "aten.native_batch_norm_backward.default": "cuDNN batch-norm backward workspace",
    # Dropout.cpp dropout: CUDA takes the fused native_dropout (a 1-byte bool mask); meta keeps
    # a noise tensor of the input's dtype (emulations/dropout.py).
    "torch.nn.functional.dropout": "fused dropout's bool mask (meta keeps a dtype-sized noise)",
}


def _build_defaults() -> EmulationRegistry:
    from oomkit.prediction.tracing.emulations import register_defaults

    registry = EmulationRegistry()
    register_defaults(registry)
    return registry


# SDPA backends, cuBLAS workspaces and the embedding backward sort (tracing/emulations/).
DEFAULT_EMULATIONS = _build_defaults()
