"""``predict`` and ``fit``'s flags, generated from the ``Scenario``'s fields, and back.

Each field that has a flag (``x-flag`` in its JSON Schema) becomes one argument, in the
``--help`` group its field names, with its description as help; its value is left as text for
the ``Scenario`` to validate, so the CLI, config files, the Python API and the MCP tools give
the same errors. ``scenario_from_args`` lays a ``--config`` file, then ``--set`` overrides,
then the flags given (they win) into one ``Scenario``.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oomkit.errors import ScenarioError

__all__ = [
    "CompactHelp",
    "GROUPS",
    "PRESET_NAMES",
    "catalog_epilog",
    "ScenarioFlag",
    "add_scenario_flags",
    "scenario_flags",
    "scenario_from_args",
    "stated_value",
]

# The --help groups, in order (a field's ``x-group``; "output" and "config" are the CLI's own).
GROUPS = (
    "workload",
    "precision and optimizer",
    "fine-tuning",
    "multi-GPU",
    "device and allocator",
    "run",
    "search",
    "config files",
    "output",
)
# The scenario's sections in the order their flags are listed.
_SECTIONS = (
    "model", "step", "lora", "quantize", "lengths", "parallel", "target", "run", "search",
    "torchtitan",
)


@dataclass(frozen=True)
class ScenarioFlag:
    """One flag and the field it sets.

    Attributes:
        section: the scenario section (``"step"``).
        name: the field (``"batch"``).
        flag: ``"--batch"``.
        help: the field's description.
        group: the ``--help`` group.
        metavar: what the value looks like (``"N"``), ``None`` for a switch or a choice.
        choices: the allowed values of a ``Literal`` field.
        switch: a boolean field: the flag alone sets it.
    """

    section: str
    name: str
    flag: str
    help: str
    group: str
    metavar: str | None
    choices: tuple[str, ...] | None
    switch: bool

    @property
    def dest(self) -> str:
        """The argparse destination: ``"step.batch"``."""
        return f"{self.section}.{self.name}"


def _choices(annotation: Any) -> tuple[str, ...] | None:
    """The values of a ``Literal[...]`` (or ``Literal[...] | None``) annotation."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(candidate) is typing.Literal:
            return tuple(str(v) for v in typing.get_args(candidate))
    return None


def scenario_flags(command: str) -> list[ScenarioFlag]:
    """The flags of ``command`` (``"predict"`` or ``"fit"``), section by section."""
    from oomkit.scenario.model import section_model

    flags = []
    for section in _SECTIONS:
        model = section_model(section)
        assert model is not None, section
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra
            if not isinstance(extra, dict) or "x-flag" not in extra:
                continue
            commands = extra.get("x-commands")
            if isinstance(commands, list) and command not in commands:
                continue
            flags.append(
                ScenarioFlag(
                    section,
                    name,
                    str(extra["x-flag"]),
                    field.description or "",
                    str(extra.get("x-group", "workload")),
                    str(extra["x-metavar"]) if "x-metavar" in extra else None,
                    _choices(field.annotation),
                    field.annotation is bool,
                )
            )
    return flags


def stated_value(text: str) -> tuple[str, float]:
    """``--value FILE:LINE=NUMBER`` -> ``("FILE:LINE", NUMBER)`` (an int when it is one)."""
    key, sep, number = text.rpartition("=")
    path, colon, line = key.rpartition(":")
    if not sep or not colon or not path or not line.isdigit():
        raise argparse.ArgumentTypeError(
            f"expected FILE:LINE=NUMBER, the line that reads the value and the value; got "
            f"{text!r}. Example: --value train.py:42=1024"
        )
    try:
        value: float = int(number)
    except ValueError:
        try:
            value = float(number)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"the value in {text!r} is not a number. Example: --value train.py:42=1024"
            ) from None
    return key, value


class CompactHelp(argparse.RawDescriptionHelpFormatter):
    """``predict`` / ``fit --help`` in about a screen: each flag and its help on one line where
    the terminal allows (up to 100 columns), the epilog's examples kept as written."""

    def __init__(self, prog: str) -> None:
        width = min(max(_terminal_columns(), 80), 100)
        super().__init__(prog, max_help_position=32, width=width)

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        # A line never breaks inside a hyphenated word: flags and names stay whole.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _terminal_columns() -> int:
    """The terminal's width (``$COLUMNS`` first); 100 when stdout is no terminal (a pipe, a
    file: nothing wraps it again)."""
    import shutil
    import sys

    if os.environ.get("COLUMNS") or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return 100


def _metavar(flag: ScenarioFlag) -> str | None:
    """A choice field's metavar: its choices when short (``{train,inference,generate}``), else
    ``NAME`` (the help lists them)."""
    if flag.choices is None:
        return flag.metavar
    listed = "{" + ",".join(flag.choices) + "}"
    return listed if len(listed) <= 14 else "NAME"


