"""torch.compile recorded GPU-free on Hugging Face models: constants, graph breaks, saved bytes."""

from __future__ import annotations

import pytest
import torch

from oomkit.prediction.models import StepOptions
from oomkit.prediction.tracing.compiled import GRAPH_BREAKS
from oomkit.prediction.tracing.step_runner import trace_step

transformers = pytest.importorskip("transformers")

# torch.float32 bytes per element.
F32 = 4


def _allocs(recording, op=None):
    return [
        (event.size, dict(event.tags).get("op"), dict(event.tags).get("category"))
        for event in recording.events
        if event.action == "alloc" and (op is None or dict(event.tags).get("op") == op)
    ]


def _constant_step(elements):
    with torch.device("meta"):
        x = torch.randn(4, elements, requires_grad=True)

    def scaled(t):
        # Lifted out of the traced code: a get_attr constant of the AOTAutograd graph.
        c = torch.tensor([float(i) for i in range(elements)], device=t.device)
        return (t * 2) * c

    compiled = torch.compile(scaled)

    def step(*_tracked):
        compiled(x).sum().backward()

    return step, x


def test_a_lifted_tensor_constant_is_a_constant_not_a_kernel():
    """A torch.tensor made inside a compiled step is read from the graph module (get_attr), not
    called: 12 floats (more than Inductor inlines) are copied to the device once and held (a
    48-byte constant), and the copy saved for backward is a 48-byte buffer of the forward."""
    step, x = _constant_step(12)
    recording = trace_step(step, x, compile=True)
    assert _allocs(recording, "torch.compile constant") == [(12 * F32, "torch.compile constant", "buffer")]
    assert _allocs(recording, "prims.device_put.default") == [
        (12 * F32, "prims.device_put.default", "activation")
    ]
    assert not any("could not be compiled" in w for w in recording.warnings)
    assert "(1 backward, 1 forward)" in recording.assumptions["torch.compile"]


def test_a_small_constant_is_inlined_and_held_nowhere():
    """A constant of at most 8 elements is inlined by Inductor (graph.py get_attr): no held copy."""
    step, x = _constant_step(8)
    recording = trace_step(step, x, compile=True)
    assert _allocs(recording, "torch.compile constant") == []
    # Saved for backward: the 8-float device copy, made per call as a graph output.
    assert _allocs(recording, "prims.device_put.default") == [
        (8 * F32, "prims.device_put.default", "activation")
    ]


def test_the_recorders_modes_are_never_compiled_after_a_graph_break():
    """Code dynamo runs eagerly after a graph break calls through the recorder's modes; their
    frames are not compiled (which made the dropout emulation a third compiled graph): dropout is
    recorded as eager CUDA runs it, bool mask then output (Dropout.cu dropout_cuda), between the
    user's two graphs."""
    with torch.device("meta"):
        t = torch.randn(64, 64)

    @torch.compiler.disable(recursive=False)
    def helper(x):
        return torch.nn.functional.dropout(x, 0.5)

    compiled = torch.compile(lambda x: helper(x * 2) + 1)

    def step(*_tracked):
        compiled(t)

    recording = trace_step(step, t, compile=True)
    assert _allocs(recording, "aten.native_dropout.default") == [
        (64 * 64, "aten.native_dropout.default", "temporary"),
        (64 * 64 * F32, "aten.native_dropout.default", "temporary"),
    ]
    assumption = recording.assumptions["torch.compile"]
    assert f"(1 {GRAPH_BREAKS}, 2 inference)" in assumption


