"""A scenario's ``torchtitan`` section, built and recorded through torchtitan's own code.

``oomkit.prediction.torchtitan_job`` does the work (the job parsed by torchtitan's
``ConfigManager``, built as its trainer builds it, on a fake process group); this is the
scenario's side: the section's fields as a ``TorchtitanJob``, and the recording replayed on the
scenario's target into a ``Prediction``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from oomkit.prediction.workload import WorkloadSpec

if TYPE_CHECKING:
    from oomkit.core.target import Target
    from oomkit.prediction.predictor import Prediction
    from oomkit.prediction.torchtitan_job import TorchtitanJob
    from oomkit.scenario.torchtitan_section import TorchtitanSection

__all__ = ["TorchtitanWorkload", "torchtitan_job_of"]


def torchtitan_job_of(section: TorchtitanSection) -> TorchtitanJob:
    """The section as ``oomkit.prediction.torchtitan_job.TorchtitanJob``."""
    from oomkit.prediction.torchtitan_job import TorchtitanJob, parse_job_name

    module, config = parse_job_name(section.job)
    return TorchtitanJob(
        module,
        config,
        tuple(section.overrides),
        world_size=section.world_size,
        rank=section.rank,
        attention=section.attention,
        loss=section.loss,
        pipeline_outputs=section.pipeline_outputs,
    )


@dataclass
class TorchtitanWorkload:
    """A torchtitan job to record on a fake process group.

    Attributes:
        section: the scenario's ``torchtitan`` section.
        steps: train steps to record.
        spec: the workload record (kind ``unknown``: no oomkit builder rebuilds it).
        raised: always empty (torchtitan's own refusals are ``OomkitError``).
        descriptions: the built run in words, once recorded.
    """

    section: TorchtitanSection
    steps: int
    spec: WorkloadSpec
    raised: list[BaseException] = field(default_factory=list)
    descriptions: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, section: TorchtitanSection, steps: int) -> TorchtitanWorkload:
        """The workload of ``section``, recording ``steps`` train steps."""
        name = f"torchtitan:{section.job}"
        return cls(section, steps, WorkloadSpec("unknown", name, steps=steps))

    @property
    def description(self) -> str:
        """The built run in words (the job's name before it is recorded)."""
        return self.descriptions[0] if self.descriptions else f"torchtitan {self.section.job}"

    def record(self, target: Target, budget_bytes: int | None) -> Prediction:
        """Record the job's rank (each distinct rank with ``all_ranks``: the peaking one's
        prediction, every rank's peaks in ``rank_peaks``) and replay it on ``target``.

        Raises:
            OomkitError: a job torchtitan or this path refuses (what to change is said).
        """
        job = torchtitan_job_of(self.section)
        if not self.section.all_ranks:
            return self._record_rank(job, target, budget_bytes)
        from oomkit.prediction._torchtitan_ranks import job_layout_and_cp
        from oomkit.scenario.ranks import peak_of_ranks

        layout, cp = job_layout_and_cp(job, target)
        return peak_of_ranks(
            layout,
            lambda rank: self._record_rank(
                dataclasses.replace(job, rank=rank), target, budget_bytes
            ),
            cp_in_fsdp=cp,
        )

    def _record_rank(
        self, job: TorchtitanJob, target: Target, budget_bytes: int | None
    ) -> Prediction:
        from oomkit.prediction.predictor import predict_recording
        from oomkit.prediction.torchtitan_job import record_torchtitan_job
        from oomkit.prediction.tracing.emulations import current_sdpa_settings

        recording, run = record_torchtitan_job(job, target=target, steps=self.steps)
        self.descriptions.append(run.description)
        if target.cudnn_version is None:
            # Not stated: the tracer used the settings in effect; the result names that version.
            target = dataclasses.replace(target, cudnn_version=current_sdpa_settings().cudnn_version)
        return predict_recording(
            recording,
            target=target,
            budget_bytes=budget_bytes,
            description=run.description,
            workload=self.spec,
        )
