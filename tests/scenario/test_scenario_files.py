"""A Scenario as data: JSON and TOML round trips, overrides, keywords and its errors."""

from __future__ import annotations

import json
import re
import typing

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import oomkit
from oomkit.errors import ScenarioError
from oomkit.scenario import (
    Scenario,
    apply_overrides,
    scenario_from_data,
    scenario_to_data,
    scenario_to_toml,
)
from oomkit.scenario.files import read_scenario_data
from oomkit.scenario.keywords import keyword_fields, scenario_from_keywords

_COUNT = st.one_of(st.none(), st.integers(1, 2**31 - 1))
_NAME = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)


def _optional(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def scenario_data(draw):
    """Plain data of a scenario that validates (combinations it refuses are discarded)."""
    kind = draw(st.sampled_from(["preset", "hf", "function", "script"]))
    model = {
        "preset": {"preset": draw(st.sampled_from(["gpt2-124m", "llama-8b", "bert-base"]))},
        "hf": {"hf": draw(_NAME)},
        "function": {"function": f"{draw(_NAME)}.py:{draw(_NAME)}"},
        "script": {"script": f"{draw(_NAME)}.py", "script_args": draw(st.lists(_NAME, max_size=3))},
    }[kind]
    builder = kind in ("preset", "hf")
    step = {
        "batch": None if kind == "script" else draw(_COUNT),
        "seq": None if kind == "script" else draw(_COUNT),
        "compile": draw(st.booleans()),
        "values": draw(st.dictionaries(
            st.builds(lambda f, n: f"{f}.py:{n}", _NAME, st.integers(1, 9999)),
            st.one_of(st.integers(-(2**40), 2**40), st.floats(-1e9, 1e9, allow_nan=False)),
            max_size=2,
        )),
    }
    if builder:
        step |= {
            "mode": draw(_optional(st.sampled_from(["train", "inference"]))),
            "precision": draw(_optional(st.sampled_from(["fp32", "bf16-mixed", "bf16"]))),
            "optimizer": draw(_optional(st.sampled_from(["adamw", "sgd", "adafactor"]))),
            "grad_accum": draw(_COUNT),
            "max_grad_norm": draw(_optional(st.floats(0.01, 100.0))),
            "checkpointing": draw(_optional(st.sampled_from(["none", "full", "selective-op"]))),
        }
    data = {"model": model, "step": {k: v for k, v in step.items() if v is not None}}
    if builder and draw(st.booleans()):
        data["lora"] = {
            "rank": draw(st.integers(1, 256)),
            "targets": draw(_optional(st.lists(_NAME, min_size=1, max_size=3))),
            "dropout": draw(_optional(st.floats(0.0, 0.99))),
            "dora": draw(st.booleans()),
        }
        data["lora"] = {k: v for k, v in data["lora"].items() if v is not None}
    if builder and draw(st.booleans()):
        data["quantize"] = {"format": draw(st.sampled_from(["nf4", "fp4", "int8"])),
                            "double_quant": draw(st.booleans())}
    data["target"] = {
        "gpu": draw(st.sampled_from(["h100", "rtx4090", "24GiB"])),
        "context_overhead_bytes": draw(_optional(st.integers(2**20, 2**40))),
        "cudnn_version": draw(_COUNT),
    }
    data["target"] = {k: v for k, v in data["target"].items() if v is not None}
    if kind == "preset" and draw(st.booleans()):
        data["parallel"] = {"fsdp": draw(st.integers(1, 64))}
    data["run"] = {"steps": draw(st.integers(1, 9)), "budget_bytes": draw(st.integers(2**20, 2**50))}
    data["search"] = {"max_batch": draw(st.integers(1, 2**20)), "smallest_gpu": draw(st.booleans())}
    try:
        scenario_from_data(data)
    except ScenarioError:
        assume(False)
    return data


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(scenario_data())
def test_a_scenario_survives_json_and_toml_round_trips(data):
    """Scenario -> JSON -> Scenario and Scenario -> TOML -> Scenario give the same Scenario."""
    import tomllib

    scenario = scenario_from_data(data)
    saved = scenario_to_data(scenario)
    assert scenario_from_data(json.loads(json.dumps(saved))) == scenario
    assert scenario_from_data(tomllib.loads(scenario_to_toml(scenario))) == scenario
    assert saved["version"] == 1


def test_defaults_are_left_out_and_restored():
    """The saved form says only what was asked; reading it back restores every default."""
    scenario = Scenario(model={"preset": "gpt2-124m"}, step={"batch": 8})
    assert scenario_to_data(scenario) == {
        "version": 1, "model": {"preset": "gpt2-124m"}, "step": {"batch": 8}
    }
    back = scenario_from_data(scenario_to_data(scenario))
    assert (back.target.gpu, back.search.max_batch, back.lora) == ("h100", 65536, None)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"model": {"preset": "x"}, "step": {"batch": 0}},
         "--batch (step.batch): must be at least 1; got 0"),
        ({"model": {"preset": "x"}, "step": {"batch": 2**40}},
         "--batch (step.batch): must be at most 2147483647; got 1099511627776"),
        ({"model": {"preset": "x"}, "lora": {"alpha": 4}},
         "--lora-alpha configures LoRA: add --lora R (e.g. --lora 16), or drop it."),
        ({"model": {"preset": "x"}, "step": {"bach": 3}},
         "step.bach: unknown key (did you mean step.batch?): check its spelling"),
        ({"model": {"function": "t.py:build"}, "step": {"precision": "bf16"}},
         "--precision applies to presets and --hf only: t.py:build runs your step as written"),
        ({"model": {"script": "train.py"}, "step": {"batch": 8}},
         "--batch size a preset or a builder; a whole script (train.py) takes its sizes from "
         "its own arguments"),
        ({"model": {"preset": "x"}, "run": {"budget_bytes": "24"}},
         "--budget (run.budget_bytes): '24' has no unit"),
        ({"model": {"preset": "x"}, "parallel": {"bucket_cap_mb": float("nan")}},
         "--bucket-cap-mb (parallel.bucket_cap_mb): must be a finite number"),
        ({"model": {"preset": "x"}, "lora": {"rank": 8, "dropout": float("nan")}},
         "--lora-dropout (lora.dropout): must be a finite number"),
        ({"model": {"preset": "x"}, "run": {"steps": 10**8}},
         "--steps 100000000: each step is recorded in full, and past 1,000 that takes hours"),
        ({"model": {"preset": "x"}, "target": {"torch_version": "two"}},
         "--torch-version (target.torch_version): cannot read PyTorch version 'two'"),
        ({"model": {"preset": "x", "hf": "y"}}, "give either a TARGET or --hf, not both"),
        ({"version": 2, "model": {"preset": "x"}}, "scenario version 2 is not one this oomkit"),
    ],
)
def test_errors_name_the_flag_and_the_field(data, message):
    """Each refusal names the field by its flag and its path, and says what to do."""
    with pytest.raises(ScenarioError, match=None) as raised:
        scenario_from_data(data)
    assert message in str(raised.value)


