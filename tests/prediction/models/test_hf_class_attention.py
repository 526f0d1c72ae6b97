"""build_hf_step builds what the user builds: the class from architectures / hf_class, the
config's or the option's attention implementation (FlashAttention-2 and flex attention emulated
from their kernels), and a config with a size below 1 is refused naming the field."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from _tiny_hf import tiny_bert_config, tiny_llama_config
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from oomkit.errors import ConfigError, OomkitError  # noqa: E402
from oomkit.prediction.models import StepOptions, build_hf_step  # noqa: E402
from oomkit.prediction.models.hf import MAX_HF_LAYERS  # noqa: E402
from oomkit.prediction.tracing import trace_step  # noqa: E402
from oomkit.prediction.workload import WorkloadSpec, workload_from_json, workload_to_json  # noqa: E402

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 2, 64, 4, 2, 16, 2
FLASH_OP = "aten._scaled_dot_product_flash_attention.default"
FLASH_BACKWARD_OP = "aten._scaled_dot_product_flash_attention_backward.default"


def _allocs(recording):
    return [e for e in recording.events if e.action == "alloc"]


def _trace(config, **options):
    built = build_hf_step(config, StepOptions(batch_size=BATCH, seq_len=SEQ, **options))
    return built, trace_step(built.step_fn, *built.track, steps=1)


def test_architectures_picks_the_sequence_classifier_and_its_labels():
    """architectures ['BertForSequenceClassification'] builds that class (a 3-way head, not a
    1,000-way MLM head); its labels are [batch] int64 class ids (16 bytes), the ids 1,024."""
    config = tiny_bert_config(architectures=["BertForSequenceClassification"], num_labels=3)
    built, recording = _trace(config)
    model = built.track[0]
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.classifier.out_features == 3
    inputs = sorted(e.size for e in _allocs(recording) if e.tag("category") == "input")
    assert inputs == [BATCH * 8, BATCH * SEQ * 8]
    # No [batch, seq, vocab] logits anywhere: no masked-LM head ran.
    assert not any(e.size == BATCH * SEQ * 1000 * 4 for e in _allocs(recording))


def test_without_architectures_an_encoder_is_still_a_masked_lm():
    """No architectures: today's choice (an encoder as a masked LM, AutoModelForMaskedLM)."""
    built = build_hf_step(tiny_bert_config(), StepOptions(batch_size=BATCH, seq_len=SEQ))
    assert type(built.track[0]).__name__ == "BertForMaskedLM"


@pytest.mark.parametrize("name", ["AutoModelForTokenClassification", "BertForTokenClassification"])
def test_hf_class_overrides_the_config(name):
    """hf_class (auto or concrete) wins over architectures: a token classifier, whose labels
    are [batch, seq] int64 (1,024 bytes, like the ids)."""
    config = tiny_bert_config(architectures=["BertForSequenceClassification"], num_labels=5)
    built, recording = _trace(config, hf_class=name)
    assert type(built.track[0]).__name__ == "BertForTokenClassification"
    inputs = sorted(e.size for e in _allocs(recording) if e.tag("category") == "input")
    assert inputs == [BATCH * SEQ * 8, BATCH * SEQ * 8]


@pytest.mark.parametrize(
    ("name", "match"),
    [("AutoModelForWhatever", "hf_class 'AutoModelForWhatever'"), ("BertModel", "'BertModel'")],
)
def test_unknown_hf_class_is_a_config_error(name, match):
    """A class transformers lacks, or one whose task oomkit does not model, names hf_class."""
    with pytest.raises(ConfigError, match=match):
        build_hf_step(tiny_bert_config(), StepOptions(batch_size=1, seq_len=8, hf_class=name))


def test_hf_class_must_be_a_name():
    """StepOptions refuses an hf_class that is no identifier."""
    with pytest.raises(ValueError, match="StepOptions.hf_class must be a transformers class"):
        StepOptions(hf_class="Auto Model")


def _attention_matrices(recording):
    """Forward activations of exactly one fp32 [batch, heads, seq, seq] matrix."""
    size = BATCH * HEADS * SEQ * SEQ * 4
    return [
        e.tag("op") for e in _allocs(recording)
        if e.size == size and e.tag("phase") == "forward" and e.tag("category") == "activation"
    ]


