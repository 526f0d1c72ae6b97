"""``Scenario``: one typed, validated record of what a user asks oomkit to predict or fit.

Every way in builds the same record: the Python API (``oomkit.predict(scenario)`` or the short
form ``oomkit.predict("gpt2-124m", batch=8)``), a TOML or JSON file (``--config run.toml``),
the command line (its flags are generated from these fields: ``flag`` below) and the MCP tools
(whose input schemas are this model's JSON Schema). A section's and a field's names are the
override paths (``--set lora.rank=16``), as torchtitan's job configs name theirs
(torchtitan/config/job_config.py: one dataclass per section, ``--section.field`` overrides).

The record holds what the user said: ``None`` means "the default", resolved when the scenario
runs (``oomkit.scenario.options``), where each default the result depends on is named.
Validation here is cheap (no torch): types, ranges and combinations that cannot run; what only
a built model can tell (an unknown preset, a shape the model rejects) is refused when it is
built, with the same field names.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from oomkit.core.trace.step_count import MAX_RECORDED_STEPS
from oomkit.scenario.machine import ParallelSection, TargetSection
from oomkit.scenario.sections import (
    LengthsSection,
    LoraSection,
    ModelSection,
    QuantizeSection,
    RunSection,
    SearchSection,
    StepSection,
    _Section,
    field_flag,
)
from oomkit.scenario.torchtitan_section import TorchtitanSection

__all__ = [
    "SCENARIO_VERSION",
    "LengthsSection",
    "LoraSection",
    "ModelSection",
    "ParallelSection",
    "QuantizeSection",
    "RunSection",
    "Scenario",
    "SearchSection",
    "StepSection",
    "TargetSection",
    "TorchtitanSection",
    "field_flag",
    "flag_fields",
    "section_model",
    "section_flag",
]

SCENARIO_VERSION = 1


class Scenario(_Section):
    """What a user asks: what runs, its step, the target machine, and how to run.

    Build one in Python (``Scenario(model={"preset": "gpt2-124m"}, step={"batch": 8})``),
    read one from a file (``oomkit.scenario.load_scenario``), or let the CLI make one from
    its flags (``oomkit predict ... --dump-config`` prints it as TOML).
    """

    version: Literal[1] = Field(1, description="the scenario format's version (1)")
    # Sections are frozen, so one default instance can be shared by every scenario.
    model: ModelSection = ModelSection()
    step: StepSection = StepSection()
    lora: LoraSection | None = None
    quantize: QuantizeSection | None = None
    lengths: LengthsSection | None = None
    target: TargetSection = TargetSection()
    parallel: ParallelSection | None = None
    run: RunSection = RunSection()
    search: SearchSection = SearchSection()
    torchtitan: TorchtitanSection | None = None

    @model_validator(mode="before")
    @classmethod
    def _builder_fields_first(cls, data: Any) -> Any:
        """A builder or a script sets its own precision, optimizer, LoRA...: refused before the
        sections are checked, so the error is that one (not "lora.rank is missing")."""
        if not isinstance(data, Mapping):
            return data
        model = data.get("model")
        if not isinstance(model, Mapping):
            return data
        kind = next((k for k in ("function", "script") if model.get(k) is not None), None)
        if kind is None or any(model.get(k) is not None for k in ("preset", "hf")):
            return data
        given = []
        for section, name in _BUILDER_OWN:
            values = data.get(section)
            if isinstance(values, Mapping) and values.get(name) not in (None, False):
                given.append(_flag_words(section, name))
        step = data.get("step")
        if isinstance(step, Mapping) and step.get("checkpoint_reentrant"):
            given.append("--checkpoint-reentrant")
        for section in ("lora", "quantize"):
            values = data.get(section)
            if isinstance(values, Mapping):
                given.extend(_flag_words(section, name) for name in values)
        if given:
            _refuse_builder_fields(str(model[kind]), kind, given)
        return data

    @model_validator(mode="before")
    @classmethod
    def _script_world_size(cls, data: Any) -> Any:
        """``--world-size N`` is one flag: with a script it is the ranks torchrun starts it on
        (``model.script_world_size``), not a torchtitan job's (``torchtitan.world_size``)."""
        if not isinstance(data, Mapping):
            return data
        model, job = data.get("model"), data.get("torchtitan")
        if not isinstance(model, Mapping) or model.get("script") is None:
            named = isinstance(model, Mapping) and any(
                model.get(k) is not None for k in ("preset", "hf", "function")
            )
            # --world-size alone (a count of the wrong type is the field's own error, below)
            alone = isinstance(job, Mapping) and "job" not in job and not isinstance(
                job.get("world_size", False), bool
            )
            if named and alone:
                raise ValueError(
                    "--world-size N is the ranks of a torchrun script (train.py) or of a "
                    "--torchtitan job; lay out a preset, --hf model or file.py:function with "
                    "--fsdp N, --dp N or --tp N (e.g. `oomkit predict llama3-8b --fsdp 8`)"
                )
            return data
        if not isinstance(job, Mapping) or "job" in job or "world_size" not in job:
            return data
        # --rank R / --all-ranks, moved to the job by _one_rank_flag: the script's rank(s).
        names = {"world_size": "script_world_size", "rank": "script_rank",
                 "all_ranks": "script_all_ranks"}
        stray = sorted(set(job) - set(names))
        if stray:
            raise ValueError(
                f"torchtitan.{', torchtitan.'.join(stray)} set a --torchtitan job: a torchrun "
                "script (train.py --world-size N) takes --world-size, --rank and --all-ranks"
            )
        moved = {**model, **{names[key]: value for key, value in job.items()}}
        return {**{k: v for k, v in data.items() if k != "torchtitan"}, "model": moved}

    @model_validator(mode="before")
    @classmethod
    def _one_rank_flag(cls, data: Any) -> Any:
        """``--rank R`` is one flag: with ``--torchtitan`` it is the job's rank
        (``torchtitan.rank``), not a preset layout's (``parallel.rank``); ``--all-ranks`` too
        (``torchtitan.all_ranks``)."""
        if not isinstance(data, Mapping):
            return data
        parallel, job = data.get("parallel"), data.get("torchtitan")
        if isinstance(parallel, Mapping) and parallel.get("all_ranks") and job is not None:
            if parallel.get("rank") is not None:
                raise ValueError("--rank R and --all-ranks exclude each other: give one")
            job = {**(job.model_dump() if isinstance(job, TorchtitanSection) else job),
                   "all_ranks": True}
            rest = {key: value for key, value in parallel.items() if key != "all_ranks"}
            return {**data, "parallel": rest or None, "torchtitan": job}
        if not isinstance(parallel, Mapping) or parallel.get("rank") is None or job is None:
            return data
        rank = parallel["rank"]
        if isinstance(job, Mapping):
            if job.get("rank") not in (None, rank):
                raise ValueError(
                    f"--rank {rank} and torchtitan.rank {job['rank']} differ: give the job's "
                    "rank once"
                )
            job = {**job, "rank": rank}
        elif isinstance(job, TorchtitanSection):
            job = TorchtitanSection.model_validate({**job.model_dump(), "rank": rank})
        rest = {key: value for key, value in parallel.items() if key != "rank"}
        return {**data, "parallel": rest or None, "torchtitan": job}

    @model_validator(mode="after")
    def _combinations(self) -> Scenario:
        kind = self.model.kind
        if self.torchtitan is not None:
            _torchtitan_alone(self)
        if kind == "script":
            # --batch reaches a script through its own argument (--batch-arg); the others
            # only as its arguments after --.
            from oomkit.scenario.script_batch import batch_arg_known

            varied = batch_arg_known(
                self.model.script or "", self.model.script_args, self.model.script_batch_arg
            )
            sized = ("seq", "image_size") if varied else ("batch", "seq", "image_size")
            sizes = [n for n in sized if getattr(self.step, n) is not None]
            if sizes:
                flags = " and ".join(field_flag(StepSection, n) or n for n in sizes)
                raise ValueError(
                    f"{flags} size a preset or a builder; a whole script ({self.model.script}) "
                    "takes its sizes from its own arguments: pass them after -- (e.g. "
                    f"`oomkit predict {self.model.script} -- --batch_size=8`), or name its "
                    "batch argument for fit to vary (`oomkit fit "
                    f"{self.model.script} --batch-arg --batch_size -- ARGS`)"
                )
        steps = self.run.steps
        if steps is not None and steps > MAX_RECORDED_STEPS and self.lengths is None:
            # Each step is recorded op by op (--steps 100000000 ran for hours); the peak
            # settles within a few. --lengths splices its steps from one recording a length.
            raise ValueError(
                f"--steps {steps}: each step is recorded in full, and past "
                f"{MAX_RECORDED_STEPS:,} that takes hours (the peak settles within a few "
                "steps); give at most that many, or --lengths FILE for a long run"
            )
        if self.lengths is not None:
            if self.parallel is not None and self.parallel.given:
                raise ValueError(
                    "--lengths is not searched sharded yet: --fsdp, --tp and --dp do not go "
                    "with --lengths; give one length (the longest) as --seq"
                )
            if self.step.seq is not None:
                raise ValueError(
                    "give --lengths or --seq, not both: --lengths sets every step's length"
                )
        parallel = self.parallel is not None and self.parallel.given
        # --compile with --fsdp/--tp/--dp: each block compiled, as torchtitan's apply_compile
        # (prediction/models/compiled_blocks.py), recorded on the fake process group.
        # --compile with --mode generate: refused where the step is built, with the reason
        # (StepOptions: prediction/models/options.py GENERATE_COMPILE_REASON).
        if parallel and kind == "hf":
            raise ValueError(
                "--fsdp, --tp and --dp shard a preset or a file.py:function that takes `mesh`; "
                "--hf models are not sharded by oomkit yet"
            )
        if parallel and kind == "script":
            raise ValueError(
                "--fsdp, --tp and --dp lay out a preset or a file.py:function step; a whole "
                "script shards itself: give the ranks torchrun starts it on, --world-size N "
                f"(`oomkit predict {self.model.script} --world-size 8 -- ARGS`)"
            )
        if parallel and self.parallel is not None and self.parallel.tp is not None:
            if kind in ("function", "script"):
                raise ValueError(
                    "--tp is modelled for the Llama presets (e.g. `oomkit predict llama3-8b "
                    "--tp 2`); a file.py:function step is not parallelized by oomkit: use "
                    "--fsdp N (the function then takes `mesh` and calls fully_shard)"
                )
        return self