@settings(max_examples=40, deadline=None)
@given(section=st.text(min_size=1, max_size=20))
def test_an_unknown_section_is_named(section):
    """A section no scenario has (a typo, or anything a file holds) is refused by its name."""
    assume(section not in Scenario.model_fields)
    with pytest.raises(ScenarioError) as raised:
        scenario_from_data({"model": {"preset": "x"}, section: {"a": 1}})
    message = str(raised.value)
    assert re.search(
        r"\]: unknown section( \(did you mean \[\w+\]\?\))?: check its spelling \(`oomkit "
        r"predict \.\.\. --dump-config`",
        message,
    )
    if section.isprintable():
        assert message.startswith(f"[{section}]: ")
    # A control character is shown as \\xNN (tab and newline are left as they are).
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", message)


def _numeric_fields() -> list[tuple[str, str]]:
    from oomkit.scenario.sections import _numeric

    found = []
    for section, field in Scenario.model_fields.items():
        model = next((a for a in typing.get_args(field.annotation) if isinstance(a, type)),
                     field.annotation)
        for name, inner in getattr(model, "model_fields", {}).items():
            if _numeric(inner.annotation):
                found.append((section, name))
    return found


NUMERIC_FIELDS = _numeric_fields()


def test_the_numeric_fields_are_found():
    """The walk below reaches the sections' counts, sizes and rates (not a vacuous property)."""
    assert {("step", "batch"), ("run", "budget_bytes"), ("lora", "dropout"),
            ("search", "max_batch")} <= set(NUMERIC_FIELDS)
    assert ("step", "compile") not in NUMERIC_FIELDS  # a bool field takes true/false


