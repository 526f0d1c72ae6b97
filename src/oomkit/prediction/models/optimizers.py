"""The optimizers of a built-in step: torch.optim, bitsandbytes' 8-bit Adam, both Adafactors.

bitsandbytes is not required: its CUDA kernels cannot run on meta tensors, so ``Adam8bitStates``
allocates exactly the state tensors that bitsandbytes' ``Optimizer2State.init_state`` allocates
(bitsandbytes/optim/optimizer.py) and runs no update: ``optimizer_update_8bit_blockwise`` and
``optimizer_update_32bit`` update the parameter and states in place and allocate nothing on the
device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from oomkit.errors import OomkitError, TorchRequiredError
from oomkit.prediction.models.options import OptimizerImpl

__all__ = [
    "Adam8bitStates",
    "TorchAdafactor",
    "PagedStateBuffer",
    "make_optimizer",
    "paged_state_bytes",
    "BNB_BLOCK_SIZE",
    "BNB_MIN_8BIT_SIZE",
    "BNB_PAGED_MIN_NUMEL",
    "BNB_QMAP_ENTRIES",
]

# bitsandbytes/optim/optimizer.py Optimizer2State.__init__ and optim/adamw.py AdamW8bit /
# PagedAdamW8bit: min_8bit_size=4096 (a parameter with fewer elements keeps fp32 states),
# block_wise=True, percentile_clipping=100 and max_unorm=0.0 (so no gnorm_vec / unorm_vec).
BNB_MIN_8BIT_SIZE = 4096
# Optimizer2State.init_state: blockwise absmax, one fp32 per 256 elements (blocks = n // 256,
# plus one for a remainder).
BNB_BLOCK_SIZE = 256
# Optimizer8bit.get_state_buffer: paged only when ``p.numel() >= 1e5`` ("> 1 MB").
BNB_PAGED_MIN_NUMEL = 100_000
# functional.py create_dynamic_map(signed=..., total_bits=8): 2**8 fp32 code values.
BNB_QMAP_ENTRIES = 256


@dataclass(frozen=True)
class PagedStateBuffer:
    """A paged optimizer state: unified memory from ``cudaMallocManaged``, outside PyTorch.

    bitsandbytes' ``functional.get_paged`` allocates it with ``lib.cget_managed_ptr`` and wraps
    it with ``torch.frombuffer``: PyTorch's caching allocator never sees it, and the driver
    migrates its pages to the GPU when a kernel touches them and evicts them to host memory
    when the GPU is full, instead of failing. oomkit therefore records no device allocation for
    it; ``Adam8bitStates.paged_state_bytes`` says how much there is.

    Attributes:
        numel: elements (those of its parameter).
        dtype: ``torch.uint8`` (8-bit state) or ``torch.float32``.
    """

    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of unified memory."""
        return self.numel * (1 if self.dtype == torch.uint8 else 4)


