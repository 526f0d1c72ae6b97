"""The CLI's flags are a deliberate interface: this test lists them."""

import argparse

import pytest

from oomkit.interfaces.cli import build_parser, main

EXPECTED = {
    "demo": ["--capacity", "--context-overhead", "--gpu", "--json", "--steps"],
    "diff": ["--device", "--force", "--html", "--json", "--rank-pattern", "--ray"],
    "doctor": ["--alloc-conf", "--json", "--no-live", "--torch-version"],
    "gpus": ["--json"],
    "presets": ["--json"],
    "explain": ["--alloc-conf", "--device", "--gpu", "--html", "--json", "--memory-fraction", "--no-measure", "--rank-pattern", "--ray"],
    "fit": [
        "--alloc-conf",
        "--attn-implementation",
        "--batch",
        "--batch-arg",
        "--bucket-cap-mb",
        "--checkpoint-reentrant",
        "--checkpointing",
        "--compile",
        "--compute-dtype",
        "--config",
        "--context-overhead",
        "--cuda-version",
        "--cudnn-version",
        "--dora",
        "--double-quant",
        "--dp",
        "--dump-config",
        "--eval",
        "--float8",
        "--fsdp",
        "--global-batch",
        "--gpu",
        "--grad-accum",
        "--gradient-as-bucket-view",
        "--hf",
        "--hf-class",
        "--image-size",
        "--jobs",
        "--json",
        "--lengths",
        "--lora",
        "--lora-alpha",
        "--lora-dropout",
        "--lora-modules-to-save",
        "--lora-targets",
        "--margin",
        "--max-batch",
        "--max-gpus",
        "--max-grad-norm",
        "--mode",
        "--multiple-of",
        "--optimizer",
        "--optimizer-impl",
        "--pad-to",
        "--power-of-two",
        "--precision",
        "--quantize",
        "--seed",
        "--seq",
        "--set",
        "--smallest-gpu",
        "--steps",
        "--torch-version",
        "--tp",
        "--trainer-args",
        "--value",
        "--world-size",
    ],
    "predict": [
        "--all-ranks",
        "--alloc-conf",
        "--attn-implementation",
        "--batch",
        "--bucket-cap-mb",
        "--budget",
        "--checkpoint-reentrant",
        "--checkpointing",
        "--compile",
        "--compute-dtype",
        "--config",
        "--context-overhead",
        "--cp",
        "--cuda-version",
        "--cudnn-version",
        "--dora",
        "--double-quant",
        "--dp",
        "--dump-config",
        "--float8",
        "--float8-all-gather",
        "--float8-recipe",
        "--fsdp",
        "--gpu",
        "--grad-accum",
        "--gradient-as-bucket-view",
        "--hf",
        "--hf-class",
        "--html",
        "--image-size",
        "--jobs",
        "--json",
        "--lengths",
        "--lora",
        "--lora-alpha",
        "--lora-dropout",
        "--lora-modules-to-save",
        "--lora-targets",
        "--max-grad-norm",
        "--microbatches",
        "--mode",
        "--new-tokens",
        "--no-remedies",
        "--optimizer",
        "--optimizer-impl",
        "--pad-to",
        "--pp",
        "--pp-schedule",
        "--precision",
        "--quantize",
        "--rank",
        "--seed",
        "--seq",
        "--set",
        "--steps",
        "--torch-version",
        "--torchtitan",
        "--tp",
        "--trainer-args",
        "--value",
        "--world-size",
    ],
    "run": ["--json", "--max-entries", "--snapshot-dir"],
    "experiment": ["--configs", "--from-tune", "--gpus", "--json", "--steps", "--timeout"],
    "report": ["--html", "--json", "--png"],
    "serve": [],
    "plan": ["--checkpointing", "--global-batch", "--gpus", "--jobs", "--json", "--margin", "--max-gpus", "--max-micro-batch", "--precision", "--price", "--ray", "--seq"],
    "mcp": ["--list-tools"],
    "replay": [
        "--alloc-conf",
        "--capacity",
        "--context-overhead",
        "--device",
        "--gpu",
        "--jobs",
        "--json",
        "--torch-version",
        "--verify",
        "--what-if",
    ],
    "simulate": [
        "--alloc-conf", "--capacity", "--context-overhead", "--gpu", "--json", "--torch-version"
    ],
    "tune": ["--capacity", "--context-overhead", "--device", "--gpu", "--jobs", "--json"],
}


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


