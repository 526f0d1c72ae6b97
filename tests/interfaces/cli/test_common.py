"""The shared flags of `_common`: --gpu, --capacity, --alloc-conf and --torch-version."""

from __future__ import annotations

import argparse

import pytest

from oomkit.errors import ConfigError, UnknownGpuError
from oomkit.interfaces.cli import build_parser
from oomkit.interfaces.cli._common import (
    capacity_bytes,
    device_from_args,
    float_arg,
    stderr_console,
    stdout_console,
    torch_version_arg,
)

GiB = 2**30
# What torch.cuda.get_device_properties().total_memory reports on an RTX 4090 (the catalog).
RTX4090_TOTAL_BYTES = 25_756_696_576


@pytest.fixture(autouse=True)
def _in_a_dir_with_a_file_x(tmp_path, monkeypatch):
    # replay and simulate check that their input file exists while parsing.
    (tmp_path / "x").write_text("")
    monkeypatch.chdir(tmp_path)


def _subparser(command: str) -> argparse.ArgumentParser:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def test_capacity_is_a_size_and_never_a_gpu_name():
    """--capacity is the allocator's own limit: a GPU name is refused, pointing to --gpu."""
    with pytest.raises(ConfigError, match=r"--capacity takes a size, .* got 'rtx4090'. For a GPU"):
        capacity_bytes("rtx4090")


def test_capacity_of_a_size_is_the_size():
    """A size is taken as it is, with or without a unit, however small."""
    assert capacity_bytes("24GiB") == 24 * GiB
    assert capacity_bytes("16MiB") == 16 * 2**20
    assert capacity_bytes("1048576") == 2**20


def test_capacity_of_zero_is_refused():
    """A zero capacity says what to give instead."""
    with pytest.raises(ConfigError, match="must be above zero; got '0GiB'. Give a size"):
        capacity_bytes("0GiB")


def test_an_unknown_gpu_suggests_one():
    """A typo in --gpu names the catalog GPUs it is close to."""
    args = argparse.Namespace(gpu="rtx4091", capacity=None, context_overhead=None)
    with pytest.raises(UnknownGpuError, match="unknown GPU 'rtx4091'. Did you mean 'RTX 4090'"):
        device_from_args(args)


@pytest.mark.parametrize("command", ["replay", "simulate", "tune", "demo"])
def test_gpu_capacity_and_context_overhead_are_three_flags(command):
    """--gpu, --capacity and --context-overhead (in bytes) each set their own value."""
    parser = _subparser(command)
    positional = [] if command == "demo" else ["x"]
    args = parser.parse_args([*positional, "--capacity", "24GiB"])
    assert (args.gpu, args.capacity, args.context_overhead) == (None, "24GiB", None)
    args = parser.parse_args([*positional, "--gpu", "rtx4090", "--context-overhead", "1GiB"])
    assert (args.gpu, args.capacity, args.context_overhead) == ("rtx4090", None, GiB)


@pytest.mark.parametrize(
    ("command", "default"),
    [("replay", None), ("simulate", None), ("tune", None), ("demo", None),
     ("predict", "h100"), ("fit", "h100"), ("explain", None)],
)
def test_gpu_defaults(command, default):
    """Each command's --gpu default: an H100 prediction; none elsewhere (the replaying
    commands' default is --capacity 80GiB, the allocator's limit: test_device_defaults)."""
    positional = ["x"] if command in ("replay", "simulate", "tune") else []
    args = _subparser(command).parse_args(positional)
    assert _target_field(command, args, "gpu") == default


