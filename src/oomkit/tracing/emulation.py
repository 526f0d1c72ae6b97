"""Per-op emulation of CUDA memory behaviour that the meta device does not reproduce.

The meta device allocates exactly the outputs of each aten op. A CUDA kernel may also take a
workspace (cuBLAS, cuDNN, SDPA backends) or keep a cache (autocast's weight casts). An
*emulation* is a hook keyed by the aten overload name (``"aten.mm.default"``) that runs in place
of the plain meta op: it calls ``ctx.run()`` for the meta outputs and may add synthetic
allocations around it with ``ctx.allocate`` / ``ctx.free``.

This slice ships the registry empty. Ops with no hook are recorded exactly as meta runs them;
ops listed in ``CUDA_DIVERGENT_OPS`` additionally produce one warning per op in the recording.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from oomkit.tracing.categories import Category

if TYPE_CHECKING:
    from oomkit.tracing.recorder import Tracer

__all__ = [
    "EmulationContext",
    "OpEmulation",
    "EmulationRegistry",
    "DEFAULT_EMULATIONS",
    "CUDA_DIVERGENT_OPS",
]


@dataclass
class EmulationContext:
    """What an emulation hook sees of one op call, and how it adds synthetic allocations."""

    op_name: str
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    _tracer: Tracer = field(repr=False)

    def run(self) -> Any:
        """Run the op on meta; its outputs are recorded as usual when the hook returns them."""
        return self.func(*self.args, **self.kwargs)

    def allocate(self, size_bytes: int, category: Category) -> int:
        """Record a synthetic allocation of ``size_bytes``; returns its id for :meth:`free`."""
        return self._tracer._allocate_synthetic(size_bytes, category, self.op_name)

    def free(self, alloc_id: int) -> None:
        """Record the free of a synthetic allocation made by :meth:`allocate`."""
        self._tracer._free_synthetic(alloc_id)


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


# Empty in this slice: SDPA backends, autocast weight cache and cuBLAS workspaces come later.
DEFAULT_EMULATIONS = EmulationRegistry()

# Ops whose CUDA memory is known to differ from what meta records, with the reason. A run of one
# of these with no emulation hook adds a warning to the recording.
CUDA_DIVERGENT_OPS: Mapping[str, str] = {
    # CublasHandlePool.cpp getCUDABlasLtWorkspace / getChosenWorkspaceSize: cuBLAS takes a
    # per-handle workspace from the caching allocator on first use.
    "aten.mm.default": "cuBLAS workspace",
    "aten.addmm.default": "cuBLAS workspace",
    "aten.bmm.default": "cuBLAS workspace",
    "aten.baddbmm.default": "cuBLAS workspace",
    # sdp_utils.cpp select_sdp_backend: CUDA picks flash/efficient/cuDNN kernels with their own
    # outputs (logsumexp, philox state); meta runs the math decomposition. Composite, so it is
    # seen by a TorchFunctionMode, and only when called directly from non-torch code (a call
    # nested in another torch function, as in nn.MultiheadAttention, runs with the mode popped).
    "torch.nn.functional.scaled_dot_product_attention": (
        "SDPA backend choice (meta runs the math path, which materialises the attention matrix)"
    ),
}