@pytest.mark.parametrize("command", sorted(EXPECTED))
def test_flags(command):
    """Each subcommand has exactly the listed flags."""
    flags = sorted(
        opt
        for a in _subparsers()[command]._actions
        for opt in a.option_strings
        if opt.startswith("--") and opt != "--help"
    )
    assert flags == EXPECTED[command]


def test_no_command_is_usage_error(capsys):
    """`oomkit` alone prints help and exits 2."""
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_abbreviated_flags_are_refused(capsys):
    """`experiment --gpu 0` is not a shortened `--gpus 0`: an unknown flag, exit 2."""
    with pytest.raises(SystemExit) as exc:
        main(["experiment", "--gpu", "0", "--", "python", "train.py"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --gpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["predict", "gpt2-124m", "--bat", "2"])
    assert "unrecognized arguments: --bat" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["predict", "gpt2-124m", "--bach", "3"],
         "unrecognized arguments: --bach 3 (did you mean --batch?)"),
        (["predict", "gpt2-124m", "--batch-size=64"], "--batch-size=64 (did you mean --batch?)"),
        (["fit", "gpt2-124m", "--seq_len", "64", "--margn", "1GiB"],
         "--seq_len 64 --margn 1GiB (did you mean --seq for --seq_len, --margin for --margn?)"),
        (["gpus", "--jsn"], "unrecognized arguments: --jsn (did you mean --json?)"),
        # argparse says the required --gpus is missing before it sees --gpu: the guess follows.
        (["plan", "llama-8b", "--gpu", "h100", "--global-batch", "8", "--seq", "512"],
         "the following arguments are required: --gpus (did you mean --gpus for --gpu?)"),
        (["plan", "llama-8b", "--gpus", "h100", "--global-batch", "8", "--", "--sq", "1"],
         "the following arguments are required: --seq"),
    ],
)
def test_an_unknown_flag_close_to_a_command_s_own_gets_a_guess(capsys, words, said):
    """A typo or another tool's spelling (`--batch-size`) names the command's flag it is close
    to; `--lr` is not taken for `--lora` (the dashes every flag shares are not compared)."""
    with pytest.raises(SystemExit) as exc:
        main(words)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].endswith(said)
    with pytest.raises(SystemExit):
        main(["predict", "gpt2-124m", "--lr", "3"])
    assert capsys.readouterr().err.endswith("unrecognized arguments: --lr 3\n")


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


# capsys is read out (emptied) after each call, so every example starts from empty streams.
@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    command=st.sampled_from(["predict", "fit"]),
    flags=st.lists(st.sampled_from(["--batch_size", "--lr", "--epochs", "--data_dir"]),
                   min_size=1, max_size=3, unique=True),
    value=st.integers(1, 512),
)
def test_a_scripts_own_arguments_without_the_separator_say_where_they_go(
    capsys, command, flags, value
):
    """`oomkit predict train.py --batch_size 64`: the script's arguments belong after `--`,
    and the error says so with the command to run; for a preset it stays argparse's own."""
    given_words = [word for flag in flags for word in (flag, str(value))]
    with pytest.raises(SystemExit) as exc:
        main([command, "train.py", *given_words])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    shown = " ".join(given_words)
    assert f"A script's own arguments go after `--`: oomkit {command} train.py [oomkit's " \
           f"options] -- {shown}" in err
    with pytest.raises(SystemExit):
        main([command, "gpt2-124m", *given_words])
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {shown}" in err and "go after" not in err
