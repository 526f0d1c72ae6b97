"""Tensor parallel (DTensor ``parallelize_module``) for the Llama presets, as torchtitan plans it.

``build_tp_preset_step(name, options, mesh)`` runs inside the fake process group and
``FakeTensorMode`` (``trace_distributed_step``) with a mesh that has a ``"tp"`` dimension (and
maybe ``"fsdp"``, and ``"dp"`` before it for HSDP): it builds the preset, applies torchtitan's Llama plan on ``mesh["tp"]``
(torchtitan/models/llama3/infra/parallelize.py ``apply_tp``, mapped onto our module names:
``tok_embeddings`` -> ``embed_tokens``, ``attention`` -> ``self_attn``, ``wq/wk/wv/wo`` ->
``q_proj/k_proj/v_proj/o_proj``, ``feed_forward.w1/w3/w2`` -> ``mlp.gate_proj/up_proj/down_proj``,
``attention_norm/ffn_norm`` -> ``input_layernorm/post_attention_layernorm``, ``output`` ->
``lm_head``), then, on a 2-D mesh, ``fully_shard`` per block + root on ``mesh["fsdp"]`` (TP
first, then FSDP: torchtitan's ``parallelize_llama`` order).

What runs is DTensor's own code: the parameters become DTensor shards (colwise: rows / tp,
rowwise: columns / tp; norms replicated), and the activations move between layouts through
functional collectives (sequence-parallel all-gather before attention and MLP, reduce-scatter
after ``o_proj`` / ``down_proj``, loss-parallel cross-entropy on vocabulary shards). Their
outputs are allocated by ``at::empty`` on the caller's current stream
(torch/csrc/distributed/c10d/Functional.cpp ``allocate_all_gather_output`` /
``allocate_reduce_scatter_output``), the default stream here, and under a fake mode each
collective is waited at once (torch/distributed/_functional_collectives.py
``_maybe_wrap_tensor``: ``_are_we_tracing()`` -> ``wait_tensor``); on a GPU the eager
``AsyncCollectiveTensor`` waits at first use instead, which moves no allocation.

Attention uses local heads: ``q_proj`` colwise gives ``heads / tp`` heads per rank and the
model's views use ``-1`` for the head count (llama.py ``_Attention.forward``), as torchtitan's
attention does; so heads, KV heads, the FFN width and the sequence must divide by tp.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, cast

import torch

from oomkit.errors import ConfigError
from oomkit.prediction.models.compiled_blocks import (
    BLOCKS_COMPILED,
    compile_model_blocks,
)
from oomkit.prediction.models.float8 import Float8Options, convert_to_float8, float8_words
from oomkit.prediction.models.llama import LlamaShape
from oomkit.prediction.models.options import BuiltStep, StepOptions
from oomkit.prediction.models.parallel import (
    _cast_floating,
    _sharded_step,
    fsdp_words,
    refuse_unsharded_modes,
    shard_blocks_and_root,
)
from oomkit.prediction.models.presets import _check_lengths, shaped_preset
from oomkit.prediction.models.selective_ac import apply_checkpointing
from oomkit.prediction.models.steps import model_dtype

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "apply_llama_tensor_parallel",
    "build_tp_preset_step",
    "check_tp_divides",
    "llama_block_plan",
    "llama_root_plan",
]


def llama_root_plan(loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """torchtitan ``apply_tp``'s root plan on our names: embedding, final norm, LM head.

    Args:
        loss_parallel: keep the logits sharded over the vocabulary (``Shard(-1)``) for a
            loss-parallel cross-entropy (torchtitan's default, ``disable_loss_parallel =
            False``); else gather them (``Replicate()``) into a plain tensor.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        # Rowwise embedding: vocabulary rows / tp; the partial sums are reduce-scattered over
        # the sequence (Shard(1)), which is what the first block receives.
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