@settings(max_examples=60, deadline=None)
@given(where=st.sampled_from(NUMERIC_FIELDS), value=st.booleans())
def test_a_bool_is_no_number(where, value):
    """``batch = true`` in a file (or ``batch=True`` in Python) is refused, not read as 1."""
    section, key = where
    # The field that turns a section on, so that the section's own rule passes first.
    given_with = {"lora": {"rank": 8}, "lengths": {"file": "lengths.txt"}}.get(section, {})
    data = {"model": {"preset": "gpt2-124m"}, section: {**given_with, key: value}}
    with pytest.raises(ScenarioError) as raised:
        scenario_from_data(data)
    # Named by its flag and path ("--batch (step.batch): ..."), or its path where it has no flag.
    assert re.search(rf"\b{section}\.{key}\)?: expected a number, not {str(value).lower()}$",
                     str(raised.value))


def test_overrides_are_toml_values_or_text():
    """--set parses numbers, booleans and lists as TOML does; a bare word stays text."""
    data = apply_overrides(
        {"model": {"preset": "gpt2-124m"}},
        ["lora.rank=16", "step.compile=true", "lora.targets=['q', 'v']", "target.gpu=rtx4090",
         "lora.dropout=0.05"],
    )
    assert data == {
        "model": {"preset": "gpt2-124m"},
        "lora": {"rank": 16, "targets": ["q", "v"], "dropout": 0.05},
        "step": {"compile": True},
        "target": {"gpu": "rtx4090"},
    }
    with pytest.raises(ScenarioError, match="--set takes section.key=value; got 'lora'"):
        apply_overrides({}, ["lora"])


def test_keywords_are_the_flags_names():
    """The short form's keywords are the flags without dashes; sections may be mappings."""
    fields = keyword_fields()
    assert fields["batch"] == ("step", "batch")
    assert fields["lora"] == ("lora", "rank")
    assert fields["context_overhead"] == ("target", "context_overhead_bytes")
    assert fields["budget"] == ("run", "budget_bytes")
    scenario = scenario_from_keywords(
        "llama-8b", batch=4, seq=2048, gpu="rtx4090", lora={"rank": 16, "alpha": 32},
        quantize="nf4", budget="20GiB",
    )
    assert scenario_to_data(scenario) == {
        "version": 1,
        "model": {"preset": "llama-8b"},
        "step": {"batch": 4, "seq": 2048},
        "lora": {"rank": 16, "alpha": 32},
        "quantize": {"format": "nf4"},
        "target": {"gpu": "rtx4090"},
        "run": {"budget_bytes": 20 * 2**30},
    }
    with pytest.raises(
        ScenarioError, match=r"^oomkit.predict\(\) has no keyword 'bach'; did you mean batch=3\?"
    ):
        scenario_from_keywords("gpt2-124m", bach=3)
    # A section's field named as section_field: the mapping that gives it.
    with pytest.raises(
        ScenarioError,
        match=r"^oomkit.predict\(\) has no keyword 'lora_rank'; did you mean lora=\{'rank': 16\}\?",
    ):
        scenario_from_keywords("gpt2-124m", lora_rank=16)
    # A huge value is shown shortened, not copied into the message.
    with pytest.raises(ScenarioError) as raised:
        scenario_from_keywords("gpt2-124m", bach=list(range(10**6)))
    assert str(raised.value).startswith(
        "oomkit.predict() has no keyword 'bach'; did you mean batch=[0, 1, 2, 3, 4, 5, ...]?"
    )
    assert len(str(raised.value)) < 300
    # Nothing like it: no guess, the list of keywords.
    with pytest.raises(
        ScenarioError, match=r"^oomkit.predict\(\) has no keyword 'zzzz': give a field"
    ):
        scenario_from_keywords("gpt2-124m", zzzz=1)
    # oomkit.fit's keywords are fit's: its errors say so.
    with pytest.raises(ScenarioError, match=r"^oomkit.fit\(\) has no keyword 'bach'"):
        oomkit.fit("gpt2-124m", bach=3)


