"""LoRA through peft: adapter bytes counted by hand, a frozen base, dropout's mask and output."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from oomkit.errors import OomkitError  # noqa: E402
from oomkit.prediction.models import StepOptions, build_hf_step, build_preset_step  # noqa: E402
from oomkit.prediction.models.lora_options import LoraOptions, lora_options_from  # noqa: E402
from oomkit.prediction.tracing import TraceRecording, trace_step  # noqa: E402

# hidden 64, 4 heads of 16, 2 KV heads: q_proj 64 -> 64, v_proj 64 -> 32 (peft's Llama targets).
HIDDEN, KV_OUT, LAYERS, BATCH, SEQ = 64, 32, 2, 2, 16
# r * (in + out) per targeted Linear, fp32: per layer q_proj 8*(64+64) + v_proj 8*(64+32) = 1792
# parameters; 2 layers = 3584 parameters = 14336 bytes.
LLAMA_ADAPTER_BYTES = 2 * 8 * ((64 + 64) + (64 + 32)) * 4
assert LLAMA_ADAPTER_BYTES == 14336


def _llama_config(vocab: int = 256) -> object:
    return transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=64,
    )


def _trace(options: StepOptions, steps: int = 2) -> tuple[object, TraceRecording]:
    built = build_hf_step(_llama_config(), options)
    return built, trace_step(built.step_fn, *built.track, steps=steps)


def _gradient_modules(recording: TraceRecording, step: int) -> set[str]:
    return {
        str(dict(e.tags).get("module"))
        for e in recording.step_events(step)
        if e.action == "alloc" and dict(e.tags).get("category") == "gradient"
    }


def test_llama_adapters_gradients_and_adamw_states_counted_by_hand():
    """Llama's default targets (q_proj, v_proj), r=8: gradients r*(in+out)*4, AdamW twice that."""
    built, recording = _trace(StepOptions(batch_size=BATCH, seq_len=SEQ, lora=LoraOptions(r=8)))
    assert recording.allocated_bytes("gradient", step=1) == LLAMA_ADAPTER_BYTES
    assert recording.allocated_bytes("optimizer_state", step=0) == 2 * LLAMA_ADAPTER_BYTES
    assert recording.allocated_bytes("optimizer_state", step=1) == 0
    assert "+ LoRA r8" in built.description


def test_frozen_base_weights_get_no_gradient_or_state():
    """Every gradient belongs to a lora_A / lora_B module; the optimizer holds only adapters."""
    built, recording = _trace(StepOptions(batch_size=BATCH, seq_len=SEQ, lora=LoraOptions(r=4)))
    modules = _gradient_modules(recording, 1)
    assert len(modules) == 2 * 2 * LAYERS  # (A, B) x (q_proj, v_proj) x layers
    assert all(".lora_A." in m or ".lora_B." in m for m in modules)
    optimizer = built.track[1]
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == 2 * 4 * (
        (64 + 64) + (64 + 32)
    )


def test_gpt2_preset_adapts_c_attn_by_peft_default():
    """GPT-2 124M preset: peft's gpt2 default c_attn (768 -> 2304), 12 layers, r=8, fp32."""
    options = StepOptions(batch_size=1, seq_len=16, lora=LoraOptions(r=8))
    built = build_preset_step("gpt2-124m", options)
    recording = trace_step(built.step_fn, *built.track, steps=2)
    adapter_bytes = 12 * 8 * (768 + 2304) * 4
    assert recording.allocated_bytes("gradient", step=1) == adapter_bytes == 1_179_648
    assert recording.allocated_bytes("optimizer_state", step=0) == 2 * adapter_bytes


def test_dropout_adds_its_output_and_bool_mask_per_adapter():
    """lora_dropout 0.1: each adapter's input is dropped: output B*T*in*4 bytes + 1-byte mask."""
    _, plain = _trace(StepOptions(batch_size=BATCH, seq_len=SEQ, lora=LoraOptions()))
    _, dropped = _trace(
        StepOptions(batch_size=BATCH, seq_len=SEQ, lora=LoraOptions(dropout=0.1))
    )

    def dropout_allocs(recording: TraceRecording) -> list[int]:
        return [
            e.size
            for e in recording.step_events(1)
            if e.action == "alloc"
            and dict(e.tags).get("phase") == "forward"
            and "lora_dropout" in str(dict(e.tags).get("module"))
        ]

    elements = BATCH * SEQ * HIDDEN  # q_proj and v_proj both read the 64-wide hidden state
    assert dropout_allocs(plain) == []
    assert sorted(dropout_allocs(dropped)) == [elements] * 4 + [elements * 4] * 4
    forward = dropped.allocated_bytes(phase="forward", step=1) - plain.allocated_bytes(
        phase="forward", step=1
    )
    assert forward == 2 * LAYERS * elements * (4 + 1)


def test_modules_to_save_trains_a_full_copy():
    """modules_to_save=lm_head adds its trainable copy's gradient (vocab 256 x 64 fp32)."""
    options = StepOptions(
        batch_size=BATCH, seq_len=SEQ, lora=LoraOptions(modules_to_save=("lm_head",))
    )
    _, recording = _trace(options)
    assert recording.allocated_bytes("gradient", step=1) == LLAMA_ADAPTER_BYTES + 256 * 64 * 4