def llama_block_plan() -> dict[str, ParallelStyle]:
    """torchtitan ``apply_tp``'s per-block plan (sequence parallel norms, colwise in, rowwise out)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "input_layernorm": SequenceParallel(),
        # _Attention.forward(x, cos, sin, cache): x is gathered over the sequence; RoPE's
        # cos/sin stay plain tensors (torchtitan leaves freqs_cis alone the same way).
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def check_tp_divides(shape: LlamaShape, tp: int, seq_len: int, title: str) -> None:
    """Refuse a tensor-parallel degree the model's sizes or the sequence do not divide.

    torchtitan ``parallelize_llama`` asserts ``seq_len % tp == 0`` (sequence parallel shards
    the sequence with plain local tensors); each rank computes ``heads / tp`` query and
    ``kv_heads / tp`` KV heads (the views in ``_Attention.forward`` take the local count).

    Raises:
        ConfigError: a size that ``tp`` does not divide, with the sizes that would.
    """
    sizes = {
        "attention heads": shape.heads,
        "KV heads": shape.kv_heads,
        "FFN width": shape.intermediate,
        "vocabulary": shape.vocab,
        "sequence length": seq_len,
    }
    bad = {name: size for name, size in sizes.items() if size % tp}
    if bad:
        said = ", ".join(f"{name} {size}" for name, size in bad.items())
        raise ConfigError(
            f"--tp {tp} must divide {title}'s {said} (each rank takes 1/{tp} of them); use a "
            f"TP degree that divides {shape.kv_heads} KV heads (e.g. --tp {_divisor(shape, tp)}) "
            "and a --seq that is a multiple of it"
        )


def _divisor(shape: LlamaShape, tp: int) -> int:
    """The largest degree below ``tp`` that divides the KV heads (for the error's example)."""
    return max(d for d in range(1, tp + 1) if shape.kv_heads % d == 0)


def apply_llama_tensor_parallel(
    model: torch.nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool = True
) -> None:
    """``parallelize_module`` the root, then every block, with torchtitan's Llama plan.

    A tied LM head (Llama 3.2 1B / 3B) is tied again afterwards: the embedding (rowwise) and
    the LM head (colwise) both shard the ``[vocab, hidden]`` weight on dim 0, so the one
    DTensor serves both, as the one plain parameter did.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    llama = cast(Any, model)
    tied = llama.lm_head.weight is llama.embed_tokens.weight
    parallelize_module(model, tp_mesh, llama_root_plan(loss_parallel))
    for block in llama.layers:
        parallelize_module(block, tp_mesh, llama_block_plan())
    if tied:
        llama.lm_head.weight = llama.embed_tokens.weight


def build_tp_preset_step(
    name: str, options: StepOptions, mesh: DeviceMesh, float8: Float8Options | None = None
) -> BuiltStep:
    """Llama preset ``name`` tensor-parallel on ``mesh["tp"]`` (then FSDP2 on ``mesh["fsdp"]``).

    Precision as torchtitan: with FSDP, ``bf16-mixed`` is FSDP2's ``MixedPrecisionPolicy``
    and the step runs without autocast; with TP alone it is ``torch.autocast(bf16)`` (plain
    PyTorch AMP; torchtitan's ``maybe_enable_amp`` would train in fp32 there instead, with a
    warning). The training step runs under ``loss_parallel()`` (torchtitan's
    ``train_context``), so the cross-entropy reads vocabulary shards.

    Args:
        name: a Llama preset.
        options: the per-rank (local) batch, lengths, precision, optimizer, checkpointing, mode.
        mesh: the fake group's mesh, with a ``"tp"`` dimension and maybe ``"fsdp"`` (and
            ``"dp"`` with it: HSDP replicas).

    Returns:
        Rank 0's step, with the sharded model, optimizer and inputs to track.

    Raises:
        UnknownPresetError: ``name`` is not a preset.
        ConfigError: not a Llama preset, ``fp16-mixed``, ``generate``, a DDP dimension
            without an FSDP one, or a size that tp does not divide.
    """
    from torch.distributed.tensor.parallel import loss_parallel

    names = tuple(mesh.mesh_dim_names or ())
    if options.precision is None:  # a preset's own precision is fp32
        options = dataclasses.replace(options, precision="fp32")
    preset = shaped_preset(name, options)
    if not isinstance(preset.shape, LlamaShape):
        raise ConfigError(
            f"--tp is modelled for the Llama presets (torchtitan's Llama plan); {name} is "
            f"{preset.title}. Example: oomkit predict llama3-8b --tp 2"
        )
    if "dp" in names and "fsdp" not in names:
        # torchtitan/models/llama3/infra/parallelize.py parallelize_llama: DDP refuses a mesh
        # of more than one dimension ("DDP has not supported > 1D parallelism").
        raise ConfigError(
            "--tp with --dp alone (DDP replicas) is not modelled (torchtitan refuses DDP with "
            "TP too); use --fsdp with --tp, or --dp R --fsdp S --tp N (HSDP x TP)"
        )
    refuse_unsharded_modes(options, "--tp")
    seq_len = options.seq_len or preset.default_seq_len or 0
    _check_lengths(preset, options, seq_len)
    tp_mesh = mesh["tp"]
    check_tp_divides(preset.shape, tp_mesh.size(), seq_len, preset.title)
    device = mesh.device_type
    with torch.device(device):
        model = preset.build()
    if options.precision == "bf16":
        _cast_floating(model, model_dtype(options.precision))
    converted = ""
    if float8 is not None:
        # torchtitan converts the model config before parallelize, so its TP plan shards the
        # Float8Linear modules; torchao's casts and _scaled_mm then run on DTensor shards.
        converted = float8_words(float8, len(convert_to_float8(model, float8))) + ", "
    apply_llama_tensor_parallel(model, tp_mesh)
    # TP, then activation checkpointing, then FSDP (torchtitan parallelize_llama's order);
    # "none" is no checkpointing (a bare truth test made every TP step checkpoint fully).
    apply_checkpointing(
        model, options.checkpointing, train=options.mode == "train", as_torchtitan=True
    )
    layout = converted + (f"{BLOCKS_COMPILED}, " if options.compile else "")
    if options.compile:  # after TP and AC, before FSDP (torchtitan parallelize_llama)
        compile_model_blocks(model, "--tp")
    layout += f"tensor parallel over {tp_mesh.size()} ranks (torchtitan's Llama plan: sequence "
    layout += "parallel, loss parallel)"
    if "fsdp" in names:
        # torchtitan apply_fsdp: with replicas, fully_shard on the 2-D (dp_replicate, dp_shard)
        # mesh, which FSDP2 takes as HSDP (replicate over dim 0, shard over dim 1).
        fsdp_mesh = mesh["dp", "fsdp"] if "dp" in names else mesh["fsdp"]
        # Its joined FSDP x TP meshes are made on the host (tracing/distributed.py
        # fake_process_group).
        blocks = cast(Any, model).layers
        units = shard_blocks_and_root(model, blocks, fsdp_mesh, options.precision or "fp32")
        layout += f", {fsdp_words(fsdp_mesh)} ({units} units: per block + root)"
    built = _sharded_step(
        preset,
        model,
        options,
        seq_len,
        device,
        fsdp_casts="fsdp" in names,
        where=f"{layout}, rank 0 of {mesh.size()}",
    )
    inner = built.step_fn

    def step() -> Any:
        with loss_parallel():
            return inner()

    return dataclasses.replace(built, step_fn=step)