class Adam8bitStates(torch.optim.Optimizer):
    """bitsandbytes ``AdamW8bit`` / ``PagedAdamW8bit`` state allocation, for meta tensors.

    Per parameter with a gradient, on its first step (``Optimizer2State.init_state``):

    - fewer than ``min_8bit_size`` (4096) elements: ``state1`` and ``state2`` fp32, shaped like
      the parameter;
    - otherwise ``state1`` and ``state2`` uint8 shaped like the parameter, ``absmax1`` and
      ``absmax2`` fp32 of ``ceil(numel / 256)`` elements, and the two 256-entry fp32
      quantization maps (``qmap1`` signed, ``qmap2`` unsigned), copied to the device once
      (``self.name2qmap[...] = ...to(p.device)``) and shared by every parameter.

    Paged (``PagedAdamW8bit``): ``state1``/``state2`` of a parameter with at least 100,000
    elements come from ``get_paged`` (unified memory, see :class:`PagedStateBuffer`); its
    ``absmax`` and the maps stay ordinary device tensors.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float = 1e-3,
        paged: bool = False,
        min_8bit_size: int = BNB_MIN_8BIT_SIZE,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8})
        self.paged = paged
        self.min_8bit_size = min_8bit_size
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def paged_state_bytes(self) -> int:
        """Bytes of paged (unified-memory) states created so far; 0 unless ``paged``."""
        return sum(
            value.nbytes
            for state in self.state.values()
            for value in state.values()
            if isinstance(value, PagedStateBuffer)
        )

    def _qmap_pair(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # Optimizer8bit.fill_qmap builds the maps on the host at construction; init_state moves
        # them to the parameter's device the first time and keeps the device copies.
        if device not in self._qmaps:
            self._qmaps[device] = (
                torch.zeros(BNB_QMAP_ENTRIES, dtype=torch.float32, device=device),
                torch.zeros(BNB_QMAP_ENTRIES, dtype=torch.float32, device=device),
            )
        return self._qmaps[device]

    def _state_buffer(self, p: torch.Tensor, dtype: torch.dtype) -> Any:
        # Optimizer8bit.get_state_buffer: zeros_like on the device, or get_paged when paged and
        # the parameter has at least 1e5 elements.
        if self.paged and p.numel() >= BNB_PAGED_MIN_NUMEL:
            return PagedStateBuffer(p.numel(), dtype)
        return torch.zeros_like(p, dtype=dtype)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Create each parameter's states on its first step (the update itself is in place)."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = 0
        if p.numel() < self.min_8bit_size:
            state["state1"] = self._state_buffer(p, torch.float32)
            state["state2"] = self._state_buffer(p, torch.float32)
            return
        qmap_signed, qmap_unsigned = self._qmap_pair(p.device)
        state["state1"] = self._state_buffer(p, torch.uint8)
        state["qmap1"] = qmap_signed
        state["state2"] = self._state_buffer(p, torch.uint8)
        state["qmap2"] = qmap_unsigned
        blocks = -(-p.numel() // BNB_BLOCK_SIZE)
        state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)


def paged_state_bytes(params: Iterable[torch.Tensor], *, min_8bit_size: int = BNB_MIN_8BIT_SIZE) -> int:
    """Unified-memory bytes ``PagedAdamW8bit`` will page for ``params`` (their first step).

    ``state1`` and ``state2`` of each parameter of at least 100,000 elements: uint8 (fp32 below
    ``min_8bit_size``, which a paged parameter never is with the default 4096).
    """
    total = 0
    for p in params:
        if p.numel() >= BNB_PAGED_MIN_NUMEL:
            total += 2 * p.numel() * (1 if p.numel() >= min_8bit_size else 4)
    return total


def _adafactor(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    try:
        from transformers.optimization import Adafactor
    except ImportError as exc:
        raise TorchRequiredError(
            "optimizer 'adafactor' is transformers' Adafactor; install transformers with "
            "`pip install oomkit[hf]`, or choose another optimizer"
        ) from exc
    # transformers/trainer_optimizer.py _get_adafactor (TrainingArguments(optim="adafactor")):
    # scale_parameter=False, relative_step=False, with the Trainer's learning rate.
    optimizer: torch.optim.Optimizer = Adafactor(
        params, lr=1e-4, scale_parameter=False, relative_step=False
    )
    return optimizer


# What a value read oomkit cannot know stands for (tracing/stand_ins.py STAND_IN_VALUE: 1.0, as
# a finite number); a plain float here, as it only reaches max() and a multiplier.
_RMS_ANSWER = 1.0


class _RmsReads(TorchFunctionMode):
    """Answers ``Tensor.item()`` of a 0-d floating meta tensor with ``_RMS_ANSWER``.

    Inside ``TorchAdafactor.step`` those are only the two RMS reads: the ``step`` counters are
    host tensors (read for real), and the parameters, gradients and states are unknown.
    """

    def __init__(self) -> None:
        super().__init__()
        self.answered = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        tensor = args[0] if args else None
        if (
            func is torch.Tensor.item
            and isinstance(tensor, torch.Tensor)
            and tensor.is_meta
            and tensor.dim() == 0
            and tensor.dtype.is_floating_point
        ):
            self.answered += 1
            return _RMS_ANSWER
        return func(*args, **(kwargs or {}))


class TorchAdafactor(torch.optim.Adafactor):
    """``torch.optim.Adafactor`` (``foreach`` or the for-loop), runnable on meta tensors.

    Its states are torch's own (``Adafactor._init_group``, run unchanged): for a gradient of 2 or
    more dimensions a row factor ``row_var`` (the shape with the last dimension 1) and a column
    factor ``col_var`` (the second-to-last dimension 1), in the gradient's dtype; for a vector a
    full ``variance``; the ``step`` is a CPU tensor (no device memory: torch makes it with no
    device, and a CUDA run has no default device; the tracer's default meta device is set aside
    for it) whose ``.item()`` reads are real. Its update (``_single_tensor_adafactor`` / ``_multi_tensor_adafactor``) reads two values
    with ``.item()`` per parameter: the RMS of the parameter (``alpha = max(eps2, RMS(p)) *
    rho_t``) and of the update (``denom = max(1, RMS(u) / d)``). Those are data, unknown on meta,
    and oomkit's stand-ins refuse ``max()``; they only scale the in-place ``param.add_`` (or
    ``_foreach_mul_`` by Python floats) and allocate nothing, so inside ``step`` they are
    answered with 1.0 (``reads_answered`` counts them). The ``norm`` each read is taken of is
    recorded as on CUDA.
    """

    reads_answered = 0

    def _init_group(self, group: Any, *lists: Any) -> bool:
        # _adafactor.py _init_group makes ``step`` with torch.tensor(0.0) and no device: host
        # memory on a CUDA run (no default device), not the tracer's default meta device. The
        # states are made with new_zeros / zeros_like of the gradient, on its device.
        with torch.device("cpu"):
            has_complex: bool = super()._init_group(group, *lists)
        return has_complex

    def step(self, closure: Any = None) -> Any:  # noqa: D102
        reads = _RmsReads()
        with reads:
            loss = super().step(closure)
        self.reads_answered += reads.answered
        return loss


def make_optimizer(
    name: str, params: Sequence[torch.Tensor], impl: OptimizerImpl = "foreach"
) -> torch.optim.Optimizer:
    """The optimizer ``name`` over ``params`` (the trainable ones).

    Args:
        name: ``adamw``, ``adam``, ``sgd`` (momentum 0.9), ``adamw8bit``, ``paged-adamw8bit``,
            ``adafactor`` (transformers') or ``torch-adafactor`` (``torch.optim.Adafactor``).
        params: the parameters to optimize.
        impl: for ``adamw``/``adam``/``sgd`` (``torch-adafactor``: not ``fused``): ``foreach`` (what CUDA parameters get by default,
            torch/optim/optimizer.py ``_default_to_fused_or_foreach``), ``fused`` or
            ``for-loop`` (``foreach=False``: one parameter at a time).

    Raises:
        OomkitError: an unknown name, or ``impl`` other than foreach for an optimizer without
            torch's implementations.
    """
    if name in ("adamw", "adam", "sgd"):
        foreach, fused = impl == "foreach", impl == "fused"
        if name == "adamw":
            return torch.optim.AdamW(params, lr=1e-4, foreach=foreach, fused=fused)
        if name == "adam":
            return torch.optim.Adam(params, lr=1e-4, foreach=foreach, fused=fused)
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach, fused=fused)
    if name == "torch-adafactor":
        # torch/optim/_adafactor.py: foreach (CUDA's default) or the for-loop; no fused kernel.
        if impl == "fused":
            raise OomkitError(
                "torch.optim.Adafactor has no fused kernel; use optimizer_impl 'foreach' (the "
                "default) or 'for-loop' (CLI: --optimizer-impl for-loop)"
            )
        return TorchAdafactor(params, lr=1e-2, foreach=impl == "foreach")
    if impl != "foreach":
        raise OomkitError(
            f"optimizer_impl {impl!r} applies to torch's adamw, adam and sgd only; {name} has its "
            "own kernels. Drop it (StepOptions(optimizer_impl='foreach'), the default)"
        )
    if name in ("adamw8bit", "paged-adamw8bit"):
        return Adam8bitStates(params, lr=1e-4, paged=name == "paged-adamw8bit")
    if name == "adafactor":
        return _adafactor(params)
    raise OomkitError(
        f"unknown optimizer {name!r}; use adamw, adam, sgd, adamw8bit, paged-adamw8bit, adafactor "
        "or torch-adafactor"
    )