def add_scenario_flags(parser: argparse.ArgumentParser, command: str) -> dict[str, Any]:
    """TARGET, every flag of ``command``'s scenario fields in their groups, and the config-file
    flags (``--config``, ``--set``, ``--dump-config``); returns the groups by title, for the
    command's own flags."""
    groups: dict[str, Any] = {title: parser.add_argument_group(title) for title in GROUPS}
    groups["workload"].add_argument(
        "target",
        nargs="?",
        metavar="TARGET",
        help="a preset, file.py:function or a script.py",
    )
    for flag in scenario_flags(command):
        group = groups[flag.group]
        text = flag.help.replace("%", "%%")  # argparse formats help with %
        if flag.switch:
            group.add_argument(
                flag.flag, dest=flag.dest, action="store_true", default=None, help=text
            )
        elif flag.flag == "--checkpointing":  # a bare --checkpointing is full
            group.add_argument(
                flag.flag, dest=flag.dest, nargs="?", const="full", choices=flag.choices,
                metavar="MODE", help=text,
            )
        elif flag.flag == "--value":
            group.add_argument(
                flag.flag, dest=flag.dest, type=stated_value, action="append",
                metavar=flag.metavar, help=text,
            )
        else:
            group.add_argument(
                flag.flag, dest=flag.dest, choices=flag.choices, metavar=_metavar(flag),
                help=text,
            )
    config = groups["config files"]
    config.add_argument(
        "--config", metavar="FILE", help="a scenario file (TOML, or JSON); flags given win"
    )
    config.add_argument(
        "--set", dest="overrides", action="append", metavar="SECTION.KEY=VALUE",
        help="set any field, e.g. --set lora.rank=16",
    )
    config.add_argument(
        "--dump-config", action="store_true",
        help="print this command line's scenario as TOML",
    )
    return groups


def _given(args: argparse.Namespace, command: str) -> Iterator[tuple[str, str, Any]]:
    """(section, field, value) of each scenario flag given on the command line."""
    for flag in scenario_flags(command):
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        if flag.flag == "--value":
            stated: dict[str, float] = {}
            for line, number in value:
                if line in stated and stated[line] != number:  # not the last one silently
                    raise ScenarioError(
                        f"--value {line} is given twice ({stated[line]} and {number}); state "
                        "each line's value once"
                    )
                stated[line] = number
            value = stated
        yield flag.section, flag.name, value


def scenario_from_args(
    args: argparse.Namespace,
    command: str,
    *,
    script_args: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Any:
    """The ``Scenario`` of a command line: ``--config``, then ``--set``, then the flags given.

    Args:
        args: the parsed flags.
        command: ``"predict"`` or ``"fit"``.
        script_args: a script's own arguments (after ``--``).
        environ: the job's environment (``CUDA_MODULE_LOADING``); default ``os.environ``.

    Raises:
        ScenarioError: a bad config file, override or flag value (the field and flag named).
    """
    from oomkit.scenario.files import (
        apply_overrides,
        merge_data,
        read_scenario_data,
        scenario_from_data,
    )
    from oomkit.scenario.target import module_loading_from

    data: dict[str, Any] = {} if args.config is None else read_scenario_data(args.config)
    data = apply_overrides(data, args.overrides or ())
    flags: dict[str, dict[str, Any]] = {}
    for section, name, value in _given(args, command):
        if name == "values":
            saved = data.get(section)
            saved_values = saved.get("values") if isinstance(saved, dict) else None
            value = {**(saved_values if isinstance(saved_values, dict) else {}), **value}
        flags.setdefault(section, {})[name] = value
    if args.target is not None or "hf" in flags.get("model", {}):
        # What runs, named on the command line, replaces the file's choice (not added to it).
        saved = data.get("model")
        if isinstance(saved, dict):
            data["model"] = {
                k: v for k, v in saved.items()
                if k not in ("preset", "hf", "function", "script", "script_args")
            }
    if args.target is not None:
        from oomkit.scenario.keywords import what_runs

        flags.setdefault("model", {}).update(what_runs(args.target))
    job = "job" in flags.get("torchtitan", {}) or "job" in (data.get("torchtitan") or {})
    if script_args and job:
        # --torchtitan: what follows -- is torchtitan's own overrides (its launcher's); with
        # a script, --world-size alone is torchrun's and the words are the script's.
        flags.setdefault("torchtitan", {})["overrides"] = list(script_args)
    elif script_args:
        flags.setdefault("model", {})["script_args"] = list(script_args)
    merged = merge_data(data, flags)
    loading = module_loading_from(os.environ if environ is None else environ)
    if loading is not None and "cuda_module_loading" not in merged.get("target", {}):
        merged.setdefault("target", {})["cuda_module_loading"] = loading
    source = args.config if args.config is not None and not flags else None
    return scenario_from_data(merged, source=source)



# oomkit.prediction.models.PRESETS' names, for --help without importing torch (a test pins them
# to the presets' own).
PRESET_NAMES = (
    "gpt2-124m",
    "gpt2-355m",
    "gpt2-774m",
    "gpt2-1.5b",
    "llama-1b",
    "llama-3b",
    "llama-8b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "llama-13b",
    "bert-base",
    "bert-large",
    "vit-b16",
    "resnet50",
)


def catalog_epilog() -> str:
    """The presets and catalog GPUs, for the end of ``predict --help`` and ``fit --help``."""
    import textwrap

    from oomkit.core.gpus import CATALOG

    # Every preset; the GPUs counted, with a few names (their full list took four lines of a
    # help kept under 100): `oomkit gpus` lists them.
    text = (
        f"presets: {', '.join(PRESET_NAMES)} (`oomkit presets`). GPUs: {len(CATALOG)} in the "
        "catalog (`oomkit gpus`: h100, a100-80gb, rtx4090, ...), or a size such as 24GiB."
    )
    return textwrap.fill(text, 100, break_on_hyphens=False, break_long_words=False)
