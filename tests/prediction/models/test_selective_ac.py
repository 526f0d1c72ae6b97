"""Selective per-op activation checkpointing (torchtitan's policy) recorded for real."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from _tiny_hf import tiny_llama_config

from oomkit.core.target import Target
from oomkit.prediction.models import StepOptions, build_preset_step
from oomkit.prediction.models.llama import Llama, LlamaShape
from oomkit.prediction.models.selective_ac import apply_checkpointing, selective_op_policy
from oomkit.prediction.models.steps import ModelRunner, build_step
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.tracing import trace_step

TINY = LlamaShape(
    hidden=256,
    intermediate=1024,
    layers=2,
    heads=4,
    kv_heads=2,
    vocab=512,
    tied=False,
    positions=4096,
)


def _tiny_peak(mode: str) -> int:
    with torch.device("meta"):
        model = Llama(TINY)
    apply_checkpointing(model, mode)  # type: ignore[arg-type]
    options = StepOptions(batch_size=4, seq_len=1024, checkpointing=mode)  # type: ignore[arg-type]
    runner = ModelRunner(model, "causal_lm", TINY.vocab, forward=model)
    built = build_step(runner, options, title="tiny", seq_len=1024, image_size=224, device="meta")
    target = Target.resolve(gpu="h100")
    recording = trace_step(built.step_fn, *built.track, steps=2, target=target)
    return predict_recording(recording, target=target).peak_allocated_bytes


def _kept_in_block(recording, block: str) -> list[tuple[str, str, int, int]]:
    """The forward allocations of module ``block`` and below that are kept as activations:
    (module below ``block``, op without ``aten.``, bytes, stream), in order."""
    kept = []
    for event in recording.events:
        tags = dict(event.tags)
        module = tags.get("module", "")
        if (
            event.action == "alloc"
            and tags.get("phase") == "forward"
            and tags.get("category") == "activation"
            and (module == block or module.startswith(block + "."))
        ):
            op = tags["op"].removeprefix("aten.")
            kept.append((module.removeprefix(block), op, event.size, event.stream))
    return kept


def _policy_outputs(
    *, tokens: int, hidden: int, kv: int, ffn: int, heads: int, next_input_bytes: int
) -> list[tuple[str, str, int, int]]:
    """What selective_op_policy keeps of one Llama block, as ``_kept_in_block`` lists it: q and v
    projections (mm 1 and 3), cuDNN attention's philox seed and offset, output and fp32
    logsumexp (in the order CUDA allocates them, measured on an H200), the gate and down
    projections (mm 5 and 7), and the next block's checkpointed input."""
    cudnn = "_scaled_dot_product_cudnn_attention.default"
    return [
        (".self_attn.q_proj", "mm.default", tokens * hidden * 2, 0),
        (".self_attn.v_proj", "mm.default", tokens * kv * 2, 0),
        (".self_attn", cudnn, 8, 0),  # philox seed
        (".self_attn", cudnn, 8, 0),  # philox offset
        (".self_attn", cudnn, tokens * hidden * 2, 0),  # output, bf16
        (".self_attn", cudnn, heads * tokens * 4, 0),  # logsumexp, fp32
        (".mlp.gate_proj", "mm.default", tokens * ffn * 2, 0),
        (".mlp.down_proj", "mm.default", tokens * hidden * 2, 0),
        ("", "add.Tensor", next_input_bytes, 0),
    ]


def test_options_read_booleans_and_refuse_unknown_modes():
    """True/False from older callers mean full/none; an unknown mode is refused by name."""
    assert StepOptions(checkpointing=True).checkpointing == "full"  # type: ignore[arg-type]
    assert StepOptions(checkpointing=False).checkpointing == "none"  # type: ignore[arg-type]
    assert StepOptions(checkpointing="selective-op").checkpointing == "selective-op"
    with pytest.raises(ValueError, match="checkpointing must be one of none, full, selective-op"):
        StepOptions(checkpointing="op")  # type: ignore[arg-type]


