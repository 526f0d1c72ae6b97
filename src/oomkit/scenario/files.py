"""Scenarios as data: from and to JSON and TOML, with ``section.key=value`` overrides.

A config file has one table per section, as torchtitan's job files do::

    [model]
    preset = "llama-8b"

    [step]
    batch = 4
    seq = 2048

    [lora]
    rank = 16

    [target]
    gpu = "rtx4090"

The saved form leaves out what is at its default (``exclude_defaults``), so a file says only
what was asked; reading it back gives the same ``Scenario``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from oomkit._files import refuse_special_file
from oomkit.errors import ScenarioError
from oomkit.scenario.model import SCENARIO_VERSION, Scenario, section_flag, section_model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "apply_overrides",
    "load_scenario",
    "merge_data",
    "read_scenario_data",
    "scenario_from_data",
    "scenario_to_data",
    "scenario_to_toml",
    "validation_message",
]

# A config file larger than this is not a config file (issue 36: bounded reads).
_MAX_FILE_BYTES = 1 << 20


def scenario_to_data(scenario: Scenario) -> dict[str, Any]:
    """The scenario as plain JSON data: ``version`` and every field not at its default."""
    data = scenario.model_dump(mode="json", exclude_defaults=True)
    return {"version": SCENARIO_VERSION, **{k: v for k, v in data.items() if v != {}}}


def scenario_to_toml(scenario: Scenario) -> str:
    """The scenario as a TOML config file (``--dump-config``; ``--config`` reads it back)."""
    import tomli_w

    return tomli_w.dumps(scenario_to_data(scenario))


def validation_message(exc: ValidationError, source: str | None = None) -> str:
    """One message for a pydantic ``ValidationError``: each problem with the flag and field
    path that set it (``--batch (step.batch): must be at least 1; got '0'``), and what to do."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = [str(part) for part in error["loc"]]
        text = _wording(error)
        if len(loc) >= 2:  # a field: named by its flag and its path
            path = ".".join(loc)
            if error["type"] == "extra_forbidden":
                text = _with_guess(text, loc[0], loc[1])
            flag = section_flag(loc[0], loc[1])
            lines.append(f"{flag} ({path}): {text}" if flag else f"{path}: {text}")
        elif error["type"] == "extra_forbidden" and loc:  # a section no scenario has
            said = _with_guess("unknown section", None, loc[0])
            lines.append(
                f"[{loc[0]}]: {said}: check its spelling (`oomkit predict ... "
                "--dump-config` shows the sections and keys)"
            )
        else:  # a section's or the whole scenario's rule: its message names the fields
            lines.append(text)
    head = f"{source}: " if source else ""
    return head + "; ".join(lines)


def _with_guess(text: str, section: str | None, key: str) -> str:
    """``unknown key`` / ``unknown section`` with the closest known name, where one is close
    (``step.bach`` -> ``did you mean step.batch?``)."""
    from oomkit._names import closest_name

    model = section_model(section) if section is not None else Scenario
    close = closest_name(key, model.model_fields if model is not None else ())
    if close is None:
        return text
    name = f"{section}.{close}" if section is not None else f"[{close}]"
    said = text.split(":")[0]
    return text.replace(said, f"{said} (did you mean {name}?)", 1)


