"""`oomkit predict PRESET --fsdp N --float8 [...]` (torchao Float8 training) and parallel.async_tp."""

from __future__ import annotations

import copy
import json

import pytest

from oomkit.interfaces.cli import main

pytest.importorskip("torch")
pytest.importorskip("torchao.float8")


def _predict(argv, capsys):
    code = main(["predict", "llama3-8b", "--fsdp", "2", *argv, "--batch", "1", "--seq", "16",
                 "--steps", "2", "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def _made():
    """Flags -> (exit code, JSON) of the predictions already made in this module."""
    return {}


@pytest.fixture
def predicted(tiny_llama, capsys, _made):
    """``_predict`` of the tiny Llama, made once per set of flags for the tests that read the
    same prediction (a copy each: no test sees another's changes)."""

    def get(flags):
        if tuple(flags) not in _made:
            _made[tuple(flags)] = _predict(flags, capsys)
        return copy.deepcopy(_made[tuple(flags)])

    return get


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


def test_async_tp_is_refused_with_its_workspace(capsys):
    """parallel.async_tp on Llama 3 8B says what it would add: 2 x batch 1 x seq 16/2 x hidden 4096 x
    2 bytes (bf16) = 128 KiB of symmetric memory per GPU, outside the caching allocator."""
    argv = ["predict", "llama3-8b", "--tp", "2", "--fsdp", "2", "--compile", "--set", "parallel.async_tp=true",
            "--batch", "1", "--seq", "16"]
    assert main(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "parallel.async_tp (async TP) is not modelled: Inductor's micro_pipeline_tp pass" in err
    assert (
        "that workspace is 128.00 KiB per GPU (2 x batch 1 x seq 16/2 x hidden 4096 x 2 bytes)"
    ) in err


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


def test_hsdp_float8_all_gather_matches_its_shard_group(tiny_llama, capsys):
    """--dp 2 --fsdp 2: FSDP2 shards over the 2-rank dimension and replicates over the other
    (torchtitan's ["dp_replicate", "fsdp"] mesh), so rank 0 gathers the same fp8 weights and
    peaks as FSDP2 over 2 ranks (the replicas' gradient all-reduce is in place)."""
    flags = ["--float8", "--float8-recipe", "tensorwise", "--float8-all-gather"]
    code, hsdp = _predict(["--dp", "2", *flags], capsys)
    assert code == 0
    assert "HSDP: FSDP2 over 2 ranks x 2 replicas" in hsdp["description"]
    assert hsdp["peak_allocated_bytes"] == 68226048


def test_float8_blocks_compile_inside_fsdp2(tiny_llama, capsys):
    """--float8 --compile: torchao's Float8Linear compiled per block through the compiled
    backend (both blocks and the loss entered once per step)."""
    code, data = _predict(["--float8", "--compile"], capsys)
    assert code == 0
    assert "Float8 rowwise (torchao, 14 linear layers), each block compiled" in data["description"]
    assert "compiled code was entered 6 time(s)" in " ".join(data["warnings"])


def test_float8_with_fsdp_x_tp_shards_the_float8_linears(tiny_llama, capsys):
    """--fsdp 2 --tp 2 --float8: converted before the TP plan (torchtitan's order), so the plan
    shards torchao's Float8Linear modules and their casts run on DTensor shards."""
    code, data = _predict(["--tp", "2", "--float8"], capsys)
    assert code == 0
    description = data["description"]
    assert "Float8 rowwise (torchao, 14 linear layers), tensor parallel over 2 ranks" in description
    assert "FSDP2 over 2 ranks" in description
