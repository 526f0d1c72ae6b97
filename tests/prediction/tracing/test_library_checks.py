"""Library checks that read a mask (transformers' SDPA skip, nn.Transformer's causal test) are
answered from what the user passed, with the same bytes as the path they pick."""

from __future__ import annotations

import contextlib

import pytest
from _tiny_hf import tiny_llama_config

torch = pytest.importorskip("torch")

from oomkit.core.target import Target  # noqa: E402
from oomkit.prediction import predict_recording  # noqa: E402
from oomkit.prediction.tracing import trace_step, value_tracking  # noqa: E402


def _peaks(recording):
    p = predict_recording(recording, target=Target.resolve("h100"))
    return p.peak_allocated_bytes, p.peak_reserved_bytes


def _encoder_step(mask: bool, is_causal):
    with value_tracking(), torch.device("meta"):
        layer = torch.nn.TransformerEncoderLayer(
            d_model=64, nhead=4, dim_feedforward=128, batch_first=True, dropout=0.0
        )
        model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        x = torch.randn(4, 32, 64)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(32)

    def step(model, x, causal):
        y = model(x, mask=causal if mask else None, is_causal=is_causal)
        y.square().mean().backward()

    return trace_step(step, model, x, causal, steps=2)


def test_transformer_encoder_causal_mask_is_detected_as_the_hint_says():
    """A triu(-inf) mask without is_causal records what is_causal=True records, and says why."""
    detected = _encoder_step(mask=True, is_causal=None)
    hinted = _encoder_step(mask=True, is_causal=True)
    assert _peaks(detected) == _peaks(hinted)
    (key,) = [k for k in detected.assumptions if "_detect_is_causal_mask" in k]
    assert key.startswith("read at transformer.py:")
    assert detected.assumptions[key] == (
        "bool() = True, computed from the values your tensors were created with "
        "(torch.full); 2 time(s)"
    )
    assert not any(k.startswith("read at") for k in hinted.assumptions)


def test_an_unknown_mask_is_refused_inside_torch_with_library_advice():
    """A mask built outside value tracking cannot be read: an error naming torch's line."""
    from oomkit.errors import DataDependentValueError

    with torch.device("meta"):
        layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        x = torch.randn(2, 8, 16)
        unknown = torch.randn(8, 8)

    with pytest.raises(DataDependentValueError, match="inside a library, not yours to move"):
        trace_step(lambda m, x, mask: m(x, mask=mask), model, x, unknown)


transformers = pytest.importorskip("transformers")


def _llama_config():
    return tiny_llama_config(vocab_size=512)


def _llama_step(*, mask: bool, checkpointing: bool, batch: int = 4, seq: int = 128):
    """A user's loop as the --hf step runs it: the model's own labels= loss, outputs kept to
    the end of the step, AdamW."""
    with value_tracking(), torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            _llama_config(), attn_implementation="sdpa"
        )
        if checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.train()
        optimizer = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, 512, (batch, seq))
        labels = torch.randint(0, 512, (batch, seq))
        attention_mask = torch.ones(batch, seq, dtype=torch.long)

    def step(*_tracked):
        extra = {"attention_mask": attention_mask} if mask else {}
        outputs = model(input_ids=ids, labels=labels, **extra)  # ForCausalLMLoss inside
        outputs.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del outputs  # as --hf's step: the outputs live to the end of the step

    return trace_step(step, model, optimizer, ids, labels, attention_mask, steps=3)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_all_ones_attention_mask_takes_the_no_mask_path(checkpointing):
    """transformers skips an all-ones mask for SDPA's is_causal: same bytes as no mask."""
    masked = _llama_step(mask=True, checkpointing=checkpointing)
    unmasked = _llama_step(mask=False, checkpointing=checkpointing)
    assert _peaks(masked) == _peaks(unmasked)
    (key,) = [k for k in masked.assumptions if k.startswith("read at masking_utils.py:")]
    assert key.endswith(" in _ignore_causal_mask_sdpa")
    assert masked.assumptions[key].startswith(
        "bool() = True, computed from the values your tensors were created with (torch.ones)"
    )


def test_the_user_loop_matches_the_hf_builder_on_the_same_config():
    """The user's from_config loop with an all-ones mask gives --hf's bytes plus its mask.

    Same loss path as the --hf step (the model's labels= loss, outputs kept to the end of the
    step): the one difference is the user's attention mask, an int64 input of batch x seq
    (4 x 128 x 8 bytes).
    """
    from oomkit.prediction.models import StepOptions, build_hf_step

    built = build_hf_step(_llama_config(), StepOptions(batch_size=4, seq_len=128))
    hf = trace_step(built.step_fn, *built.track, steps=3)
    user = _llama_step(mask=True, checkpointing=False)
    (user_allocated, user_reserved), (hf_allocated, hf_reserved) = _peaks(user), _peaks(hf)
    assert user_allocated == hf_allocated + 4 * 128 * 8
    assert user_reserved == hf_reserved


def test_a_mask_made_outside_tracking_is_refused_then_answered_by_a_stated_value():
    """oomkit.predict with a mask it cannot follow: refused naming transformers' line; with
    values={'masking_utils.py:LINE': 1} it predicts the bytes of a followed mask."""
    import oomkit
    from oomkit.errors import DataDependentValueError

    def build(tracked: bool):
        with value_tracking() if tracked else contextlib.nullcontext(), torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(
                _llama_config(), attn_implementation="sdpa"
            )
            ids = torch.randint(0, 512, (2, 64))
            mask = torch.ones(2, 64, dtype=torch.long)
        return model, ids, mask

    def step(model, ids, mask):
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()

    with pytest.raises(DataDependentValueError) as raised:
        oomkit.predict(step, *build(tracked=False), steps=1)
    message = str(raised.value)
    assert "masking_utils.py:" in message and "in _ignore_causal_mask_sdpa" in message
    assert "The read is inside a library, not yours to move" in message
    key = message.split("--value ")[1].split("=NUMBER")[0]
    stated = oomkit.predict(step, *build(tracked=False), steps=1, values={key: 1})
    followed = oomkit.predict(step, *build(tracked=True), steps=1)
    assert stated.peak_allocated_bytes == followed.peak_allocated_bytes
    assert stated.assumptions[f"read at {key} in _ignore_causal_mask_sdpa"] == (
        "bool() = True, as stated (--value / values=); 1 time(s)"
    )