# The fields a builder function or a script sets itself (torch.autocast, its own optimizer,
# torch.utils.checkpoint, ...): given for one, they would be ignored, so they are refused.
_BUILDER_OWN = (
    ("step", "precision"),
    ("step", "optimizer"),
    ("step", "optimizer_impl"),
    ("step", "checkpointing"),
    ("step", "mode"),
    ("step", "new_tokens"),
    ("step", "grad_accum"),
    ("step", "max_grad_norm"),
    ("model", "trainer_args"),
)


def _torchtitan_alone(scenario: Scenario) -> None:
    """A torchtitan job names its model, layout, batch and steps in its own config."""
    given = [
        words for words, set_ in (
            ("TARGET / --hf", scenario.model.kind is not None),
            ("--fsdp / --tp / --dp", scenario.parallel is not None and scenario.parallel.given),
            ("--batch", scenario.step.batch is not None),
            ("--seq", scenario.step.seq is not None),
            ("--lengths", scenario.lengths is not None),
            ("--lora", scenario.lora is not None),
            ("--quantize", scenario.quantize is not None),
            ("--compile", scenario.step.compile),
        ) if set_
    ]
    if given:
        raise ValueError(
            f"{', '.join(given)} do not go with --torchtitan: the job's own config sets them. "
            "Give torchtitan's overrides after -- (e.g. `oomkit predict --torchtitan "
            "llama3:llama3_8b --world-size 8 -- --training.local_batch_size 2 "
            "--parallelism.tensor_parallel_degree 2`)"
        )