def test_dora_adds_a_magnitude_vector_per_adapted_layer():
    """DoRA runs on meta: one magnitude per output feature of each adapted layer (64 + 32)."""
    _, recording = _trace(StepOptions(batch_size=BATCH, seq_len=SEQ, lora=LoraOptions(dora=True)))
    magnitudes = LAYERS * (64 + KV_OUT) * 4
    assert recording.allocated_bytes("gradient", step=1) == LLAMA_ADAPTER_BYTES + magnitudes


def test_adapters_stay_fp32_on_a_bf16_base():
    """peft's autocast_adapter_dtype: on a pure-bf16 base the adapters are fp32 (4 bytes)."""
    options = StepOptions(batch_size=BATCH, seq_len=SEQ, precision="bf16", lora=LoraOptions())
    built, recording = _trace(options)
    assert recording.allocated_bytes("gradient", step=1) == LLAMA_ADAPTER_BYTES
    base = built.track[0].model.layers[0].self_attn.q_proj.base_layer.weight
    assert str(base.dtype) == "torch.bfloat16"


def test_explicit_targets_and_refusals():
    """Targets name the layers; a preset peft has no defaults for, or a typo, is refused."""
    options = StepOptions(batch_size=1, seq_len=16, lora=LoraOptions(targets=("k_proj",)))
    built = build_hf_step(_llama_config(), options)
    trainable = sum(p.numel() for p in built.track[0].parameters() if p.requires_grad)
    assert trainable == LAYERS * 8 * (64 + KV_OUT)
    resnet = StepOptions(batch_size=2, image_size=32, lora=LoraOptions())
    with pytest.raises(OomkitError, match="no default LoRA targets for ResNet"):
        build_preset_step("resnet50", resnet)
    typo = StepOptions(batch_size=1, seq_len=16, lora=LoraOptions(targets=("qq_proj",)))
    with pytest.raises(OomkitError, match="peft could not add LoRA adapters"):
        build_preset_step("gpt2-124m", typo)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"r": 0}, "r must be a positive integer"),
        ({"alpha": 1.5}, "alpha must be a positive integer"),
        ({"dropout": 1.0}, r"dropout must be a probability in \[0, 1\)"),
        ({"targets": ()}, "targets must be module names"),
        ({"modules_to_save": ["lm_head", ""]}, "modules_to_save must be module names"),
    ],
)
def test_bad_lora_options_are_refused(kwargs, message):
    """Each bad LoraOptions value is a ValueError naming the field and an example."""
    with pytest.raises(ValueError, match=message):
        LoraOptions(**kwargs)


def test_lora_options_read_back_from_a_saved_mapping():
    """A saved workload's mapping (JSON lists) becomes the same LoraOptions; unknown keys fail."""
    lora = LoraOptions(r=16, targets=("q_proj", "v_proj"), dropout=0.05)
    saved = {"r": 16, "alpha": 8, "targets": ["q_proj", "v_proj"], "dropout": 0.05,
             "modules_to_save": [], "dora": False}
    assert lora_options_from(saved) == lora
    assert StepOptions(lora=saved).lora == lora
    assert LoraOptions(targets="q_proj, v_proj").targets == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="unknown LoRA option"):
        lora_options_from({"rank": 8})


def test_importing_peft_keeps_torchaos_import_log_lines_out_of_the_terminal(
    tmp_path, monkeypatch, caplog
):
    """peft imports torchao where it is installed, and torchao logs "Failed to load ..._C_*.so"
    at WARNING on a machine without its CUDA kernels: a LoRA prediction printed those lines on
    stderr. _peft() imports peft with torchao's loggers quiet (a stand-in peft that logs as
    torchao does on import; the levels are restored after)."""
    import logging
    import sys

    from oomkit.prediction.models.lora import _peft

    (tmp_path / "peft.py").write_text(
        "import logging\n"
        "logging.getLogger('torchao').warning('Failed to load _C_mxfp8.so')\n"
        "logging.getLogger('torch.utils._pytree').warning('register_constant is deprecated')\n"
        "logging.getLogger('torchao').error('a real error')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "peft", raising=False)
    before = logging.getLogger("torchao").level
    with caplog.at_level(logging.WARNING):
        module = _peft()
    assert module.__file__ == str(tmp_path / "peft.py")
    assert [r.getMessage() for r in caplog.records] == ["a real error"]
    assert logging.getLogger("torchao").level == before


def test_adapters_are_made_on_meta_not_initialised_on_the_host(monkeypatch):
    """peft makes each adapter's nn.Linear on the default device and initialises it before
    moving it to the base layer's: on the host, a 1e9-wide layer's lora_A (32 GB) had ended a
    prediction with a CPU allocation failure. Every initialised weight is now on meta (the
    layers here are 2**24 wide: 512 MB on the host if that came back, not a machine's memory)."""
    import torch

    from oomkit.prediction.models.lora import apply_lora

    devices = []
    kaiming = torch.nn.init.kaiming_uniform_

    def watched(tensor, *args, **kwargs):
        devices.append(tensor.device.type)
        return kaiming(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", watched)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2**24, 8), torch.nn.Linear(8, 2**24))
    apply_lora(model, LoraOptions(r=8, targets=("0", "1")))
    assert devices and set(devices) == {"meta"}, devices
    assert {p.device.type for p in model.parameters()} == {"meta"}
