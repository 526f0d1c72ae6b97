"""`oomkit predict PRESET --compile` with --fsdp / --tp / --dp: each block compiled, as torchtitan."""

from __future__ import annotations

import pytest
from _recorded_once import tiny_llama_json

torch = pytest.importorskip("torch")

COMPILED = "each block compiled (torchtitan apply_compile: fullgraph, Inductor)"


def _command(*flags):
    """``predict`` of the tiny Llama with ``flags``, batch 1, seq 16, 2 steps, as JSON."""
    return ["predict", "llama3-8b", *flags, "--batch", "1", "--seq", "16", "--steps", "2", "--json"]


def _predict(argv):
    """The eager prediction (recorded once per process: test_hsdp_cli.py and
    test_float8_cli.py read ``--fsdp 2`` too)."""
    return tiny_llama_json(_command(*argv))


@pytest.fixture(scope="module")
def compiled_once():
    """``predict LAYOUT --compile`` of the tiny Llama (``compiled_once(*layout)``), made once
    per layout for the tests that read it: --fsdp 2 and --tp 2 are each read by two tests,
    --tp 2 --checkpointing selective-op by test_compiled_blocks_hold_fewer_activations and
    test_compiled_checkpointing_records_with_fsdp_and_tp."""

    def run(*layout):
        return tiny_llama_json(_command(*layout, "--compile"))

    return run


@pytest.fixture(scope="module")
def fsdp2_compiled(compiled_once):
    """``predict --fsdp 2 --compile`` of the tiny Llama."""
    return compiled_once("--fsdp", "2")


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        (["--fsdp", "2"], "FSDP2 over 2 ranks (3 units: per block + root)"),
        (["--tp", "2"], "tensor parallel over 2 ranks"),
        (["--fsdp", "2", "--tp", "2"], "FSDP2 over 2 ranks (3 units: per block + root)"),
        (["--dp", "2", "--fsdp", "2"], "HSDP: FSDP2 over 2 ranks x 2 replicas"),
        (["--dp", "2"], "DDP over 2 replicas"),
    ],
)
def test_sharded_compile_records_each_block_compiled(tiny_llama, layout, words, compiled_once):
    """Each of the 2 blocks is compiled after TP and before FSDP2 / DDP, and the loss on its
    own (torchtitan's CompileConfig.components ["model", "loss"]; with --tp the loss-parallel
    cross-entropy on DTensor shards): 3 compiled regions entered per step, 6 in 2 steps; the
    embedding, final norm and LM head stay eager; no captured graph fell back to eager."""
    code, data = compiled_once(*layout)
    assert code == 0
    assert COMPILED in data["description"] and words in data["description"]
    said = " ".join(data["warnings"])
    assert "torch.compile: compiled (AOTAutograd partitioner real" in said
    assert "compiled code was entered 6 time(s)" in said
    assert "could not be compiled GPU-free" not in said
    assert "existed before tracing" not in said
    assert "(loss eager)" not in data["description"]


def test_compiled_fsdp_keeps_the_shards_and_saves_fewer_activations(tiny_llama, fsdp2_compiled):
    """Compiled or not, rank 0 holds the same shards, FSDP2 buffers, gradients and optimizer
    state at its peak (the second step's optimizer step); only the activations held there
    differ: 43008 bytes eager, 30720 compiled, as AOTAutograd's min-cut partitioner saves fewer
    tensors for backward (it recomputes the blocks' cheap pointwise ops: RMSNorm, SiLU). Both
    save the cuDNN attention kernel's logsumexp and philox seed and offset (the compiled block's
    SDPA is the kernel CUDA picks, as the eager one's)."""
    _, eager = _predict(["--fsdp", "2"])
    _, compiled = fsdp2_compiled
    at_eager = dict(eager["peak_allocated_at"]["by_category_bytes"])
    at_compiled = dict(compiled["peak_allocated_at"]["by_category_bytes"])
    assert (at_eager.pop("activation"), at_compiled.pop("activation")) == (43008, 30720)
    assert at_compiled == at_eager
    assert eager["peak_allocated_bytes"] - compiled["peak_allocated_bytes"] == 43008 - 30720
    assert eager["peak_reserved_bytes"] == compiled["peak_reserved_bytes"]


def _largest_activation_bytes(data):
    """The most activation bytes held at any point of the JSON timeline."""
    return max(point["by_category_bytes"].get("activation", 0) for point in data["timeline"])


@pytest.mark.parametrize(
    ("layout", "eager_bytes", "compiled_bytes"),
    [
        # bf16-mixed under TP: FSDP-less, so the step runs under autocast.
        (["--tp", "2"], 104960, 87040),
        (["--tp", "2", "--checkpointing", "selective-op"], 66048, 54272),
        (["--dp", "2", "--precision", "fp32"], 190976, 142848),
        (["--fsdp", "2", "--precision", "fp32"], 190976, 142848),
    ],
)
def test_compiled_blocks_hold_fewer_activations(
    tiny_llama, layout, eager_bytes, compiled_bytes, compiled_once
):
    """The most activation bytes held during the 2 steps, eager and compiled: AOTAutograd's
    min-cut partitioner saves fewer tensors for backward than eager autograd (it recomputes
    the blocks' cheap pointwise ops: RMSNorm, SiLU, RoPE), with tensor parallel, with
    selective-op AC under tensor parallel (the TP mesh saved for backward as an opaque object,
    the checkpointed SDPA the CUDA kernel that the save list keeps), and with DDP. A block
    compiled under DDP holds exactly what it holds under FSDP2 (the same 1-rank-sized
    activations: neither shards them)."""
    _, eager = _predict(layout)
    code, compiled = compiled_once(*layout)
    assert code == 0
    assert (_largest_activation_bytes(eager), _largest_activation_bytes(compiled)) == (
        eager_bytes,
        compiled_bytes,
    )


def test_compiled_checkpointing_records_with_fsdp_and_tp(tiny_llama, compiled_once):
    """--checkpointing full and selective-op with compiled blocks record under FSDP2 and TP
    (torchtitan's dynamo settings for the step). Either checkpoint is inside the compiled
    block, as torchtitan wraps each block (FullAC / SelectiveAC ``_wrap_block``) before
    ``apply_compile``: the recompute runs in the block's compiled backward, so 2 steps enter
    3 compiled regions each, 6 (full AC once re-entered each block from eager backward, 10,
    recompiling it there). Under TP the compiled selective-op block saves the TP device mesh
    for its backward (an opaque object: runtime_wrappers.py save_from_forward), which now
    records."""
    for layout in (["--fsdp", "2"], ["--tp", "2"], ["--fsdp", "2", "--tp", "2"]):
        for mode, entered in (("full", 6), ("selective-op", 6)):
            code, data = compiled_once(*layout, "--checkpointing", mode)
            assert code == 0 and "checkpointing" in data["description"]
            assert COMPILED in data["description"]
            said = " ".join(data["warnings"])
            assert f"compiled code was entered {entered} time(s)" in said
            assert "could not be compiled GPU-free" not in said