def test_policy_saves_every_other_mm_counting_forward_and_recompute_apart():
    """Forward's 1st and 3rd mm are saved, the 2nd and 4th recomputed; recomputation counts
    its own mms from zero; SDPA outputs are saved, other ops recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    counts: dict[str, int] = defaultdict(int)
    policy = selective_op_policy(counts)
    forward = SimpleNamespace(is_recompute=False)
    recompute = SimpleNamespace(is_recompute=True)
    mm = torch.ops.aten.mm.default
    got = [policy(forward, mm) for _ in range(4)]
    assert got == [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE] * 2
    assert policy(recompute, mm) == CheckpointPolicy.MUST_SAVE  # its own count: 1
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert policy(forward, flash) == CheckpointPolicy.MUST_SAVE
    assert policy(forward, torch.ops.aten.addmm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert dict(counts) == {"forward_mm_count": 4, "recompute_mm_count": 1}


def test_selective_op_saves_what_the_policy_saves_in_one_block():
    """Llama 3.2 1B bf16-mixed on an H100: block 0 keeps q, v, gate and down projections
    (mm 1, 3, 5, 7), cuDNN attention's outputs and the block's output; exact bytes."""
    options = StepOptions(
        batch_size=1, seq_len=32, checkpointing="selective-op", precision="bf16-mixed"
    )
    built = build_preset_step("llama-1b", options)
    recording = trace_step(built.step_fn, *built.track, target=Target.resolve(gpu="h100"))
    tokens, hidden = 32, 2048
    assert _kept_in_block(recording, "layers.0") == _policy_outputs(
        tokens=tokens, hidden=hidden, kv=512, ffn=8192, heads=32,
        next_input_bytes=tokens * hidden * 4,  # fp32: autocast leaves the residual adds alone
    )


def test_selective_op_peak_lies_between_full_and_none():
    """A tiny Llama's peak: full checkpointing < selective-op < none."""
    peaks = {mode: _tiny_peak(mode) for mode in ("none", "full", "selective-op")}
    assert peaks["full"] < peaks["selective-op"] < peaks["none"]


def test_selective_op_under_fsdp2_saves_the_same_ops_in_bf16():
    """Llama 3.2 1B under FSDP2 over 4 fake ranks (bf16 MixedPrecisionPolicy): block 0, as a
    checkpoint_wrapper sharded by fully_shard, keeps the policy's outputs, exact bytes."""
    from oomkit.prediction.models.parallel import build_fsdp_preset_step
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    options = StepOptions(
        batch_size=1, seq_len=32, checkpointing="selective-op", precision="bf16-mixed"
    )

    def build(mesh):
        built = build_fsdp_preset_step("llama-1b", options, mesh)
        return built.step_fn, tuple(built.track)

    recording = trace_distributed_step(build, world_size=4, target=Target.resolve(gpu="h100"))
    tokens, hidden = 32, 2048
    assert _kept_in_block(recording, "layers.0") == _policy_outputs(
        tokens=tokens, hidden=hidden, kv=512, ffn=8192, heads=32,
        next_input_bytes=tokens * hidden * 2,  # bf16: FSDP2 casts the inputs
    )


def test_hf_layers_take_the_policy_as_their_context_fn():
    """A small Hugging Face Llama (bf16, 2 x 32 tokens): layer 0 keeps the same ops as the
    preset, through gradient_checkpointing_enable's context_fn."""
    pytest.importorskip("transformers")
    from oomkit.prediction.models import build_hf_step

    config = tiny_llama_config(bos_token_id=0, eos_token_id=0)
    options = StepOptions(batch_size=2, seq_len=32, checkpointing="selective-op", precision="bf16")
    built = build_hf_step(config, options)
    assert built.description.endswith("adamw, selective-op checkpointing, train")
    recording = trace_step(built.step_fn, *built.track, target=Target.resolve(gpu="h100"))
    tokens = 2 * 32
    assert _kept_in_block(recording, "model.layers.0") == _policy_outputs(
        tokens=tokens, hidden=64, kv=32, ffn=128, heads=4, next_input_bytes=tokens * 64 * 2
    )


def test_inference_is_not_checkpointed():
    """Checkpointing changes only what backward needs: an inference step records the same
    allocations with selective-op as without."""
    sizes = {}
    for mode in ("none", "selective-op"):
        options = StepOptions(batch_size=1, seq_len=32, mode="inference", checkpointing=mode)
        built = build_preset_step("llama-1b", options)
        recording = trace_step(built.step_fn, *built.track)
        sizes[mode] = [(e.action, e.size) for e in recording.events]
    assert sizes["selective-op"] == sizes["none"] and len(sizes["none"]) > 100


def test_full_ac_as_torchtitan_is_its_wrapper_per_block():
    """In the sharded steps (as_torchtitan), full AC is a checkpoint wrapper per block, as
    torchtitan 0.3.0's FullAC applies it (preserve_rng_state its config's default True,
    early_stop=False), and the model's own per-block checkpoint call stays off; elsewhere full
    AC is the model's flag, and without AC (or without training) nothing is wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    with torch.device("meta"):
        plain, sharded, untouched = Llama(TINY), Llama(TINY), Llama(TINY)
    apply_checkpointing(untouched, "none", as_torchtitan=True)
    apply_checkpointing(untouched, "full", train=False, as_torchtitan=True)
    assert untouched.checkpointing is False
    assert not any(isinstance(block, CheckpointWrapper) for block in untouched.layers)
    apply_checkpointing(plain, "full")
    assert plain.checkpointing is True
    assert not any(isinstance(block, CheckpointWrapper) for block in plain.layers)
    apply_checkpointing(sharded, "full", as_torchtitan=True)
    assert sharded.checkpointing is False
    assert len(sharded.layers) == TINY.layers
    for block in sharded.layers:
        assert isinstance(block, CheckpointWrapper)
        assert block.checkpoint_fn.keywords == {
            "use_reentrant": False, "preserve_rng_state": True, "early_stop": False
        }
