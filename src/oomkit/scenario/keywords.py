"""The Python API's short form: ``oomkit.predict("gpt2-124m", batch=8, gpu="rtx4090")``.

Each keyword is a scenario field named as its flag is (``batch`` for ``--batch``, ``lora`` for
``--lora``, ``context_overhead`` for ``--context-overhead``), or a whole section as a mapping
(``lora={"rank": 16, "alpha": 32}``); the first argument names what runs as the CLI's TARGET
does. So the short form, the CLI, config files and the MCP tools build one ``Scenario``.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping
from typing import Any

from oomkit.errors import ScenarioError
from oomkit.scenario.files import merge_data, scenario_from_data
from oomkit.scenario.model import Scenario, flag_fields, section_model

__all__ = ["keyword_fields", "scenario_from_keywords", "what_runs"]


def what_runs(target: str) -> dict[str, str]:
    """A TARGET as the ``model`` field it names: ``file.py:function``, ``train.py`` or a preset."""
    path, sep, function = target.rpartition(":")
    if sep and path.endswith(".py") and function:
        return {"function": target}
    if target.endswith(".py"):
        return {"script": target}
    return {"preset": target}


def keyword_fields() -> dict[str, tuple[str, str]]:
    """Keyword -> (section, field): each flag's name without its dashes (``--lora-alpha`` ->
    ``lora_alpha``), and ``hf``, ``function``, ``script``, ``script_args``."""
    out = {
        flag.removeprefix("--").replace("-", "_"): (section, name)
        for section, name, flag in flag_fields()
    }
    for name in ("preset", "function", "script", "script_args"):
        out.setdefault(name, ("model", name))
    return out


def scenario_from_keywords(
    what: str | None = None, caller: str = "predict", /, **keywords: Any
) -> Scenario:
    """The ``Scenario`` of the short form.

    Args:
        what: a preset, ``file.py:function`` or ``train.py`` (as the CLI's TARGET).
        caller: the function the keywords were given to, named in errors (``fit``).
        keywords: fields by their flag's name (``batch=8``, ``gpu="rtx4090"``, ``lora=16``,
            ``quantize="nf4"``, ``fsdp=8``), or sections by name as mappings
            (``lora={"rank": 16, "alpha": 32}``, ``target={...}``).

    Raises:
        ScenarioError: an unknown keyword (the message lists the known ones), or a field the
            scenario refuses.
    """
    from oomkit.scenario.model import Scenario as _Scenario

    sections = set(_Scenario.model_fields) - {"version"}
    fields = keyword_fields()
    data: dict[str, Any] = {}
    if what is not None:
        data["model"] = what_runs(what)
    for key, value in keywords.items():
        if value is None:
            continue
        if key in sections and isinstance(value, Mapping):
            data = merge_data(data, {key: dict(value)})
        elif key in fields:
            section, name = fields[key]
            data = merge_data(data, {section: {name: value}})
        else:
            guess = _guess(key, value, fields)
            named = reprlib.repr(key)  # bounded, as the value in the guess
            if guess:
                raise ScenarioError(
                    f"oomkit.{caller}() has no keyword {named}; did you mean {guess}? "
                    "(Keywords are the flags' names without dashes, or sections as mappings.)"
                )
            known = ", ".join(sorted(fields))
            raise ScenarioError(
                f"oomkit.{caller}() has no keyword {named}: give a field by its flag's name "
                f"({known}) or a section as a mapping (e.g. lora={{'rank': 16}})"
            )
    return scenario_from_data(data)


def _guess(key: str, value: Any, fields: Mapping[str, tuple[str, str]]) -> str | None:
    """The keyword meant: a section's field as ``section_field`` (``lora_rank`` ->
    ``lora={'rank': 16}``), else the closest flag name (``bach`` -> ``batch``)."""
    from oomkit._names import closest_name

    shown = reprlib.repr(value)  # bounded: a huge value is not copied into the message
    section, _, name = key.partition("_")
    model = section_model(section) if name else None
    if model is not None and name in model.model_fields:
        return f"{section}={{{name!r}: {shown}}}"
    close = closest_name(key, fields)
    return f"{close}={shown}" if close else None
