"""``TorchtitanJob.pipeline_outputs="merged"``: the pipeline step as torchtitan stepped it in 2024.

torchtitan 9dec370 called ``pp_schedule.step(target=labels, losses=losses)`` on a torch whose
``step`` always kept the last stage's output of every micro-batch (``output_chunks``) and merged
them when the step ended; 0.3.0 passes ``return_outputs=False``. llama3's ``debugmodel`` (vocab
2048) cut to its first 2 blocks (``_torchtitan_two_blocks``: the logits and the schedule do not
depend on the blocks, and 2 record in half the time of 6) with PP 2, 1F1B, local batch 4 of
seq 512 (4 micro-batches of 1), the plain cross-entropy: rank 1 runs the last stage, whose
logits per micro-batch are 1 x 512 x 2048 bf16 = 2 MiB.
"""

from __future__ import annotations

import collections

import pytest

pytest.importorskip("torchtitan")

from _torchtitan_small_job import TWO_BLOCKS, small_step  # noqa: E402

from oomkit.core.target import Target  # noqa: E402
from oomkit.errors import ConfigError  # noqa: E402
from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402
from oomkit.prediction.predictor import predict_recording  # noqa: E402
from oomkit.prediction.torchtitan_job import TorchtitanJob, record_torchtitan_job  # noqa: E402

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

_MICRO_BATCHES = 4
_LOGITS = 1 * 512 * 2048 * 2  # one micro-batch's logits, bf16 (FSDP2's compute dtype)
_BASE = small_step(4, 512)
_NO_AC = ("activation_checkpoint:none",)  # a subcommand: last
_PP2 = (
    "--parallelism.pipeline_parallel_degree", "2",
    "--parallelism.pipeline_parallel_schedule", "1F1B",
)


def _job(outputs: str, overrides: tuple[str, ...] = _BASE + _PP2 + _NO_AC, world: int = 2) -> TorchtitanJob:
    return TorchtitanJob(
        *TWO_BLOCKS, overrides, world_size=world, rank=world - 1,
        loss="cross_entropy", pipeline_outputs=outputs,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def last_stage():
    """Rank 1 (the last stage), two steps, as 0.3.0 and as 2024 stepped the schedule."""
    target = Target.resolve("h100")
    out = {}
    for outputs in ("dropped", "merged"):
        recording, _ = record_torchtitan_job(_job(outputs), target=target)
        out[outputs] = (recording, predict_recording(recording, target=target))
    return out


def _allocation_sizes_per_step(recording) -> list[collections.Counter[int]]:
    bounds = [*recording.step_starts, len(recording.events)]
    return [
        collections.Counter(e.size for e in recording.events[start:stop] if e.action == "alloc")
        for start, stop in zip(bounds, bounds[1:], strict=False)
    ]


def test_each_step_merges_every_micro_batch_logits_once(last_stage):
    """Merged: each step allocates exactly one tensor more, the 4 micro-batches' logits
    concatenated (schedules.py ``_merge_outputs``: ``torch.cat``), and nothing else differs."""
    dropped = _allocation_sizes_per_step(last_stage["dropped"][0])
    merged = _allocation_sizes_per_step(last_stage["merged"][0])
    assert len(dropped) == len(merged) == 2
    for before, after in zip(dropped, merged, strict=True):
        assert after - before == collections.Counter({_MICRO_BATCHES * _LOGITS: 1})
        assert before - after == collections.Counter()


def test_the_last_stage_holds_its_earlier_logits_through_the_last_backward(last_stage):
    """1F1B's last stage runs each micro-batch's backward right after its forward; kept for the
    merge, the 3 earlier micro-batches' logits are live at its peak (the last backward):
    exactly 3 x 2 MiB more peak allocated."""
    dropped, merged = last_stage["dropped"][1], last_stage["merged"][1]
    assert merged.peak_allocated_bytes - dropped.peak_allocated_bytes == (
        (_MICRO_BATCHES - 1) * _LOGITS
    ) == 6_291_456


def test_merged_outputs_without_a_pipeline_is_a_config_error():
    """No pipeline, nothing to merge: refused with what to do."""
    with pytest.raises(ConfigError, match="this job has no pipeline"):
        record_torchtitan_job(_job("merged", _BASE + _NO_AC, world=1), target=Target.resolve("h100"))


def test_the_scenario_carries_it_to_the_job(capsys):
    """``--set torchtitan.pipeline_outputs=merged`` is the section's field, handed to the job;
    a value that is neither exits 2 with the choices."""
    from oomkit.interfaces.cli import main
    from oomkit.scenario.torchtitan_run import torchtitan_job_of
    from oomkit.scenario.torchtitan_section import TorchtitanSection

    merged = TorchtitanSection(job="llama3:debugmodel", world_size=2, pipeline_outputs="merged")
    assert torchtitan_job_of(merged).pipeline_outputs == "merged"
    assert torchtitan_job_of(TorchtitanSection(job="llama3:debugmodel")).pipeline_outputs == "dropped"
    head = ["predict", "--torchtitan", "llama3:debugmodel", "--world-size", "2", "--set"]
    assert main([*head, "torchtitan.pipeline_outputs=merged", "--dump-config"]) == 0
    assert 'pipeline_outputs = "merged"' in capsys.readouterr().out
    assert main([*head, "torchtitan.pipeline_outputs=kept"]) == 2
    err = capsys.readouterr().err
    assert "pipeline_outputs" in err and "Traceback" not in err


@pytest.mark.parametrize("outputs", ["kept", "", "Merged", None])
def test_any_other_value_is_a_config_error(outputs):
    """The job itself refuses anything but the two ways, naming them."""
    with pytest.raises(ConfigError, match="'dropped' or 'merged'"):
        TorchtitanJob("llama3", "debugmodel", pipeline_outputs=outputs)  # type: ignore[arg-type]