@pytest.mark.parametrize(
    ("command", "default"),
    [("replay", None), ("simulate", 80 * GiB), ("tune", 80 * GiB), ("demo", 80 * GiB)],
)
def test_device_defaults(command, default):
    """Without --gpu or --capacity: 80 GiB for the allocator, nothing subtracted (replay: none,
    the recorded run's own)."""
    from oomkit.interfaces.cli import demo, simulate, tune

    defaults = {"simulate": simulate._DEFAULT_CAPACITY, "tune": tune._DEFAULT_CAPACITY,
                "demo": demo._DEFAULT_CAPACITY}
    positional = ["x"] if command in ("replay", "simulate", "tune") else []
    args = _subparser(command).parse_args(positional)
    device = device_from_args(args, default_capacity=defaults.get(command))
    assert (None if device is None else (device.usable_bytes, device.context_overhead_bytes)) == (
        None if default is None else (default, 0)
    )


def _target_field(command, args, name):
    """A target flag's value as the command reads it: predict and fit read it from their
    scenario (its default included), the other commands from the flag's dest."""
    if command not in ("predict", "fit"):
        return getattr(args, name)
    from oomkit.interfaces.cli._scenario_flags import scenario_from_args

    args.target = args.target or "gpt2-124m"
    return getattr(scenario_from_args(args, command, environ={}).target, name)


@pytest.mark.parametrize("command", ["replay", "simulate", "predict", "fit"])
def test_torch_version_flag_everywhere(command):
    """--torch-version X.Y has dest torch_version wherever allocator rules are modelled."""
    positional = ["x"] if command in ("replay", "simulate") else []
    parser = _subparser(command)
    given = parser.parse_args([*positional, "--torch-version", "2.6"])
    assert _target_field(command, given, "torch_version") == "2.6"
    assert _target_field(command, parser.parse_args(positional), "torch_version") is None


def test_torch_version_arg_keeps_the_text():
    """A readable version is kept as given; anything else is a usage error that says the form."""
    assert torch_version_arg("2.4.0+cu121") == "2.4.0+cu121"
    assert torch_version_arg("nightly") == "nightly"
    with pytest.raises(argparse.ArgumentTypeError, match="cannot read PyTorch version 'two'"):
        torch_version_arg("two")


def test_bad_torch_version_is_a_usage_error(capsys):
    """`--torch-version two` exits 2 before anything runs, naming the expected form."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["simulate", "x", "--torch-version", "two"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --torch-version: cannot read PyTorch version 'two'" in err


def test_output_width_wide_only_for_pipes():
    """Results render at rich's width on a terminal or with $COLUMNS set, else unwrapped."""
    import io

    from oomkit.interfaces.cli._common import PIPE_WIDTH_COLUMNS, output_width

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert output_width(Tty(), {}) is None
    assert output_width(io.StringIO(), {"COLUMNS": "100"}) is None
    assert output_width(io.StringIO(), {}) == PIPE_WIDTH_COLUMNS == 1000


@pytest.mark.parametrize(
    ("text", "value"), [("0.05", 0.05), ("0", 0.0), ("1e-3", 0.001), (" 0.5 ", 0.5)]
)
def test_float_arg_returns_an_admitted_number(text, value):
    """A number the check admits comes back as a float (float()'s own syntax, spaces included)."""
    assert float_arg(text, lambda p: 0.0 <= p < 1.0, "expected a probability") == value


@pytest.mark.parametrize("text", ["1", "-0.1", "abc", "", "nan", "inf"])
def test_float_arg_refuses_what_the_check_does_not_admit(text):
    """Out of range, not a number, or NaN: argparse's usage error, naming what was expected."""
    with pytest.raises(argparse.ArgumentTypeError, match=rf"^expected a probability; got '{text}'$"):
        float_arg(text, lambda p: 0.0 <= p < 1.0, "expected a probability")


def test_consoles_print_emoji_codes_as_written(capsys):
    """A name holding an emoji code (a file ``a:fire:b.pickle``) is printed as it is written on
    stdout and stderr, never as the emoji; markup still styles (plain in a pipe)."""
    stdout_console().print("Replay of a:fire:b.pickle [bold]done[/bold]")
    stderr_console().print("hint: :thumbs_up: is a file name")
    out, err = capsys.readouterr()
    assert out == "Replay of a:fire:b.pickle done\n"
    assert err == "hint: :thumbs_up: is a file name\n"
