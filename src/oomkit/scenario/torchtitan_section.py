"""``TorchtitanSection``: a torchtitan job as its launcher takes it, the rank to record.

``oomkit predict --torchtitan llama3:llama3_8b --world-size 8 -- --training.local_batch_size 2``
names torchtitan's ``--module`` and ``--config`` and, after ``--``, its own command-line
overrides of the config's fields (torchtitan/config/manager.py ``ConfigManager``). The job's
layout comes from those overrides (``--parallelism.tensor_parallel_degree 2``), its batch and
sequence from ``--training.*``: oomkit's own ``--fsdp``, ``--batch``... do not go with it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from oomkit.scenario.sections import MULTI_GPU, WORKLOAD, Count, _flag, _Section

__all__ = ["TorchtitanSection"]


class TorchtitanSection(_Section):
    """A torchtitan job (``MODULE:CONFIG`` and its overrides), recorded on a fake group."""

    job: str = Field(
        description="a torchtitan job (its overrides after --)",
        json_schema_extra=_flag("--torchtitan", WORKLOAD, metavar="MODULE:CONFIG",
                                commands=("predict",)),
    )
    overrides: tuple[str, ...] = Field(
        (),
        description="torchtitan's command-line overrides (after -- on the command line)",
        json_schema_extra=_flag(None, WORKLOAD, commands=("predict",)),
    )
    world_size: Count = Field(
        1,
        description="ranks of a --torchtitan job or a torchrun script",
        json_schema_extra=_flag("--world-size", MULTI_GPU, metavar="N",
                                commands=("predict", "fit")),
    )
    rank: int = Field(
        0,
        ge=0,
        description="--torchtitan: the rank to record (--rank R)",
        # No flag of its own: --rank R (parallel.rank) lands here with --torchtitan
        # (Scenario._one_rank_flag); --set torchtitan.rank=R too.
        json_schema_extra=_flag(None, MULTI_GPU, commands=("predict",)),
    )
    all_ranks: bool = Field(
        False,
        description="--torchtitan: record each distinct rank, name the peak (--all-ranks)",
        # No flag of its own: --all-ranks (parallel.all_ranks) lands here with --torchtitan
        # (Scenario._one_rank_flag); --set torchtitan.all_ranks=true too.
        json_schema_extra=_flag(None, MULTI_GPU, commands=("predict",)),
    )
    attention: Literal["sdpa", "configured"] = Field(
        "sdpa",
        description="sdpa: FlexAttention/varlen recorded as SDPA; configured: kept (refused)",
        json_schema_extra=_flag(None, WORKLOAD, commands=("predict",)),
    )
    loss: Literal["configured", "cross_entropy"] = Field(
        "configured",
        description="the config's loss, or plain cross-entropy over the full logits",
        json_schema_extra=_flag(None, WORKLOAD, commands=("predict",)),
    )
    pipeline_outputs: Literal["dropped", "merged"] = Field(
        "dropped",
        description="pipeline jobs: dropped (torchtitan 0.3.0's step) or merged (2024's: the "
        "last stage keeps every micro-batch's output and merges them)",
        json_schema_extra=_flag(None, WORKLOAD, commands=("predict",)),
    )

    @model_validator(mode="after")
    def _job_and_rank(self) -> TorchtitanSection:
        module, sep, config = self.job.partition(":")
        if not sep or not module.strip() or not config.strip() or ":" in config:
            raise ValueError(
                f"--torchtitan takes MODULE:CONFIG (torchtitan's --module and --config); got "
                f"{self.job!r}. Example: --torchtitan llama3:llama3_8b"
            )
        if self.rank >= self.world_size:
            raise ValueError(
                f"torchtitan.rank {self.rank} is not a rank of --world-size {self.world_size}: "
                "give a rank in [0, world size)"
            )
        return self