def test_config_eager_attention_keeps_the_attention_matrices():
    """attn_implementation 'eager' in the config is honoured: each layer saves its softmax
    output and its dropout output, 131,072 bytes each (2 x 4 x 64 x 64 fp32); SDPA (the
    option overriding the config) saves none."""
    eager_config = tiny_bert_config(architectures=["BertForSequenceClassification"],
                                    attn_implementation="eager")
    built, eager = _trace(eager_config)
    assert built.track[0].config._attn_implementation == "eager"
    assert "eager attention" in built.description
    assert Counter(_attention_matrices(eager)) == {
        "aten._softmax.default": LAYERS,
        "aten.native_dropout.default": LAYERS,
    }
    _, sdpa = _trace(eager_config, attn_implementation="sdpa")
    assert _attention_matrices(sdpa) == []


@pytest.mark.parametrize("architectures", [["Gemma2ForCausalLM"], None])
def test_a_model_without_sdpa_runs_eager_as_transformers_defaults(architectures):
    """Gemma 2 does not support SDPA (its softcapping: modeling_gemma2.py _supports_sdpa =
    False): with no attention asked, transformers builds it eager, and so does oomkit, by its
    class or through the auto class. oomkit had asked for sdpa, which transformers refuses."""
    config = transformers.Gemma2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=1000,
        architectures=architectures,
    )
    built, recording = _trace(config, precision="fp32")
    assert built.track[0].config._attn_implementation == "eager"
    assert "eager attention" in built.description
    # Eager attention saves each layer's softmax output ([b, h, s, s] fp32: 2 x 4 x 64 x 64).
    softmax = [e for e in _allocs(recording) if e.tag("op") == "aten._softmax.default"]
    assert len(softmax) >= LAYERS and {e.size for e in softmax} == {BATCH * HEADS * SEQ * SEQ * 4}


def test_flash_attention_2_allocates_what_flash_attn_does():
    """FlashAttention-2 on a GQA Llama in bf16: per layer the forward saves out (bf16 [b, s,
    h, d]: 16,384 B) and softmax_lse (fp32 [b, h, s]: 2,048 B); backward makes dq (16,384),
    dk and dv at the 2 key/value heads (8,192 each), softmax_d (fp32 [b, h, round128(s)]:
    4,096), dq_accum (fp32 [b, round128(s), h, round32(d)]: 131,072) and dk/dv expanded to the
    query's heads (16,384 each)."""
    _, recording = _trace(tiny_llama_config(), attn_implementation="flash_attention_2",
                          precision="bf16")
    forward = Counter(e.size for e in _allocs(recording) if e.tag("op") == FLASH_OP)
    out = BATCH * SEQ * HEADS * HEAD_DIM * 2
    lse = BATCH * HEADS * SEQ * 4
    assert forward[out] == LAYERS and forward[lse] == LAYERS
    backward = Counter(
        (e.size, e.tag("emulated")) for e in _allocs(recording) if e.tag("op") == FLASH_BACKWARD_OP
    )
    assert backward == {
        (out, None): LAYERS,  # dq
        (BATCH * SEQ * KV_HEADS * HEAD_DIM * 2, None): 2 * LAYERS,  # dk, dv
        (BATCH * HEADS * 128 * 4, "flash_softmax_d"): LAYERS,
        (BATCH * 128 * HEADS * 32 * 4, "flash_dq_accum"): LAYERS,
        (out, "flash_dk_expanded"): LAYERS,
        (out, "flash_dv_expanded"): LAYERS,
    }


def test_flex_attention_allocates_logsumexp_and_delta():
    """flex attention: per layer the forward template writes logsumexp and max_scores (fp32
    [b, h, s]: 2,048 B each), the backward delta (2,048 B); no attention matrix."""
    _, recording = _trace(tiny_llama_config(), attn_implementation="flex_attention",
                          precision="bf16")
    lse = BATCH * HEADS * SEQ * 4
    made = Counter(
        (e.tag("phase"), e.size) for e in _allocs(recording) if e.tag("op") == "aten.new_empty.default"
    )
    assert made[("forward", lse)] == 2 * LAYERS
    assert made[("backward", lse)] == LAYERS
    assert made[("forward", BATCH * HEADS * SEQ * HEAD_DIM * 2)] == LAYERS  # out, bf16
    matrix = BATCH * HEADS * SEQ * SEQ
    assert not any(e.size in (2 * matrix, 4 * matrix) for e in _allocs(recording))


def test_flash_attention_2_in_fp32_is_refused():
    """flash_attn runs fp16/bf16 only: fp32 is a ConfigError saying what to use."""
    with pytest.raises(ConfigError, match="FlashAttention-2 runs in fp16 or bf16 only"):
        build_hf_step(tiny_llama_config(), StepOptions(
            batch_size=1, seq_len=8, precision="fp32", attn_implementation="flash_attention_2"))


