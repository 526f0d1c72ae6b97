"""`oomkit predict PRESET --fsdp N --float8 [...]` (torchao Float8 training) and parallel.async_tp."""

from __future__ import annotations

import json

import pytest
from _recorded_once import tiny_llama_json

from oomkit.interfaces.cli import main

pytest.importorskip("torch")
pytest.importorskip("torchao.float8")


def _predict(argv):
    """``predict --fsdp 2 ARGV`` of the tiny Llama, batch 1, seq 16, 2 steps: recorded once per
    set of flags and process for the tests that read it (test_compile_parallel_cli.py and
    test_hsdp_cli.py read the plain bf16 one too), a fresh copy of its JSON each."""
    return tiny_llama_json(["predict", "llama3-8b", "--fsdp", "2", *argv, "--batch", "1", "--seq",
                            "16", "--steps", "2", "--json"])


@pytest.fixture
def predicted(tiny_llama):
    """``_predict`` of the tiny Llama (once per set of flags: no test sees another's changes)."""
    return _predict


def test_float8_converts_the_tiny_llama_s_14_block_linears(predicted):
    """The 7 linears of each of the 2 blocks (all dims multiples of 16) train in float8; the LM
    head is left in bf16 (torchtitan's filter_fqns=["lm_head"])."""
    code, data = predicted(["--float8"])
    assert code == 0
    assert "Float8 rowwise (torchao, 14 linear layers), FSDP2 over 2 ranks" in data["description"]


