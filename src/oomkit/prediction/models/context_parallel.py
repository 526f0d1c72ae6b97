"""Context parallel for the Llama presets: the sequence sharded over ``cp`` ranks, ring attention.

``build_cp_preset_step(name, options, mesh)`` runs inside the fake process group and
``FakeTensorMode`` (``trace_distributed_step``) with a mesh that has a ``"cp"`` dimension (and
maybe ``"fsdp"`` before it). Each rank holds ``seq / cp`` tokens of every sequence, as
torch.distributed.tensor.experimental.context_parallel leaves them (``_context_parallel_buffers``:
the input ids and labels sharded on the sequence dimension, head-tail load balanced for causal
attention), so every activation outside attention is ``seq / cp`` long. Attention is torch's own ring code:
``_scaled_dot_product_ring_flash_attention`` and its backward
(torch/distributed/tensor/experimental/_context_parallel/_attention.py
``_templated_ring_attention``: K and V concatenated and all-gathered once by the default
``_AllGatherRotater``, each step's flash output merged in fp32 by ``_SDPAMerger``; the backward
rotates dK/dV the same way), called on the local tensors as its DTensor handler calls it.
FSDP2 shards over the FSDP and CP ranks together, CP alone included (torchtitan
parallel_dims.py ``build_mesh``: its ``fsdp`` mesh is ``dp_shard x cp``), so the parameters
are split ``fsdp * cp`` ways.

Not modelled: the cuDNN and memory-efficient ring kernels (the flash one is used whatever the
GPU's SDPA choice would be), CP with TP or PP, and the whole batch's token ids and labels that
torchtitan moves to the device before ``context_parallel`` shards them (8 bytes a token).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from oomkit.errors import ConfigError
from oomkit.prediction.models.llama import LlamaShape
from oomkit.prediction.models.options import BuiltStep, StepOptions
from oomkit.prediction.models.parallel import (
    _cast_floating,
    _sharded_step,
    refuse_unsharded_modes,
    shard_blocks_and_root,
)
from oomkit.prediction.models.presets import _check_lengths, shaped_preset
from oomkit.prediction.models.selective_ac import apply_checkpointing
from oomkit.prediction.models.steps import model_dtype

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["RingAttention", "build_cp_preset_step", "check_cp_divides", "ring_attention_installed"]


def check_cp_divides(cp: int, seq_len: int, title: str) -> None:
    """Refuse a sequence the load balancer cannot split: ``2 * cp`` equal chunks
    (torch ``_HeadTailLoadBalancer``: each rank takes chunk ``r`` and ``2cp - 1 - r``).

    Raises:
        ConfigError: ``seq_len`` is not a multiple of ``2 * cp``.
    """
    if cp < 1 or seq_len % (2 * cp):
        raise ConfigError(
            f"--cp {cp} splits {title}'s sequence into {2 * cp} chunks (head-tail load "
            f"balancing: two a rank); --seq {seq_len} is not a multiple of {2 * cp}: use "
            f"--seq {max(2 * cp, seq_len // (2 * cp) * (2 * cp))}"
        )


class RingAttention(torch.autograd.Function):
    """Flash ring attention on local ``[batch, heads, seq / cp, head_dim]`` tensors: torch's
    ``_scaled_dot_product_ring_flash_attention`` forward, its ``..._backward`` backward, saving
    what autograd saves for the flash op (q, k, v, out, logsumexp, philox seed and offset)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mesh: Any) -> torch.Tensor:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _scaled_dot_product_ring_flash_attention,
        )

        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            _scaled_dot_product_ring_flash_attention(mesh, query, key, value, is_causal=True)
        )
        ctx.save_for_backward(query, key, value, out, lse, cum_q, cum_k, seed, offset)
        ctx.mesh, ctx.max_q, ctx.max_k = mesh, max_q, max_k
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _scaled_dot_product_ring_flash_attention_backward,
        )

        query, key, value, out, lse, cum_q, cum_k, seed, offset = ctx.saved_tensors
        grad_q, grad_k, grad_v, *_ = _scaled_dot_product_ring_flash_attention_backward(
            ctx.mesh, grad_out, query, key, value, out, lse, cum_q, cum_k, ctx.max_q,
            ctx.max_k, 0.0, True, seed, offset,
        )
        return grad_q, grad_k, grad_v, None