def _gpt2_block_saved_bytes(compile, batch, seq, hidden):
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(
        n_embd=hidden, n_head=2, n_layer=1, n_positions=64, vocab_size=128,
        resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        block = GPT2Block(config, layer_idx=0)
        x = torch.randn(batch, seq, hidden, requires_grad=True)
    run = torch.compile(block) if compile else block

    def step(*_tracked):
        run(x)[0].sum().backward()

    recording = trace_step(step, block, x, compile=compile)
    return sum(
        event.size
        for event in recording.events
        if event.action == "alloc"
        and dict(event.tags).get("phase") == "forward"
        and dict(event.tags).get("saved_for_backward") == "true"
    )


def test_compiled_gpt2_block_saves_fewer_bytes_than_eager():
    """gelu_new's chain saves 0.5*x, tanh(...) and 1+tanh(...) eagerly; the partitioner saves
    only the c_fc output and gelu's output and recomputes the rest in backward."""
    batch, seq, hidden = 2, 16, 32
    tokens = batch * seq
    per_layer_norm = tokens * hidden * F32 + 2 * tokens * F32  # normalised (or its input), mean, rstd
    attention = (
        tokens * 3 * hidden * F32  # c_attn output (q, k, v)
        + tokens * hidden * F32  # efficient attention's output
        + batch * 2 * 32 * F32  # its logsumexp, rows padded to 32 per head
        # (its philox seed and offset are host tensors on CUDA: attention.cu)
        + tokens * hidden * F32  # the residual sum (eager) / attention projection (compiled)
    )
    mlp_value = tokens * 4 * hidden * F32
    eager = _gpt2_block_saved_bytes(False, batch, seq, hidden)
    compiled = _gpt2_block_saved_bytes(True, batch, seq, hidden)
    assert eager == 2 * per_layer_norm + attention + 5 * mlp_value == 111_616
    assert compiled == 2 * per_layer_norm + attention + 2 * mlp_value == 62_464


def test_hf_gpt2_inference_compiles_in_one_graph():
    """A tiny HF GPT-2 inference step compiles whole (one inference graph, no break), and costs
    less than eager."""
    from transformers import GPT2Config

    from oomkit.prediction.models.hf import build_hf_step

    config = GPT2Config(n_embd=32, n_head=2, n_layer=1, n_positions=64, vocab_size=128)
    peaks = {}
    for compile in (False, True):
        options = StepOptions(batch_size=2, seq_len=16, precision="fp32", mode="inference", compile=compile)
        built = build_hf_step(config, options)
        recording = trace_step(built.step_fn, *built.track, compile=compile)
        peaks[compile] = recording.peak_allocated_bytes()
    assert "(1 inference)" in recording.assumptions["torch.compile"], recording.assumptions["torch.compile"]
    assert not any("could not be compiled" in w for w in recording.warnings)
    assert peaks[True] <= peaks[False]


def test_hf_llama_train_step_compiles_and_backpropagates():
    """A tiny HF Llama train step compiles forward and backward (its loss keeps autograd on meta,
    which the Meta kernels of CompositeImplicitAutograd ops would break) and records a backward."""
    from pathlib import Path

    from transformers import AutoConfig

    from oomkit.prediction.models.hf import build_hf_step

    # tiny-llama with one decoder layer: the second adds dynamo and AOTAutograd time, not cover.
    config = AutoConfig.from_pretrained(Path(__file__).parents[1] / "models" / "configs" / "tiny-llama")
    config.num_hidden_layers = 1
    options = StepOptions(batch_size=1, seq_len=8, precision="bf16-mixed", mode="train", compile=True)
    built = build_hf_step(config, options)
    recording = trace_step(built.step_fn, *built.track, compile=True)
    assert "(1 backward, 1 forward)" in recording.assumptions["torch.compile"]
    assert not any("could not be compiled" in w for w in recording.warnings)
    phases = {dict(e.tags).get("phase") for e in recording.events if e.action == "alloc"}
    assert {"backward", "optimizer"} <= phases


def test_a_mode_entered_before_the_recording_does_not_recompile_every_step():
    """value_tracking opened around the builder (as the CLI does) set dynamo's "inside a mode"
    flag before the recorder's modes said they ignore compile internals, so each step
    recompiled: two steps compile one forward and one backward graph."""
    from oomkit.prediction.tracing import value_tracking

    with value_tracking({}):
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU())
            x = torch.randn(4, 16)
        compiled = torch.compile(model)

        def step(*_tracked):
            compiled(x).sum().backward()

        recording = trace_step(step, model, x, compile=True, steps=2)
    assert "(1 backward, 1 forward)" in recording.assumptions["torch.compile"]


def test_a_buffer_written_in_place_takes_its_dying_inputs_block():
    """relu is planned in place of the mm output it reads last (scheduler.py
    decide_inplace_update): at run time it takes that block instead of allocating, so the graph
    holds two 16 KiB buffers at most, not three (the donor was leaked to the graph's end)."""
    with torch.device("meta"):
        a = torch.randn(64, 64)

    def chain(x):
        b = torch.mm(x, x)
        c = torch.mm(torch.relu(b), x)
        return torch.mm(c, x)

    compiled = torch.compile(chain)

    def step(*_tracked):
        with torch.no_grad():
            compiled(a)

    recording = trace_step(step, a, compile=True)
    assert _allocs(recording, "aten.relu.default") == []
    buffer = 64 * 64 * F32
    cublas_workspace = 32 * 2**20  # the emulated cuBLAS workspace of the first mm (H100)
    assert recording.peak_allocated_bytes() == buffer + cublas_workspace + 2 * buffer