def test_attn_implementation_is_a_choice():
    """StepOptions refuses an attention implementation oomkit does not model."""
    with pytest.raises(ValueError, match="StepOptions.attn_implementation must be one of eager"):
        StepOptions(attn_implementation="paged")


@pytest.mark.parametrize(
    ("field", "value"),
    [("hidden_size", -64), ("num_hidden_layers", 0), ("vocab_size", -1),
     ("num_attention_heads", 0), ("max_position_embeddings", -128)],
)
def test_config_sizes_below_one_name_the_field(field, value):
    """Issue 36: a zero or negative size is a ConfigError naming the field, before building."""
    config = tiny_bert_config()
    setattr(config, field, value)
    with pytest.raises(ConfigError, match=f"the Hugging Face config's {field} must be a positive"):
        build_hf_step(config, StepOptions(batch_size=1, seq_len=8))


def test_the_workload_record_keeps_class_and_attention():
    """hf_class and attn_implementation are saved and read back (explain rebuilds the same)."""
    spec = WorkloadSpec("hf", "cfg", batch_size=2, hf_class="AutoModelForSequenceClassification",
                        attn_implementation="eager")
    saved = workload_to_json(spec)
    assert saved["options"]["hf_class"] == "AutoModelForSequenceClassification"
    back = workload_from_json({"workload": saved})
    assert (back.hf_class, back.attn_implementation) == (
        "AutoModelForSequenceClassification", "eager")
    plain = workload_to_json(WorkloadSpec("hf", "cfg", batch_size=2))
    assert "hf_class" not in plain["options"] and "attn_implementation" not in plain["options"]


def test_presets_refuse_hugging_face_only_options():
    """A preset is its own class running SDPA: hf_class or eager attention is refused."""
    from oomkit.errors import OomkitError
    from oomkit.prediction.models import build_preset_step

    with pytest.raises(OomkitError, match="the presets are their own classes and run SDPA"):
        build_preset_step("gpt2-124m", StepOptions(attn_implementation="eager"))
    with pytest.raises(OomkitError, match="StepOptions.hf_class and attn_implementation"):
        build_preset_step("gpt2-124m", StepOptions(hf_class="AutoModelForCausalLM"))


@pytest.mark.parametrize("key", ["attn_implementation", "_attn_implementation"])
def test_a_saved_config_json_names_class_and_attention(tmp_path, key):
    """A config.json as Trainer runs save it (architectures, and attn_implementation under
    either key) builds that class with eager attention."""
    import json

    saved = json.loads(tiny_bert_config(architectures=["BertForSequenceClassification"],
                                        num_labels=2).to_json_string())
    saved[key] = "eager"
    (tmp_path / "config.json").write_text(json.dumps(saved))
    built = build_hf_step(tmp_path, StepOptions(batch_size=1, seq_len=8))
    model = built.track[0]
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config._attn_implementation == "eager"
    assert "eager attention" in built.description


@settings(max_examples=20, deadline=None)
@given(layers=st.integers(MAX_HF_LAYERS + 1, 10**12))
def test_a_layer_count_past_the_bound_is_refused_before_building(layers):
    """Every layer is built and recorded: a config naming a million had run for hours."""
    config = tiny_bert_config()
    config.num_hidden_layers = layers
    with pytest.raises(ConfigError, match=f"num_hidden_layers is {layers}: oomkit builds"):
        build_hf_step(config, StepOptions(batch_size=1, seq_len=8))


def test_a_config_its_own_validators_refuse_is_one_oomkit_error(tmp_path):
    """transformers 5 validates a config as it loads (huggingface_hub's StrictDataclassError,
    no ValueError): a traceback and exit 1 before; now an OomkitError with the validator's
    words."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 60, "num_hidden_layers": 1,
        "num_attention_heads": 8, "vocab_size": 32}))
    try:
        transformers.AutoConfig.from_pretrained(str(tmp_path))
    except ValueError:
        pytest.skip("this transformers refuses it with a ValueError (caught before too)")
    except Exception:  # noqa: BLE001 - the validator's own error, as transformers 5 raises it
        pass
    else:
        pytest.skip("this transformers takes the config")
    with pytest.raises(OomkitError, match="could not load the Hugging Face config .* not a "
                                          "multiple of the number of attention heads"):
        build_hf_step(str(tmp_path), StepOptions(batch_size=1, seq_len=8))