def test_an_unknown_key_or_section_close_to_a_known_one_gets_a_guess():
    """`--set step.bach=3` / a file's [stpe]: the known name it is close to; none when none is."""
    with pytest.raises(ScenarioError) as raised:
        scenario_from_data({"model": {"preset": "gpt2-124m"}, "step": {"bach": 3}})
    assert str(raised.value).startswith("step.bach: unknown key (did you mean step.batch?): ")
    with pytest.raises(ScenarioError) as raised:
        scenario_from_data({"model": {"preset": "gpt2-124m"}, "stpe": {"batch": 3}})
    assert str(raised.value).startswith("[stpe]: unknown section (did you mean [step]?): ")
    with pytest.raises(ScenarioError) as raised:
        scenario_from_data({"model": {"preset": "gpt2-124m"}, "step": {"zzz": 3}})
    assert str(raised.value).startswith("step.zzz: unknown key: check its spelling")


def test_a_config_file_is_read_or_refused_in_one_line(tmp_path):
    """TOML and JSON files are read; a saved prediction's scenario is taken from it; a broken
    file is a ScenarioError naming the file."""
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\npreset = "gpt2-124m"\n\n[step]\nbatch = 2\n')
    assert read_scenario_data(toml) == {"model": {"preset": "gpt2-124m"}, "step": {"batch": 2}}
    saved = tmp_path / "p.json"
    saved.write_text(json.dumps({"fits": True, "scenario": {"model": {"preset": "bert-base"}}}))
    assert read_scenario_data(saved) == {"model": {"preset": "bert-base"}}
    broken = tmp_path / "bad.toml"
    broken.write_text("[model\n")
    with pytest.raises(ScenarioError, match="bad.toml: not valid TOML"):
        read_scenario_data(broken)
    with pytest.raises(ScenarioError, match="cannot read the config file"):
        read_scenario_data(tmp_path / "missing.toml")


def test_a_long_run_of_steps_is_spliced_from_lengths_not_recorded():
    """--steps past 1,000 is refused for a recording (each step is recorded in full), taken
    with --lengths (a run spliced from one recording a length, as across-runs.md shows)."""
    assert scenario_from_data({"model": {"preset": "x"}, "run": {"steps": 1000}}).run.steps == 1000
    spliced = scenario_from_data(
        {"model": {"preset": "x"}, "run": {"steps": 2000}, "lengths": {"file": "lengths.txt"}})
    assert spliced.run.steps == 2000


@pytest.mark.parametrize("number", [24, 80.5])
def test_a_gpu_given_as_a_bare_number_asks_for_a_unit(tmp_path, number):
    """gpu=24 (a keyword, or a TOML number) has no unit: a ScenarioError suggesting the
    size with one (it had said only "Input should be a valid string")."""
    message = (
        "--gpu (target.gpu): a GPU is a catalog name or a memory size with a unit, e.g. "
        f"'rtx4090' or '{number}GiB'; got the number {number}"
    )
    with pytest.raises(ScenarioError) as raised:
        oomkit.predict("gpt2-124m", gpu=number)
    assert str(raised.value) == message
    toml = tmp_path / "run.toml"
    toml.write_text(f'[model]\npreset = "gpt2-124m"\n\n[target]\ngpu = {number}\n')
    with pytest.raises(ScenarioError, match="got the number"):
        oomkit.load_scenario(toml)
