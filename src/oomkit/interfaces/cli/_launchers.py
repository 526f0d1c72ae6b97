"""A job's own launch command after ``oomkit predict`` / ``oomkit fit``, read as oomkit's words.

Users paste the command they run: ``oomkit predict torchrun --nproc_per_node 8 train.py --lr
3e-4`` is ``oomkit predict train.py --world-size 8 -- --lr 3e-4``. Read here, before argparse
(which would take the launcher's options for oomkit's):

- ``torchrun`` and ``python -m torch.distributed.run`` (or the deprecated
  ``torch.distributed.launch``): ``--nproc_per_node N`` (``--nproc-per-node``) times ``--nnodes
  M`` ranks (torch/distributed/run.py), the world size; the rendezvous, logging and restart
  options change nothing a rank allocates and are passed over. ``gpu`` / ``auto`` as the count,
  or an elastic ``--nnodes MIN:MAX``, name no number: the error asks for ``--world-size``.
- ``python train.py`` (``python3``, interpreter options such as ``-u`` passed over).
- ``accelerate launch`` and ``deepspeed`` are refused with what to type instead: accelerate's
  launcher turns its options into environment variables its ``Accelerator`` reads, and DeepSpeed
  is not modelled.

Everything after the script is the script's own arguments, as after ``--``; oomkit's options go
before the launcher. A module run (``torchrun -m pkg.train``) is refused: oomkit runs a script
by its path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["LaunchRead", "LauncherError", "launch_read"]

# torchrun's options that take no value (torch/distributed/run.py get_args_parser); every
# other option not written as --name=value takes the next word.
_TORCHRUN_FLAGS = frozenset(
    {
        "--standalone",
        "--no-python",
        "--no_python",
        "--run-path",
        "--run_path",
        "--virtual-local-rank",
        "--virtual_local_rank",
    }
)
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
# python's options that take the next word as their value (python --help): -X opt, -W arg.
_PYTHON_VALUED = frozenset({"-X", "-W", "--check-hash-based-pycs"})
_PYTHONS = ("python", "python3")


class LauncherError(ValueError):
    """A launch command oomkit cannot read as its own words; the message says what to type."""


@dataclass(frozen=True)
class LaunchRead:
    """A command line with its launcher read: oomkit's words, the script's arguments, and the
    command it stands for, in oomkit's words (said on stderr)."""

    words: list[str]
    script_args: list[str]
    said: str


def _named(word: str) -> str:
    return os.path.basename(word)


def _value(options: list[str], names: tuple[str, ...]) -> str | None:
    """The last value given to one of ``names`` (``--name V`` or ``--name=V``)."""
    found = None
    for i, word in enumerate(options):
        for name in names:
            if word == name and i + 1 < len(options):
                found = options[i + 1]
            elif word.startswith(name + "="):
                found = word[len(name) + 1 :]
    return found


def _split_torchrun(rest: list[str], command: str) -> tuple[list[str], str, list[str]]:
    """torchrun's own options, the script, and its arguments."""
    i = 0
    while i < len(rest):
        word = rest[i]
        if word in ("-m", "--module"):
            raise LauncherError(
                "the launch command runs a module (-m): oomkit runs a script by its path; give "
                f"it as `oomkit {command} path/to/train.py --world-size N -- ARGS`"
            )
        if not word.startswith("-"):
            return rest[:i], word, rest[i + 1 :]
        i += 1 if ("=" in word or word in _TORCHRUN_FLAGS) else 2
    raise LauncherError("the launch command names no script: give the script's path after its options")


def _count(text: str | None, option: str, command: str) -> int:
    if text is None:
        return 1
    low, _, high = text.partition(":")
    if low.isdigit() and (not high or high == low) and int(low) > 0:
        return int(low)
    raise LauncherError(
        f"torchrun's {option} {text} names no fixed number of ranks, which oomkit needs: give "
        f"the world size, `oomkit {command} train.py --world-size N -- ARGS`"
    )


def _torchrun(before: list[str], rest: list[str], command: str) -> LaunchRead:
    options, script, script_args = _split_torchrun(rest, command)
    per_node = _count(
        _value(options, ("--nproc_per_node", "--nproc-per-node")), "--nproc_per_node", command
    )
    nodes = _count(_value(options, ("--nnodes",)), "--nnodes", command)
    world = per_node * nodes
    given = _value(before, ("--world-size",))
    if given is not None and given != str(world):
        raise LauncherError(
            f"--world-size {given} is not the launch command's {world} ranks ({per_node} per "
            f"node x {nodes} node(s)): give one of them"
        )
    words = [*before, script]
    if world > 1 and given is None:
        words += ["--world-size", str(world)]
    return _read(words, script_args, command)


def _read(words: list[str], script_args: list[str], command: str) -> LaunchRead:
    shown = " ".join(["oomkit", command, *words[1:]])
    if script_args:
        shown += " -- " + " ".join(script_args)
    return LaunchRead(words, script_args, f"read as `{shown}`")


def launch_read(words: list[str], command: str) -> LaunchRead | None:
    """``words`` (the command first) with a launch command in them read as oomkit's (module
    docstring); ``None`` where there is none.

    Raises:
        LauncherError: a launch command oomkit cannot read; the message says what to type.
    """
    end = words.index("--") if "--" in words else len(words)  # the script's own words after
    launchers = (*_PYTHONS, "torchrun", "accelerate", "deepspeed")
    at = next((i for i in range(1, end) if _named(words[i]) in launchers), None)
    if at is None:
        return None
    before, launcher, rest = words[:at], _named(words[at]), words[at + 1 :]
    if launcher == "torchrun":
        return _torchrun(before, rest, command)
    if launcher in ("accelerate", "deepspeed"):
        what = (
            "accelerate's launcher passes its options to the script as environment variables"
            if launcher == "accelerate"
            else "DeepSpeed is not modelled"
        )
        shown = "accelerate launch" if launcher == "accelerate" else launcher
        raise LauncherError(
            f"oomkit does not read `{shown}` commands ({what}). Give the script itself: "
            f"`oomkit {command} train.py --world-size N -- ARGS`"
            + (
                "; a --mixed_precision of accelerate's is ACCELERATE_MIXED_PRECISION=bf16 in "
                "the environment"
                if launcher == "accelerate"
                else ""
            )
        )
    i = 0  # python's own options, then -m MODULE or the script
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "-m":
        i += 2 if rest[i] in _PYTHON_VALUED else 1
    if i < len(rest) and rest[i] == "-m":
        if i + 1 < len(rest) and rest[i + 1] in _TORCHRUN_MODULES:
            return _torchrun(before, rest[i + 2 :], command)
        raise LauncherError(
            "the launch command runs a module (python -m): oomkit runs a script by its path; "
            f"give it as `oomkit {command} path/to/train.py -- ARGS`"
        )
    if i >= len(rest):
        raise LauncherError("the launch command names no script: give the script's path")
    return _read([*before, rest[i]], rest[i + 1 :], command)
