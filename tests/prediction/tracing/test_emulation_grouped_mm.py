"""``_grouped_mm`` outside bfloat16 as CUDA's fallback allocates it (emulations/grouped_mm.py):
the output alone, its last dimension's stride padded to 16 bytes; meta had refused it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.target import Target
from oomkit.errors import UnsupportedOpError
from oomkit.prediction.tracing import trace_step

torch = pytest.importorskip("torch")

H100 = Target.resolve("h100")


def _outputs(a, b, offs=None, **kwargs):
    """The step's requests (bytes) and the output's shape, stride and dtype."""
    seen = {}

    def step(*inputs):
        out = torch._grouped_mm(*inputs, **kwargs)
        seen["out"] = (tuple(out.shape), out.stride(), out.dtype)

    inputs = (a, b) if offs is None else (a, b, offs)
    recording = trace_step(step, *inputs, target=H100)
    start = recording.step_starts[0]
    sizes = [e.size for e in recording.events[start:] if e.action == "alloc"]
    return sizes, seen["out"]


def _meta(*sizes, dtype=torch.float32):
    return torch.empty(*sizes, device="meta", dtype=dtype)


def _offsets(groups):
    return torch.empty(groups, device="meta", dtype=torch.int32)


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 64),
    k=st.sampled_from([16, 32, 64]),
    n=st.integers(1, 40),
    groups=st.integers(1, 8),
    dtype=st.sampled_from([torch.float32, torch.float16]),
)
def test_tokens_by_experts_is_one_padded_output(tokens, k, n, groups, dtype):
    """2-D x 3-D (the MoE experts): [tokens, N] in the input's dtype, rows padded to 16 bytes;
    one request of its storage's bytes."""
    sizes, (shape, stride, out_dtype) = _outputs(
        _meta(tokens, k, dtype=dtype), _meta(groups, n, k, dtype=dtype).transpose(-2, -1),
        _offsets(groups),
    )
    per_row = -(-n * dtype.itemsize // 16) * 16 // dtype.itemsize  # elements, padded
    assert (shape, stride, out_dtype) == ((tokens, n), (per_row, 1), dtype)
    assert sizes == [((tokens - 1) * per_row + n) * dtype.itemsize]


def test_the_other_layouts_and_bfloat16():
    """3-D x 3-D is a padded batch of matmuls, 2-D x 2-D one matrix a group; bf16 keeps meta's
    own kernel, which gives the same layout."""
    sizes, out = _outputs(_meta(3, 5, 16), _meta(3, 16, 6))
    assert out == ((3, 5, 6), (5 * 8, 8, 1), torch.float32)  # 6 floats padded to 8
    assert sizes == [(2 * 40 + 4 * 8 + 6) * 4]
    sizes, out = _outputs(_meta(7, 32), _meta(32, 12).t().contiguous().t(), _offsets(4))
    assert out == ((4, 7, 12), (7 * 12, 12, 1), torch.float32)
    bf16 = _outputs(_meta(8, 16, dtype=torch.bfloat16),
                    _meta(2, 24, 16, dtype=torch.bfloat16).transpose(-2, -1), _offsets(2))
    assert bf16[1] == ((8, 24), (24, 1), torch.bfloat16)


@pytest.mark.parametrize(
    ("inputs", "kwargs", "said"),
    [
        ((_meta(4, 16), _meta(2, 16, 8), _offsets(2)), {"out_dtype": torch.float16},
         "Grouped gemm output dtype must match `mat_a` dtype"),
        ((_meta(4, 16), _meta(2, 16, 8)), {}, "Have to provide offsets if there is a 2d"),
        ((_meta(4, 16, dtype=torch.float64), _meta(2, 16, 8, dtype=torch.float64),
          _offsets(2)), {}, "Expected mat_a and mat_b to be Float32, BFloat16 or Float16"),
    ],
)
def test_what_cuda_refuses_is_refused_in_its_words(inputs, kwargs, said):
    """An output dtype other than mat_a's, a missing offset for a 2-D input, float64: the CUDA
    kernel's message (GroupedMMUtils.h), not meta's request for bfloat16."""
    with pytest.raises(UnsupportedOpError, match=said):
        _outputs(*inputs, **kwargs)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_mixture_of_experts_trains_in_fp32_and_under_autocast(precision):
    """transformers' Mixtral routes its experts through grouped_mm (its default
    experts_implementation); autocast leaves it in fp32. The step records, with fp32 expert
    outputs of [tokens x top-k, 2 x expert width] (gate and up) each layer."""
    transformers = pytest.importorskip("transformers")
    from oomkit.prediction.models import StepOptions, build_hf_step

    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=500,
    )
    built = build_hf_step(config, StepOptions(batch_size=2, seq_len=16, precision=precision))
    recording = trace_step(built.step_fn, *built.track, steps=1, target=H100)
    grouped = [e for e in recording.events
               if e.action == "alloc" and e.tag("op") == "aten._grouped_mm.default"]
    gate_up = 2 * 16 * 2 * (2 * 96) * 4  # 64 token-expert rows x 192 fp32 columns
    assert sum(e.size == gate_up for e in grouped) >= 2  # forward, each of the 2 layers
