"""The machine a scenario runs on: the target GPU with its software, and the parallel layout.

``TargetSection`` names the GPU, the allocator settings and the torch / CUDA / cuDNN versions
that change memory (``oomkit.scenario.target.target_of`` makes the one ``Target`` from it);
``ParallelSection`` the FSDP2 / TP / DDP / PP / CP degrees, and which rank is predicted (rank 0,
``rank``, or each distinct one with ``all_ranks``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from oomkit.scenario.sections import (
    DEVICE,
    MULTI_GPU,
    Bytes,
    Count,
    _flag,
    _Section,
)

__all__ = ["ParallelSection", "TargetSection"]


class TargetSection(_Section):
    """The machine: GPU, allocator settings and the software versions that change memory."""

    gpu: str = Field(
        "h100",
        description="a catalog GPU (`oomkit gpus`) or a size",
        json_schema_extra=_flag("--gpu", DEVICE, metavar="NAME|SIZE"),
    )
    alloc_conf: str | None = Field(
        None,
        description="PYTORCH_CUDA_ALLOC_CONF to simulate",
        json_schema_extra=_flag("--alloc-conf", DEVICE, metavar="STR"),
    )
    context_overhead_bytes: Bytes | None = Field(
        None,
        description="memory outside PyTorch (default: the GPU's)",
        json_schema_extra=_flag("--context-overhead", DEVICE, metavar="SIZE"),
    )
    torch_version: str | None = Field(
        None,
        description="allocator of this torch (default: installed)",
        json_schema_extra=_flag("--torch-version", DEVICE, metavar="X.Y"),
    )
    @field_validator("gpu", mode="before")
    @classmethod
    def _gpu_named_or_sized(cls, value: object) -> object:
        if isinstance(value, int | float) and not isinstance(value, bool):
            # A number alone has no unit: 24 could be GiB, GB or bytes.
            raise ValueError(
                f"a GPU is a catalog name or a memory size with a unit, e.g. 'rtx4090' or "
                f"'{value}GiB'; got the number {value!r}"
            )
        return value

    @field_validator("torch_version")
    @classmethod
    def _readable_torch(cls, value: str | None) -> str | None:
        if value is not None:
            from oomkit.core.allocator.versions import require_modelled

            require_modelled(value)  # ConfigError (a ValueError): the form, or past main
        return value

    cuda_version: str | None = Field(
        None,
        description="the target torch's CUDA, e.g. 12.8",
        json_schema_extra=_flag("--cuda-version", DEVICE, metavar="X.Y"),
    )
    cudnn_version: Count | None = Field(
        None,
        description="the target's cuDNN, e.g. 91002 for 9.10.2",
        json_schema_extra=_flag("--cudnn-version", DEVICE, metavar="N"),
    )
    cuda_module_loading: Literal["lazy", "eager"] | None = Field(
        None,
        description="CUDA_MODULE_LOADING (the CLI reads it from the environment)",
        json_schema_extra=_flag(None, DEVICE),
    )


class ParallelSection(_Section):
    """The parallel layout: FSDP2 / TP / DDP (and HSDP), pipeline and context parallel, on a
    fake process group; rank 0 recorded unless ``rank`` or ``all_ranks`` says otherwise."""

    fsdp: Count | None = Field(
        None,
        description="FSDP2 over N GPUs; the batch is per rank",
        json_schema_extra=_flag("--fsdp", MULTI_GPU, metavar="N"),
    )
    tp: Count | None = Field(
        None,
        description="tensor parallel over N GPUs (Llama presets)",
        json_schema_extra=_flag("--tp", MULTI_GPU, metavar="N"),
    )
    dp: Count | None = Field(
        None,
        description="N DDP replicas (with --fsdp: HSDP replicas)",
        json_schema_extra=_flag("--dp", MULTI_GPU, metavar="N"),
    )
    bucket_cap_mb: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="DDP's bucket_cap_mb (default 25)",
        json_schema_extra=_flag("--bucket-cap-mb", MULTI_GPU, metavar="MB"),
    )
    gradient_as_bucket_view: bool = Field(
        False,
        description="DDP's gradient_as_bucket_view=True",
        json_schema_extra=_flag("--gradient-as-bucket-view", MULTI_GPU),
    )
    # The job's NCCL environment where it changes memory (core/gpus/nccl.py); fields, no flags.
    nccl_buffsize: Bytes | None = Field(
        None,
        description="NCCL_BUFFSIZE (default: NCCL's 4 MiB)",
        json_schema_extra=_flag(None, MULTI_GPU),
    )
    nccl_nvls_enable: bool | None = Field(
        None,
        description="NCCL_NVLS_ENABLE (default: on where supported)",
        json_schema_extra=_flag(None, MULTI_GPU),
    )
    nccl_ring_channels: int | None = Field(
        None,
        ge=1,
        le=64,
        description="NCCL ring channels (default: the GPU's estimate)",
        json_schema_extra=_flag(None, MULTI_GPU),
    )
    torch_nccl_avoid_record_streams: bool | None = Field(
        None,
        description="TORCH_NCCL_AVOID_RECORD_STREAMS (torch before 2.8)",
        json_schema_extra=_flag(None, MULTI_GPU),
    )
    gpus_per_node: Count | None = Field(
        None,
        description="GPUs per node, for NCCL (default 8)",
        json_schema_extra=_flag(None, MULTI_GPU),
    )
    float8: bool = Field(
        False,
        description="Float8 linear training (torchao)",
        json_schema_extra=_flag("--float8", MULTI_GPU),
    )
    float8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = Field(
        None,
        description="torchao's float8 recipe (default rowwise)",
        json_schema_extra=_flag("--float8-recipe", MULTI_GPU, commands=("predict",)),
    )
    float8_all_gather: bool = Field(
        False,
        description="FSDP2 all-gathers float8 weights (tensorwise)",
        json_schema_extra=_flag("--float8-all-gather", MULTI_GPU, commands=("predict",)),
    )
    async_tp: bool = Field(
        False,
        description="torchtitan's async TP (with --tp N --compile): Inductor's micro-pipeline pass",
        # No flag (kept off predict --help's 100 lines): --set parallel.async_tp=true.
        json_schema_extra=_flag(None, MULTI_GPU, commands=("predict",)),
    )

    pp: Count | None = Field(
        None,
        description="pipeline parallel over N GPUs (Llama presets)",
        json_schema_extra=_flag("--pp", MULTI_GPU, metavar="N", commands=("predict",)),
    )
    pp_schedule: Literal["1f1b", "interleaved-1f1b", "gpipe"] | None = Field(
        None,
        description="pipeline schedule (default 1f1b)",
        json_schema_extra=_flag("--pp-schedule", MULTI_GPU, metavar="NAME", commands=("predict",)),
    )
    microbatches: Count | None = Field(
        None,
        description="pipeline micro-batches (default: the batch)",
        json_schema_extra=_flag("--microbatches", MULTI_GPU, metavar="M", commands=("predict",)),
    )
    stages_per_rank: Count | None = Field(
        None,
        description="stages per rank (interleaved 1F1B; default 2)",
        # No flag (the predict --help cap): --set parallel.stages_per_rank=V.
        json_schema_extra=_flag(None, MULTI_GPU, commands=("predict",)),
    )
    cp: Count | None = Field(
        None,
        description="context parallel over N GPUs (Llama presets)",
        json_schema_extra=_flag("--cp", MULTI_GPU, metavar="N", commands=("predict",)),
    )
    rank: int | None = Field(
        None,
        ge=0,
        description="the rank to predict (default 0)",
        json_schema_extra=_flag("--rank", MULTI_GPU, metavar="R", commands=("predict",)),
    )
    all_ranks: bool = Field(
        False,
        description="predict every distinct rank, name the peak",
        json_schema_extra=_flag("--all-ranks", MULTI_GPU, commands=("predict",)),
    )

    @property
    def given(self) -> bool:
        """Whether any degree is set (an all-default section is no layout)."""
        return (self.fsdp, self.tp, self.dp, self.pp, self.cp) != (None,) * 5

    @model_validator(mode="after")
    def _pipeline_and_ranks(self) -> ParallelSection:
        # Pipeline settings go with a pipeline; a rank with a layout (scenario/ranks.py).
        pipeline = {
            "pp_schedule (--pp-schedule)": self.pp_schedule,
            "microbatches (--microbatches)": self.microbatches,
            "stages_per_rank": self.stages_per_rank,
        }
        stray = [name for name, value in pipeline.items() if value is not None]
        if stray and self.pp is None:
            raise ValueError(
                f"parallel.{', parallel.'.join(stray)} set a pipeline: add --pp N "
                "(e.g. --pp 2 --pp-schedule 1f1b)"
            )
        if self.rank is not None and self.all_ranks:
            raise ValueError("--rank R and --all-ranks exclude each other: give one")
        if (self.rank is not None or self.all_ranks) and not self.given:
            raise ValueError(
                "--rank and --all-ranks pick ranks of a layout: add --fsdp, --tp, --dp, --pp "
                "or --cp (a torchrun script: --world-size N)"
            )
        if self.rank is not None:
            world = 1
            for degree in (self.fsdp, self.tp, self.dp, self.pp, self.cp):
                world *= degree or 1
            if self.rank >= world:
                raise ValueError(
                    f"--rank {self.rank} is outside the layout's {world} ranks: use 0 to "
                    f"{world - 1}"
                )
        return self

    @model_validator(mode="after")
    def _ddp_options(self) -> ParallelSection:
        ddp_alone = self.dp is not None and self.fsdp is None and self.tp is None
        if (self.bucket_cap_mb is not None or self.gradient_as_bucket_view) and not ddp_alone:
            raise ValueError(
                "parallel.bucket_cap_mb (--bucket-cap-mb) and parallel.gradient_as_bucket_view "
                "(--gradient-as-bucket-view) are DDP's: they go with --dp N alone"
            )
        if self.dp is not None and self.tp is not None and self.fsdp is None:
            # torchtitan's parallelize_llama refuses DDP on a mesh of more than one dimension.
            raise ValueError(
                "--dp with --tp alone (DDP replicas of a tensor-parallel model) is not "
                "modelled: add --fsdp S (HSDP x TP: --dp R --fsdp S --tp N), or drop --dp"
            )
        if (self.float8_recipe is not None or self.float8_all_gather) and not self.float8:
            raise ValueError(
                "parallel.float8_recipe (--float8-recipe) and parallel.float8_all_gather "
                "(--float8-all-gather) configure --float8: add it, or drop them"
            )
        if self.float8 and self.fsdp is None:
            # torchtitan trains float8 under FSDP2 (its converters run before apply_fsdp).
            raise ValueError(
                "--float8 is modelled with FSDP2, as torchtitan trains it: add --fsdp N "
                "(--fsdp 1 for one GPU)"
            )
        if self.async_tp and self.tp is None:
            raise ValueError("parallel.async_tp pipelines tensor parallel's collectives: add --tp N")
        return self