def _flag_words(section: str, name: str) -> str:
    """A field as the user named it: its flag (``--lora-targets``), else its path."""
    return section_flag(section, name) or f"{section}.{name}"


def _refuse_builder_fields(what: str, kind: str, given: list[str]) -> None:
    one = len(given) == 1
    raise ValueError(
        f"{' and '.join(dict.fromkeys(given))} {'applies' if one else 'apply'} to presets and "
        f"--hf only: {what} runs your {'step' if kind == 'function' else 'script'} as written. "
        f"Set {'it' if one else 'them'} in your code instead (torch.autocast for precision, your "
        "optimizer, torch.utils.checkpoint, model.eval() / torch.no_grad()), then drop "
        f"{'it' if one else 'them'}."
    )


def section_model(section: str) -> type[BaseModel] | None:
    """The section record named ``section`` in a ``Scenario`` (``"lora"`` -> ``LoraSection``)."""
    field = Scenario.model_fields.get(section)
    if field is None:
        return None
    for candidate in (field.annotation, *typing.get_args(field.annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def section_flag(section: str, name: str) -> str | None:
    """The flag of a scenario field by its path (``("lora", "targets")`` -> ``--lora-targets``)."""
    model = section_model(section)
    return None if model is None else field_flag(model, name)


def flag_fields() -> list[tuple[str, str, str]]:
    """(section, field, flag) of every field that has a flag, section by section."""
    out = []
    for section in Scenario.model_fields:
        model = section_model(section)
        for name in model.model_fields if model is not None else ():
            flag = field_flag(model, name) if model is not None else None
            if flag is not None:
                out.append((section, name, flag))
    return out