@pytest.mark.parametrize(
    ("flags", "peak_bytes", "gathered_bytes"),
    [
        ([], 68273152, 215040),
        (["--float8"], 68298240, 140800),
        (["--float8", "--float8-recipe", "tensorwise"], 68298240, 140800),
        (["--float8", "--float8-recipe", "tensorwise", "--float8-all-gather"], 68226048, 103936),
    ],
)
def test_float8_peaks(predicted, flags, peak_bytes, gathered_bytes):
    """Exact peaks of rank 0: bf16 peaks in the optimizer step; float8 peaks in backward, where
    torchao casts the saved bf16 input and weight to fp8 again (transient fp32 and fp8 copies);
    with float8 all-gather the weights are gathered in fp8 (1 byte per element) and cast on
    the all-gather stream, so the peak holds fewer gathered bytes and casts."""
    code, data = predicted(flags)
    assert code == 0
    assert data["peak_allocated_bytes"] == peak_bytes
    assert data["peak_allocated_at"]["by_category_bytes"]["allgather_buffer"] == gathered_bytes
    assert data["peak_reserved_bytes"] == 73400320


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fsdp", "2", "--float8-recipe", "tensorwise"], "configure --float8: add it"),
        (["--float8"], "--float8 is modelled with FSDP2"),
        (["--fsdp", "2", "--float8", "--float8-all-gather"], "needs --float8-recipe tensorwise"),
        (["--fsdp", "2", "--set", "parallel.async_tp=true"],
         "parallel.async_tp pipelines tensor parallel's collectives"),
        (["--dp", "2", "--float8"], "--float8 is modelled with FSDP2"),
    ],
)
def test_float8_and_async_tp_refusals_exit_2(tiny_llama, argv, message, capsys):
    """Each combination that cannot be recorded exits 2 with one line saying what to do."""
    assert main(["predict", "llama3-8b", *argv, "--batch", "1", "--seq", "16"]) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_async_tp_runs_inductor_s_micro_pipeline_pass_on_the_preset(tiny_llama, capsys):
    """parallel.async_tp on the tiny Llama under FSDP2 2 x TP 2 with --compile: torch's pass
    fuses 8 all-gather+matmul and 4 matmul+reduce-scatter per step (2 blocks x 2 steps); the
    fused ops run on a backend stream whose GEMMs take a cuBLAS workspace per thread (2 x 32 MiB
    on Hopper), and the symmetric-memory workspace (the largest request: 2 reduce-scatter chunks
    of batch 2 x seq 16/2 x hidden 64 x 2 bytes (bf16) = 4,096 bytes asked) is mapped in one
    2 MiB granule outside the caching allocator."""
    base = ["predict", "llama3-8b", "--tp", "2", "--fsdp", "2", "--compile", "--batch", "2",
            "--seq", "16", "--steps", "2", "--json", "--no-remedies"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--set", "parallel.async_tp=true"]) == 0
    fused = json.loads(capsys.readouterr().out)
    kernels = fused["kernel_choices"]
    assert kernels["async TP symm_mem.fused_all_gather_matmul.default"] == 16
    assert kernels["async TP symm_mem.fused_matmul_reduce_scatter.default"] == 8
    assert not any(k.startswith("async TP") for k in plain["kernel_choices"])
    # at the peak the fused ops hold what plain compile's all-gathers and matmuls held; the
    # difference is the backend stream's two cuBLAS workspaces (forward's and backward's thread)
    assert fused["peak_allocated_bytes"] - plain["peak_allocated_bytes"] == 2 * 32 * 2**20
    outside = {what: n for what, n, _ in fused["distributed"]["outside_lines"]}
    ((what, n),) = [(w, n) for w, n in outside.items() if w.startswith("symmetric-memory")]
    assert "4,096 bytes asked" in what and n == 2 * 2**20
    assert not any(w.startswith("symmetric-memory") for w, _, _ in plain["distributed"]["outside_lines"])


def test_async_tp_without_compile_exits_2(tiny_llama, capsys):
    """Async TP is Inductor's pass: an eager preset step never runs it, so it is refused."""
    argv = ["predict", "llama3-8b", "--tp", "2", "--fsdp", "2", "--set", "parallel.async_tp=true",
            "--batch", "1", "--seq", "16"]
    assert main(argv) == 2
    assert "parallel.async_tp is Inductor's micro-pipeline pass over compiled blocks: add --compile" in (
        " ".join(capsys.readouterr().err.split()))


def test_a_saved_float8_prediction_is_re_predicted_in_float8(predicted):
    """The saved workload keeps the recipe and float8 all-gather; explain's re-prediction of
    it gives the saved bytes exactly (before: re-predicted in bf16)."""
    from oomkit.diagnose._model_remedies import _repredict
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.workload import workload_from_json

    _, data = predicted(["--float8", "--float8-recipe", "tensorwise", "--float8-all-gather"])
    assert data["workload"]["float8"] == {"recipe": "tensorwise", "all_gather": True}
    workload = workload_from_json(data)
    assert (workload.float8_recipe, workload.float8_all_gather) == ("tensorwise", True)
    known = {name: value for name, value in workload.options.items() if value is not None}
    again = _repredict(data, workload, StepOptions(**known))
    assert again.peak_allocated_bytes == data["peak_allocated_bytes"] == 68226048


def test_hsdp_float8_all_gather_matches_its_shard_group(tiny_llama):
    """--dp 2 --fsdp 2: FSDP2 shards over the 2-rank dimension and replicates over the other
    (torchtitan's ["dp_replicate", "fsdp"] mesh), so rank 0 gathers the same fp8 weights and
    peaks as FSDP2 over 2 ranks (the replicas' gradient all-reduce is in place)."""
    flags = ["--float8", "--float8-recipe", "tensorwise", "--float8-all-gather"]
    code, hsdp = _predict(["--dp", "2", *flags])
    assert code == 0
    assert "HSDP: FSDP2 over 2 ranks x 2 replicas" in hsdp["description"]
    assert hsdp["peak_allocated_bytes"] == 68226048


def test_float8_blocks_compile_inside_fsdp2(tiny_llama):
    """--float8 --compile: torchao's Float8Linear compiled per block through the compiled
    backend (both blocks and the loss entered once per step)."""
    code, data = _predict(["--float8", "--compile"])
    assert code == 0
    assert "Float8 rowwise (torchao, 14 linear layers), each block compiled" in data["description"]
    assert "compiled code was entered 6 time(s)" in " ".join(data["warnings"])


def test_float8_with_fsdp_x_tp_shards_the_float8_linears(tiny_llama):
    """--fsdp 2 --tp 2 --float8: converted before the TP plan (torchtitan's order), so the plan
    shards torchao's Float8Linear modules and their casts run on DTensor shards."""
    code, data = _predict(["--tp", "2", "--float8"])
    assert code == 0
    description = data["description"]
    assert "Float8 rowwise (torchao, 14 linear layers), tensor parallel over 2 ranks" in description
    assert "FSDP2 over 2 ranks" in description
