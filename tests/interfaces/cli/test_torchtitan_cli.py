"""`oomkit predict --torchtitan MODULE:CONFIG --world-size N -- OVERRIDES`: a torchtitan job."""

from __future__ import annotations

import pytest
from _recorded_once import torchtitan_json
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from oomkit.interfaces.cli import main
from oomkit.scenario.model import Scenario

_OVERRIDES = [
    "--parallelism.spmd_backend", "partial_dtensor",
    "--training.local_batch_size", "2",
    "--training.seq_len", "256",
    "--training.disable_cuda_graphs",
]


@pytest.fixture(scope="module")
def debugmodel_fsdp2_json():
    """torchtitan's llama3 debugmodel on 2 ranks, 2 steps, as --json prints it (recorded once
    per process: test_torchtitan_compile_cli.py compares its compiled job with this one)."""
    pytest.importorskip("torchtitan")
    return torchtitan_json(
        ["predict", "--torchtitan", "llama3:debugmodel", "--world-size", "2", "--steps", "2",
         "--json", "--", *_OVERRIDES]
    )


def test_the_job_is_predicted_and_saved_with_its_overrides(debugmodel_fsdp2_json):
    """The result names torchtitan's run; its scenario keeps the job and the overrides."""
    code, data = debugmodel_fsdp2_json
    assert code == 0
    assert data["description"] == (
        "torchtitan 0.3.0 llama3:debugmodel (6,163,712 parameters), dp_shard 2, rank 0 of 2, "
        "local batch 2 x seq 256"
    )
    section = data["scenario"]["torchtitan"]
    assert section["job"] == "llama3:debugmodel"
    assert section["overrides"] == _OVERRIDES
    assert section["world_size"] == 2 and section.get("rank", 0) == 0  # defaults are not saved
    assert any("ScaledDotProductAttention" in w for w in data["warnings"])


def test_the_saved_scenario_predicts_the_same_bytes(debugmodel_fsdp2_json, tmp_path):
    """Re-predicting the saved scenario (the Python API) gives the CLI's peaks."""
    import oomkit

    _, data = debugmodel_fsdp2_json
    prediction = oomkit.predict(Scenario.model_validate(data["scenario"]))
    assert prediction.peak_allocated_bytes == data["peak_allocated_bytes"]
    assert prediction.peak_reserved_bytes == data["peak_reserved_bytes"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--torchtitan", "llama3"], "MODULE:CONFIG"),
        (["--torchtitan", "llama3:debugmodel", "--fsdp", "2"], "do not go with --torchtitan"),
        (["gpt2-124m", "--torchtitan", "llama3:debugmodel"], "TARGET / --hf"),
        (["--torchtitan", "llama3:debugmodel", "--world-size", "2", "--set", "torchtitan.rank=2"],
         "is not a rank"),
        (["--torchtitan", "llama3:debugmodel", "--world-size", "2", "--rank", "2"],
         "is not a rank"),
        (["--torchtitan", "llama3:debugmodel", "--rank", "1", "--set", "torchtitan.rank=0"],
         "differ: give the job's rank once"),
        (["--torchtitan", "llama3:nope"], "has no config 'nope'"),
        (["--torchtitan", "nope:debugmodel"], "torchtitan has no model module 'nope'"),
        (["--torchtitan", "llama3:debugmodel", "--", "--bogus.field", "1"], "rejected the overrides"),
    ],
)
def test_refusals_exit_2_and_say_what_to_do(argv, message, capsys):
    """A bad job, a flag the job's config owns, or a part not recorded: exit 2, one line."""
    if "nope" in " ".join(argv) or "--" in argv:
        pytest.importorskip("torchtitan")
    assert main(["predict", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_rank_is_the_jobs_rank_with_torchtitan(capsys):
    """--rank R is one flag: with --torchtitan it is torchtitan.rank, in the CLI and Python."""
    assert main(["predict", "--torchtitan", "llama3:debugmodel", "--world-size", "4", "--rank",
                 "3", "--dump-config"]) == 0
    out = capsys.readouterr().out
    assert 'rank = 3' in out and "[parallel]" not in out
    from oomkit.scenario.torchtitan_section import TorchtitanSection

    job = TorchtitanSection(job="llama3:debugmodel", world_size=4)
    scenario = Scenario(torchtitan=job, parallel={"rank": 2})
    assert scenario.torchtitan.rank == 2 and scenario.parallel is None
    with pytest.raises(ValidationError, match="is not a rank"):
        Scenario(torchtitan=job, parallel={"rank": 4})


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=0, max_size=20))
def test_a_job_name_without_one_inner_colon_is_refused(name):
    """The section takes MODULE:CONFIG and nothing else (no torch needed to refuse)."""
    module, sep, config = name.partition(":")
    well_formed = bool(sep and module.strip() and config.strip() and ":" not in config)
    if well_formed:
        assert Scenario(torchtitan={"job": name}).torchtitan.job == name
    else:
        with pytest.raises(ValidationError, match="MODULE:CONFIG"):
            Scenario(torchtitan={"job": name})
