"""Context parallel: the sequence split over cp ranks, torch's ring flash attention, in bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomkit.core.gpus import get_gpu
from oomkit.errors import ConfigError
from oomkit.prediction.models import StepOptions, context_parallel
from oomkit.prediction.models.llama import LlamaShape
from oomkit.prediction.models.presets import ModelPreset
from oomkit.prediction.tracing.distributed import trace_distributed_step

_SHAPE = LlamaShape(
    hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256, tied=False,
    positions=128,
)
_SEQ = 64


@pytest.fixture
def tiny(monkeypatch):
    """build_cp_preset_step builds the tiny Llama whatever preset it is named."""
    preset = ModelPreset("tiny", "Tiny Llama", _SHAPE, _SEQ, "test", default_precision="bf16")
    monkeypatch.setattr(context_parallel, "shaped_preset", lambda name, options: preset)


@pytest.fixture(scope="module")
def _made():
    """(cp, fsdp) -> (recording, built step) of the default sequence, already recorded."""
    return {}


@pytest.fixture
def recorded(tiny, _made):
    """``_record`` of the default sequence, made once per layout for the tests that read the
    same recording (CP 2 alone is read by three, CP 1 by two)."""

    def get(cp, fsdp=1):
        if (cp, fsdp) not in _made:
            _made[(cp, fsdp)] = _record(cp, fsdp)
        return _made[(cp, fsdp)]

    return get


def _record(cp, fsdp=1, seq=_SEQ):
    options = StepOptions(batch_size=2, seq_len=seq, precision="bf16")
    sizes = ((fsdp,) if fsdp > 1 else ()) + (cp,)
    names = (("fsdp",) if fsdp > 1 else ()) + ("cp",)
    built = []

    def build(mesh):
        step = context_parallel.build_cp_preset_step("tiny", options, mesh)
        built.append(step)
        return step.step_fn, step.track

    recording = trace_distributed_step(
        build, world_size=cp * fsdp, mesh_shape=(sizes, names), gpu=get_gpu("h100")
    )
    return recording, built[0]


def _activation_bytes_by_module(recording):
    out: dict[str, int] = {}
    for event in recording.events:
        if event.action == "alloc" and event.tag("category") == "activation":
            module = event.tag("module") or ""
            out[module] = out.get(module, 0) + event.size
    return out


def test_cp_2_halves_the_activations_outside_attention(recorded):
    """Norms and MLP layers see seq / 2 tokens a rank: exactly half their CP 1 bytes."""
    whole = _activation_bytes_by_module(recorded(1)[0])
    halved, built = recorded(2)
    half = _activation_bytes_by_module(halved)
    for module in ("layers.0.input_layernorm", "layers.0.post_attention_layernorm",
                   "layers.0.mlp", "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj",
                   "layers.1.mlp"):
        assert whole[module] > 0
        assert half[module] * 2 == whole[module], module
    assert "32 of 64 tokens a rank" in built.description


def test_ring_attention_all_gathers_k_and_v(recorded):
    """The default rotation all-gathers the concatenated local K and V once per attention
    forward: cp x (2 x batch x kv_heads x seq/cp x head_dim) bf16 elements."""
    recording, _ = recorded(2)
    head_dim = _SHAPE.hidden // _SHAPE.heads
    local_kv = 2 * 2 * _SHAPE.kv_heads * (_SEQ // 2) * head_dim * 2
    gathered = [
        e.size for e in recording.events
        if e.action == "alloc" and e.tag("op") == "_c10d_functional.all_gather_into_tensor.default"
        and (e.tag("module") or "").endswith("self_attn")
    ]
    assert gathered and set(gathered) == {2 * local_kv}


def test_fsdp_shards_over_fsdp_times_cp(recorded):
    """FSDP2 shards over FSDP x CP ranks, CP alone included (torchtitan's fsdp mesh is
    dp_shard x cp): CP 1 keeps whole parameters, CP 2 halves them, FSDP 2 x CP 2 quarters."""
    sharded, built = recorded(2, fsdp=2)

    def parameter_bytes(rec):
        before = rec.events[: rec.step_starts[0]]
        return sum(e.size for e in before if e.tag("category") == "parameter")

    whole = parameter_bytes(recorded(1)[0])
    assert 2 * parameter_bytes(recorded(2)[0]) == whole
    assert 4 * parameter_bytes(sharded) == whole
    assert "FSDP2 over 4 ranks (fsdp x cp" in built.description


@given(cp=st.integers(1, 16), seq=st.integers(1, 4096))
def test_cp_must_split_the_sequence_into_2cp_chunks(cp, seq):
    """A sequence 2 x cp divides passes; any other is refused, naming a --seq that works."""
    if seq % (2 * cp) == 0:
        context_parallel.check_cp_divides(cp, seq, "Tiny")
    else:
        with pytest.raises(ConfigError, match=f"not a multiple of {2 * cp}") as info:
            context_parallel.check_cp_divides(cp, seq, "Tiny")
        suggested = int(str(info.value).rsplit("--seq ", 1)[1])
        assert suggested % (2 * cp) == 0
