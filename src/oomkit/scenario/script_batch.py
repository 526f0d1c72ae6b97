"""A whole script's batch, set through its own argument (``oomkit fit train.py -- ARGS``).

``oomkit fit train.py --batch-arg --batch_size -- ARGS`` searches the batch the script reads as
``--batch_size``; without ``--batch-arg``, the one batch-size argument in ARGS is varied, else
the one batch-size option the script's argparse parser defines (read from its source).

A script takes its batch from its command line, under a name of its own (``--batch_size`` for
nanoGPT, ``--per_device_train_batch_size`` for the Hugging Face Trainer, ``data.batch_size=`` for
Hydra). ``model.script_batch_arg`` names it; ``script_argv`` writes a batch into the script's
arguments as that argument; ``ScriptBatches`` records the script at each batch a search tries,
as ``oomkit predict train.py -- ARGS`` records it (``prediction/tracing/script_run.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomkit.errors import ConfigError, OomkitError
from oomkit.prediction.own_alloc_conf import watching_own_setting, with_own_setting_said

if TYPE_CHECKING:
    from oomkit.core.target import Target
    from oomkit.plan.batch_probe import RecordingBuilder
    from oomkit.scenario.model import Scenario

__all__ = [
    "BatchSaturated",
    "ScriptBatches",
    "batch_arg_known",
    "batch_arg_of",
    "batch_in_argv",
    "named_batch_args",
    "parser_batch_args",
    "script_argv",
]

# A script argument that names a batch size: `--batch_size`, `--batch-size`, `--bs`,
# `--per_device_train_batch_size`, `data.batch_size=` (Hydra / LightningCLI), `--batch`.
_BATCH_NAME = re.compile(r"(?:^|[._-])(?:batch[_-]?size|bs|batch)$", re.IGNORECASE)


def _positions(argv: Sequence[str], name: str) -> list[tuple[int, bool]]:
    """Where ``name`` is given in ``argv``: (index, written as ``NAME=VALUE``) each time."""
    found = []
    i = 0
    while i < len(argv):
        word = argv[i]
        if word.startswith(name + "="):
            found.append((i, True))
        elif word == name:
            if i + 1 >= len(argv):
                raise ConfigError(
                    f"the script's arguments end with {name}, which has no value: give it one "
                    f"(`-- {name} 8`), or let oomkit write it (drop it)"
                )
            found.append((i, False))
            i += 1  # its value is not a name
        i += 1
    return found


def script_argv(argv: Sequence[str], name: str, batch_size: int) -> tuple[str, ...]:
    """The script's arguments with its batch argument ``name`` set to ``batch_size``.

    Each place ``name`` is given (``NAME VALUE`` or ``NAME=VALUE``) gets the new value; where it
    is not given, ``NAME=VALUE`` is added at the end, which argparse (long options),
    nanoGPT's configurator (``--key=value`` only) and Hydra (``key=value``) all read. A short
    option (``-b``) is added as two words: argparse reads ``-b=8`` as the value ``=8``.

    Raises:
        ConfigError: ``name`` ends the arguments with no value.
    """
    out = list(argv)
    value = str(batch_size)
    places = _positions(out, name)
    for i, joined in places:
        if joined:
            out[i] = f"{name}={value}"
        else:
            out[i + 1] = value
    if not places:
        short = name.startswith("-") and not name.startswith("--") and len(name) == 2
        out.extend([name, value] if short else [f"{name}={value}"])
    return tuple(out)


def batch_in_argv(argv: Sequence[str], name: str) -> int | None:
    """The batch the script's arguments give as ``name`` (the last place it is given, as
    argparse keeps the last); ``None`` when they give none or not a whole number >= 1."""
    places = _positions(argv, name)
    if not places:
        return None
    i, joined = places[-1]
    text = argv[i].partition("=")[2] if joined else argv[i + 1]
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value >= 1 else None


def named_batch_args(argv: Sequence[str]) -> list[str]:
    """The arguments in ``argv`` named as a batch size, with a whole-number value."""
    names: list[str] = []
    for i, word in enumerate(argv):
        name, joined, value = word.partition("=")
        if not joined:
            value = argv[i + 1] if i + 1 < len(argv) and word.startswith("-") else ""
        if _BATCH_NAME.search(name.lstrip("-+~")) and value.isdigit() and name not in names:
            names.append(name)
    return names


# A script read for its parser's options at most this large: a training script is a few
# hundred kB at most; a larger file is not parsed (its batch argument is then the user's to say).
_MAX_SCRIPT_BYTES = 2 * 2**20


def parser_batch_args(script: str) -> list[str]:
    """The options the script's own argparse parser names as a batch size, as it spells them
    (``parser.add_argument("-b", "--batch-size", ...)`` gives ``--batch-size``), read from its
    source without running it; none where it cannot be read or parsed."""
    import ast

    try:
        path = Path(script)
        if not path.is_file() or path.stat().st_size > _MAX_SCRIPT_BYTES:
            return []
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            continue
        options = [
            arg.value
            for arg in node.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
            and arg.value.startswith("-")
        ]
        # The long spelling where there is one: argparse takes either; ours is the readable.
        spelled = [o for o in options if o.startswith("--")] or options
        if any(_BATCH_NAME.search(o.lstrip("-")) for o in options) and spelled[0] not in names:
            names.append(spelled[0])
    return names


def batch_arg_of(script: str, argv: Sequence[str], given: str | None) -> str:
    """The argument that sets the script's batch: ``given`` (``--batch-arg``), else the one
    argument in ``argv`` named as a batch size with a number (``--batch_size=8``), else the one
    option the script's argparse parser names as a batch size (``parser_batch_args``).

    Raises:
        OomkitError: none is given and ``argv`` holds none, or several, so which to vary is
            the user's to say.
    """
    if given is not None:
        return given
    named = named_batch_args(argv)
    if len(named) == 1:
        return named[0]
    parsed = [] if named else parser_batch_args(script)
    if len(parsed) == 1:
        return parsed[0]
    example = f"`oomkit fit {script} --batch-arg --batch_size -- ARGS`"
    if named:
        raise OomkitError(
            f"the script's arguments give {len(named)} batch sizes ({', '.join(named)}): say "
            f"which one fit varies with --batch-arg (e.g. --batch-arg {named[0]})"
        )
    if parsed:
        raise OomkitError(
            f"{script}'s parser has {len(parsed)} batch-size options ({', '.join(parsed)}): say "
            f"which one fit varies with --batch-arg (e.g. --batch-arg {parsed[0]})"
        )
    raise OomkitError(
        f"{script} is a whole script, which reads its batch from its own arguments: give it "
        f"after -- (e.g. `-- --batch_size=8`), or name the argument with --batch-arg as the "
        f"script's parser spells it (e.g. {example})"
    )


def batch_arg_known(script: str, argv: Sequence[str], given: str | None) -> bool:
    """Whether ``batch_arg_of`` names the script's batch argument (``--batch N`` can reach it)."""
    try:
        batch_arg_of(script, argv, given)
    except OomkitError:
        return False
    return True