@contextlib.contextmanager
def ring_attention_installed(mesh: Any) -> Iterator[None]:
    """While open, the Llama presets' attention runs ring attention over ``mesh`` (the CP
    mesh), as ``context_parallel`` patches ``scaled_dot_product_attention`` for its block."""
    from oomkit.prediction.models import llama

    original = llama.sdpa

    def ring(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
             dropout_p: float, enable_gqa: bool = False) -> torch.Tensor:
        # enable_gqa: the flash kernel reads grouped K/V heads itself (flash_api.cpp mha_fwd:
        # num_heads_k divides num_heads), so the ring rotates K and V as they are.
        return cast(torch.Tensor, RingAttention.apply(query, key, value, mesh))

    llama.sdpa = ring
    try:
        yield
    finally:
        llama.sdpa = original


def build_cp_preset_step(name: str, options: StepOptions, mesh: DeviceMesh) -> BuiltStep:
    """Llama preset ``name`` with its sequence over ``mesh["cp"]`` (FSDP2 over the FSDP and CP
    ranks together where the mesh has ``"fsdp"``), rank 0's step.

    Args:
        name: a Llama preset.
        options: the per-rank batch, the whole sequence (``seq_len``), precision, optimizer.
        mesh: the fake group's mesh with ``"cp"`` (and maybe ``"fsdp"``) dimensions.

    Returns:
        The step: the local ``seq / cp`` tokens through the sharded model.

    Raises:
        ConfigError: not a Llama preset, a mode other than ``train``, clipping, TP or PP
            with CP, or a sequence ``2 * cp`` does not divide.
    """
    names = tuple(mesh.mesh_dim_names or ())
    if "tp" in names or "pp" in names or "dp" in names:
        raise ConfigError("--cp is modelled with --fsdp alone; drop --tp, --pp and --dp")
    if options.mode != "train":
        raise ConfigError("--cp predicts training steps; use --mode train")
    if options.max_grad_norm is not None:
        raise ConfigError("--cp does not model gradient clipping yet; drop max_grad_norm")
    refuse_unsharded_modes(options, "--cp")
    if options.precision is None:  # a preset's own precision is fp32
        options = dataclasses.replace(options, precision="fp32")
    preset = shaped_preset(name, options)
    if not isinstance(preset.shape, LlamaShape):
        raise ConfigError(
            f"--cp is modelled for the Llama presets; {name} is {preset.title}. Example: "
            "oomkit predict llama3-8b --cp 2 --seq 8192"
        )
    seq_len = options.seq_len or preset.default_seq_len or 0
    _check_lengths(preset, options, seq_len)
    cp_mesh = mesh["cp"]
    cp = cp_mesh.size()
    check_cp_divides(cp, seq_len, preset.title)
    device = mesh.device_type
    with torch.device(device):
        model = preset.build()
    if options.precision == "bf16":
        _cast_floating(model, model_dtype(options.precision))
    apply_checkpointing(model, options.checkpointing, train=True, as_torchtitan=True)
    where = f"context parallel over {cp} ranks (ring flash attention, all-gather rotation)"
    # torchtitan/distributed/parallel_dims.py build_mesh: its "fsdp" mesh is dp_shard x cp,
    # "when cp is used, FSDP is also applied ... even if there may be no data parallelism".
    fsdp_mesh = cp_mesh
    if "fsdp" in names:
        # A new mesh computes its rank map from real tensors (device_mesh.py), which
        # FakeTensorMode refuses: it is host bookkeeping, made with the mode paused.
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            fsdp_mesh = mesh["fsdp", "cp"]._flatten("dp_shard_cp")
    units = shard_blocks_and_root(
        model, cast(Any, model).layers, fsdp_mesh, options.precision or "fp32"
    )
    where += f", FSDP2 over {fsdp_mesh.size()} ranks (fsdp x cp; {units} units)"
    local = dataclasses.replace(options, seq_len=seq_len // cp)
    built = _sharded_step(
        preset, model, local, seq_len // cp, device, fsdp_casts=True,
        where=f"{where}, rank 0 of {mesh.size()}; {seq_len // cp} of {seq_len} tokens a rank",
    )
    inner = built.step_fn

    def step() -> Any:
        with ring_attention_installed(cp_mesh):
            return inner()

    return dataclasses.replace(built, step_fn=step)