def _wording(error: Any) -> str:
    """A pydantic error in oomkit's words: what is wrong, what was given."""
    kind, ctx = error["type"], error.get("ctx") or {}
    text = str(error["msg"])
    if kind == "value_error":
        return text.removeprefix("Value error, ")
    if kind == "missing":
        return "is required"
    got = _short(error.get("input"))
    words = {
        "greater_than_equal": f"must be at least {ctx.get('ge')}",
        "less_than_equal": f"must be at most {ctx.get('le')}",
        "greater_than": f"must be above {ctx.get('gt')}",
        "less_than": f"must be below {ctx.get('lt')}",
        "int_parsing": "expected a whole number",
        "int_from_float": "expected a whole number",
        "float_parsing": "expected a number",
        "finite_number": "must be a finite number",
        "bool_parsing": "expected true or false",
        "extra_forbidden": "unknown key: check its spelling (`oomkit predict ... --dump-config` "
        "shows the sections and keys)",
    }.get(kind)
    if kind == "literal_error":
        words = f"must be one of {ctx.get('expected')}"
    return f"{words or text}; got {got}"


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def scenario_from_data(data: Mapping[str, Any], source: str | None = None) -> Scenario:
    """Validate plain data (a config file, JSON, MCP arguments) as a ``Scenario``.

    Raises:
        ScenarioError: a field of the wrong type or range, an unknown section or key, or a
            combination that cannot run; the message names each field and its flag.
    """
    version = data.get("version", SCENARIO_VERSION)
    if version != SCENARIO_VERSION:
        raise ScenarioError(
            f"{source + ': ' if source else ''}scenario version {version!r} is not one this "
            f"oomkit reads (it reads version {SCENARIO_VERSION}); upgrade oomkit, or write the "
            "file again with `oomkit predict ... --dump-config`"
        )
    try:
        return Scenario.model_validate(dict(data))
    except ValidationError as exc:
        raise ScenarioError(validation_message(exc, source)) from None


def read_scenario_data(path: str | Path) -> dict[str, Any]:
    """The data of a TOML (``.toml``) or JSON (``.json``) config file, not yet validated.

    A JSON file may also be a saved ``oomkit predict --json`` result: its ``scenario`` is read.

    Raises:
        ScenarioError: the file cannot be read, is too large, or is not valid TOML or JSON.
    """
    file = Path(path)
    refuse_special_file(file, what="config file", error=ScenarioError)
    try:
        if file.stat().st_size > _MAX_FILE_BYTES:
            raise ScenarioError(
                f"{path}: {file.stat().st_size} bytes is too large for a config file (at most "
                f"{_MAX_FILE_BYTES}); give the TOML or JSON scenario file"
            )
        raw = file.read_bytes()
    except OSError as exc:
        raise ScenarioError(
            f"{path}: cannot read the config file ({exc.strerror or exc}); check the path"
        ) from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ScenarioError(f"{path}: not UTF-8 text; save the config file as UTF-8") from None
    if file.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ScenarioError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get("scenario"), dict):
            data = data["scenario"]  # a saved prediction: the request that made it
    else:
        try:
            data = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, RecursionError) as exc:
            raise ScenarioError(
                f"{path}: not valid TOML ({exc}); see `oomkit predict ... --dump-config` for "
                "the format"
            ) from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario is a table of sections; got {type(data).__name__}")
    return data


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file (TOML or JSON).

    Raises:
        ScenarioError: see ``read_scenario_data`` and ``scenario_from_data``.
    """
    return scenario_from_data(read_scenario_data(path), source=str(path))


def merge_data(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` laid on it, section by section (``over`` wins)."""
    out: dict[str, Any] = {k: dict(v) if isinstance(v, Mapping) else v for k, v in base.items()}
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out


def _value(text: str) -> Any:
    """An override's value: a TOML value where it parses as one (``16``, ``true``, ``0.05``,
    ``["q_proj", "v_proj"]``, ``"text"``), else the text as it is (``rtx4090``)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        return text


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` with each ``section.key=value`` (``--set``) applied, in order.

    Raises:
        ScenarioError: an override that is not ``section.key=value``.
    """
    out = merge_data(data, {})
    for item in overrides:
        path, sep, text = item.partition("=")
        parts = path.strip().split(".")
        if not sep or len(parts) != 2 or not all(parts):
            raise ScenarioError(
                f"--set takes section.key=value; got {item!r}. Example: --set lora.rank=16"
            )
        section, key = parts
        value = _value(text.strip())
        current = out.get(section)
        if current is not None and not isinstance(current, dict):
            raise ScenarioError(f"--set {item}: {section} is not a section")
        out[section] = {**(current or {}), key: value}
    return out