class BatchSaturated(OomkitError):
    """Two batches allocated exactly the same, above a smaller one that allocated less: the
    script makes no batch larger than ``at`` (a dataset of at most ``at`` examples, whose
    loader gives them all at once, or a cap of its own), so every batch from ``at`` up needs
    what ``at`` needs. ``fit`` answers there (``fitting._fit_script``)."""

    def __init__(self, message: str, at: int) -> None:
        super().__init__(message)
        self.at = at

    def __reduce__(self) -> tuple[Any, tuple[str, int]]:
        # Raised in a forked probe (the search's jobs), it comes back pickled, `at` with it.
        return (type(self), (str(self), self.at))


class ScriptBatches:
    """A script recorded at each batch a search tries (a ``RecordingBuilder``'s ``record``).

    The first batch is recorded before the search (``first``): a script that sets
    ``PYTORCH_CUDA_ALLOC_CONF`` itself, or wraps DDP / ``fully_shard`` under ``--world-size``,
    changes the target every batch is replayed on (its allocator setting; NCCL's communicator),
    as ``predict_script`` applies them. That recording is kept until the search asks for it,
    so the batch is not recorded twice.
    """

    def __init__(self, scenario: Scenario, steps: int) -> None:
        model = scenario.model
        assert model.script is not None
        self.name = batch_arg_of(model.script, model.script_args, model.script_batch_arg)
        self._scenario = scenario
        self._steps = steps
        # The first batch's recording until the search asks for it (``first``): each other
        # batch is recorded when asked, and not kept.
        self._first_recorded: tuple[tuple[Any, ...], tuple[Any, str]] | None = None
        # Bytes allocated by category -> the smallest batch recorded with them (``_check_sized``).
        self._sized: dict[tuple[tuple[str, int], ...], int] = {}
        # The batches recorded, by batch size -> their bytes allocated by category.
        self._signature_of: dict[int, tuple[tuple[str, int], ...]] = {}
        # The NCCL layout of a --world-size script's communicator (ScriptRun.layout).
        self._layout: Any = None

    def argv(self, batch_size: int) -> tuple[str, ...]:
        """The script's arguments at ``batch_size``."""
        return script_argv(self._scenario.model.script_args, self.name, batch_size)

    def first(self, batch_size: int, target: Target) -> tuple[Target, list[str]]:
        """Record ``batch_size``; return the target every batch is replayed on and the
        warnings that come with it (the script's own allocator setting)."""
        with watching_own_setting() as own:
            recorded = self.record(batch_size, target, self._steps)
        self._first_recorded = (self._key(batch_size, target, self._steps), recorded)
        warned: list[str] = []
        if self._layout is not None and target.parallel is None:
            target = dataclasses.replace(target, parallel=self._layout)
        if own.changed:
            who = self._scenario.model.script or "the script"
            target, warned = with_own_setting_said(target, own, who)
        return target, warned

    def record(self, batch_size: int, target: Target, steps: int) -> tuple[Any, str]:
        """(the recording of the script run with its batch argument at ``batch_size``, its
        command line)."""
        from oomkit.prediction.tracing.script_run import record_script
        from oomkit.scenario.run import script_command

        first = self._first_recorded
        if first is not None and first[0] == self._key(batch_size, target, steps):
            self._first_recorded = None
            return first[1]
        model, step = self._scenario.model, self._scenario.step
        assert model.script is not None
        argv = self.argv(batch_size)
        run = record_script(model.script, argv, steps=steps, target=target,
                            values=step.values, world_size=model.script_world_size,
                            rank=model.script_rank or 0)
        recording = run.recording
        self._layout = run.layout
        self._check_sized(batch_size, recording.bytes_by_category)
        return recording, script_command(model.script, argv, model.script_world_size)

    @staticmethod
    def _key(batch_size: int, target: Target, steps: int) -> tuple[Any, ...]:
        """What a recording depends on: the batch, the steps, the GPU the script sees
        (torch.cuda reports its name, memory and capability) and the versions that pick
        kernels. The margin a search adds is context overhead, which the recording does not
        see."""
        gpu = target.gpu
        return (batch_size, steps, gpu.name, gpu.total_memory_bytes, gpu.compute_capability,
                target.cudnn_version, target.torch_version)

    def _check_sized(self, batch_size: int, allocated: Mapping[Any, int]) -> None:
        """Two batches that allocate exactly the same: the argument sizes nothing between
        them, so a search above the smaller would answer with sizes the script never holds.
        Above a smaller batch that allocated less, memory stopped growing there
        (``BatchSaturated``); with none, the argument may size nothing at all (refused)."""
        signature = tuple(sorted(allocated.items()))
        self._signature_of[batch_size] = signature
        seen = self._sized.get(signature)
        # The smallest batch with these bytes: recording it again (fit's search up to it) is
        # not two batches.
        self._sized[signature] = batch_size if seen is None else min(seen, batch_size)
        if seen is not None and seen != batch_size:
            low, high = sorted((seen, batch_size))
            grew = any(b < low and s != signature for b, s in self._signature_of.items())
            if grew:
                raise BatchSaturated(
                    f"{self._scenario.model.script} allocated exactly the same at {self.name} "
                    f"{low} and {high}, and less below: it makes no batch larger than {low}",
                    low,
                )
            raise OomkitError(
                f"{self._scenario.model.script} allocated exactly the same at {self.name} "
                f"{low} and {high}: {self.name} does not size its memory there (an argument "
                f"that sizes nothing, or a dataset of fewer than {high} examples, whose loader "
                f"gives all of them at once). Give the argument the script reads its batch from "
                f"with --batch-arg (e.g. --batch_size or --per_device_train_batch_size), or "
                f"--max-batch {low} to search below it."
            )

    def builder(self) -> RecordingBuilder:
        """A ``RecordingBuilder`` for ``max_batch_size`` and ``smallest_gpu``."""
        from oomkit.plan.batch_probe import RecordingBuilder

        return RecordingBuilder(self.record)
