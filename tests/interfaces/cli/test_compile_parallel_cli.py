"""`oomkit predict PRESET --compile` with --fsdp / --tp / --dp: each block compiled, as torchtitan."""

from __future__ import annotations

import json

import pytest

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

COMPILED = "each block compiled (torchtitan apply_compile: fullgraph, Inductor)"


def _predict(argv, capsys):
    code = main(["predict", "llama3-8b", *argv, "--batch", "1", "--seq", "16", "--steps", "2",
                 "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def fsdp2_compiled(tmp_path_factory):
    """``predict --fsdp 2 --compile`` of the tiny Llama, made once for the two tests that read
    it (with a recording cache of its own, as tests/conftest.py gives each test)."""
    import contextlib
    import io

    from _parallel_helpers import use_tiny_llama

    with pytest.MonkeyPatch.context() as patch:
        use_tiny_llama(patch)
        patch.setenv("OOMKIT_CACHE_DIR", str(tmp_path_factory.mktemp("oomkit-cache")))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["predict", "llama3-8b", "--fsdp", "2", "--compile", "--batch", "1",
                         "--seq", "16", "--steps", "2", "--json"])
    return code, json.loads(out.getvalue())


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        (["--fsdp", "2"], "FSDP2 over 2 ranks (3 units: per block + root)"),
        (["--tp", "2"], "tensor parallel over 2 ranks"),
        (["--fsdp", "2", "--tp", "2"], "FSDP2 over 2 ranks (3 units: per block + root)"),
        (["--dp", "2", "--fsdp", "2"], "HSDP: FSDP2 over 2 ranks x 2 replicas"),
    ],
)
def test_sharded_compile_records_each_block_compiled(tiny_llama, layout, words, capsys, request):
    """Each of the 2 blocks is compiled after TP and before FSDP2, and the loss on its own
    (torchtitan's CompileConfig.components ["model", "loss"]): 3 compiled regions entered per
    step, 6 in 2 steps (4 with --tp: its loss-parallel loss stays eager); the embedding, final
    norm and LM head stay eager."""
    if layout == ["--fsdp", "2"]:
        code, data = request.getfixturevalue("fsdp2_compiled")
    else:
        code, data = _predict([*layout, "--compile"], capsys)
    assert code == 0
    assert COMPILED in data["description"] and words in data["description"]
    said = " ".join(data["warnings"])
    assert "torch.compile: compiled (AOTAutograd partitioner real" in said
    # With --tp the loss-parallel cross-entropy stays eager: 2 regions per step.
    entered = 4 if "--tp" in layout else 6
    assert f"compiled code was entered {entered} time(s)" in said
    assert ("(loss eager)" in data["description"]) == ("--tp" in layout)


def test_compiled_fsdp_keeps_the_shards_and_saves_fewer_activations(tiny_llama, capsys, fsdp2_compiled):
    """Compiled or not, rank 0 holds the same shards, FSDP2 buffers, gradients and optimizer
    state at its peak (the second step's optimizer step); only the activations held there
    differ: 43008 bytes eager, 29696 compiled, as AOTAutograd's min-cut partitioner saves fewer
    tensors for backward (it recomputes the blocks' cheap pointwise ops: RMSNorm, SiLU)."""
    _, eager = _predict(["--fsdp", "2"], capsys)
    _, compiled = fsdp2_compiled
    at_eager = dict(eager["peak_allocated_at"]["by_category_bytes"])
    at_compiled = dict(compiled["peak_allocated_at"]["by_category_bytes"])
    assert (at_eager.pop("activation"), at_compiled.pop("activation")) == (43008, 29696)
    assert at_compiled == at_eager
    assert eager["peak_allocated_bytes"] - compiled["peak_allocated_bytes"] == 43008 - 29696
    assert eager["peak_reserved_bytes"] == compiled["peak_reserved_bytes"]


def test_ddp_compile_is_refused_saying_why(tiny_llama, capsys):
    """--dp alone (DDP) with --compile exits 2: dynamo's DDPOptimizer split is not recorded."""
    assert main(["predict", "llama3-8b", "--dp", "2", "--compile", "--seq", "16"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "DDPOptimizer" in err and "--dp R --fsdp S" in err and "drop --compile" in err


def test_compiled_checkpointing_records_and_selective_op_with_tp_is_refused(tiny_llama, capsys):
    """--checkpointing full and selective-op with compiled blocks record under FSDP2
    (torchtitan's dynamo settings for the step; selective-op's compiled checkpoint saves the
    CPU RNG state for its recompute, host memory); selective-op with --tp exits 2, AOTAutograd
    saving the TP mesh for backward. Compiled regions entered in 2 steps: full re-enters each
    compiled block in backward (its checkpoint wraps the compiled call), 10; selective-op's
    checkpoint is inside the compiled block, recomputed by its compiled backward, 6."""
    for mode, entered in (("full", 10), ("selective-op", 6)):
        code, data = _predict(["--fsdp", "2", "--compile", "--checkpointing", mode], capsys)
        assert code == 0 and "checkpointing" in data["description"]
        assert COMPILED in data["description"]
        assert f"compiled code was entered {entered} time(s)" in " ".join(data["warnings"])
    argv = ["predict", "llama3-8b", "--tp", "2", "--compile", "--checkpointing", "selective-op",
            "--seq", "16"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--compile with --checkpointing selective-op is not modelled with --tp yet" in err

