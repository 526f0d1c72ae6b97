"""A job's launch command after `oomkit predict` / `oomkit fit` (interfaces/cli/_launchers.py):
`torchrun --nproc_per_node 8 train.py ARGS` had been refused as unrecognized arguments."""

from __future__ import annotations

import json

import pytest
from _cli_in_process import run_in_process
from hypothesis import given
from hypothesis import strategies as st

from oomkit.interfaces.cli._launchers import LauncherError, launch_read

# A script's own arguments: any words, oomkit's option names and launcher names included.
ARGS = st.lists(
    st.one_of(
        st.sampled_from(["--lr", "3e-4", "--", "python", "torchrun", "--world-size", "-m", "x.py"]),
        st.text(alphabet="abc-=0123456789.", min_size=1, max_size=8),
    ),
    max_size=6,
)


@given(st.integers(1, 16), st.integers(1, 4), ARGS, st.booleans())
def test_torchrun_s_ranks_are_the_world_size_and_the_rest_the_script_s(per_node, nodes, args, spelled):
    """--nproc_per_node N x --nnodes M ranks; the rendezvous options pass over; whatever
    follows the script is its own, as after `--`."""
    count = f"--nproc-per-node={per_node}" if spelled else "--nproc_per_node"
    launcher = [count] if spelled else [count, str(per_node)]
    words = ["predict", "--gpu", "h100", "torchrun", "--standalone", "--rdzv_backend", "c10d",
             *launcher, "--nnodes", str(nodes), "train.py", *args]
    read = launch_read(words, "predict")
    assert read is not None
    world = per_node * nodes
    assert read.words == ["predict", "--gpu", "h100", "train.py", *(["--world-size", str(world)] if world > 1 else [])]
    assert read.script_args == args


def test_python_and_python_m_torch_distributed_run_are_read():
    plain = launch_read(["fit", "/usr/bin/python3", "-u", "-X", "dev", "train.py", "--bs", "8"], "fit")
    assert plain is not None
    assert (plain.words, plain.script_args) == (["fit", "train.py"], ["--bs", "8"])
    assert plain.said == "read as `oomkit fit train.py -- --bs 8`"
    module = launch_read(["predict", "python", "-m", "torch.distributed.run", "--nproc_per_node=4", "t.py"], "predict")
    assert module is not None and module.words == ["predict", "t.py", "--world-size", "4"]


def test_no_launcher_reads_nothing_and_one_after_the_separator_is_the_script_s():
    assert launch_read(["predict", "gpt2-124m", "--batch", "8"], "predict") is None
    assert launch_read(["predict", "train.py", "--", "python", "torchrun"], "predict") is None


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (["torchrun", "--nproc_per_node", "gpu", "t.py"], "--nproc_per_node gpu names no fixed number"),
        (["torchrun", "--nnodes", "1:4", "t.py"], "--nnodes 1:4 names no fixed number"),
        (["torchrun", "-m", "pkg.train"], "runs a module (-m)"),
        (["torchrun", "--nproc_per_node", "2"], "names no script"),
        (["python", "-m", "pkg.train"], "runs a module (python -m)"),
        (["accelerate", "launch", "t.py"], "does not read `accelerate launch` commands"),
        (["deepspeed", "t.py"], "DeepSpeed is not modelled"),
        (["--world-size", "4", "torchrun", "--nproc_per_node", "2", "t.py"], "--world-size 4 is not the launch command's 2 ranks"),
    ],
)
def test_a_command_it_cannot_read_says_what_to_type(words, message):
    with pytest.raises(LauncherError, match=message.replace("(", r"\(").replace(")", r"\)")):
        launch_read(["predict", *words], "predict")


SCRIPT = """
import sys, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
print("args", sys.argv[1:])
"""


def test_the_cli_runs_the_script_a_pasted_command_names(tmp_path):
    """`oomkit predict python train.py 12582912` runs train.py with its argument (a 12 MiB
    tensor: 12 MiB reserved) and says how it read the command; a command it cannot read
    exits 2 with the advice."""
    (tmp_path / "train.py").write_text(SCRIPT)
    result = run_in_process(
        ["predict", "--gpu", "h100", "--json", "python", "train.py", str(12 << 20)], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "oomkit: read as `oomkit predict --gpu h100 --json train.py -- 12582912`" in result.stderr
    assert json.loads(result.stdout)["peak_reserved_bytes"] == 12 << 20
    refused = run_in_process(["predict", "accelerate", "launch", "train.py"], cwd=tmp_path)
    assert refused.returncode == 2
    assert "does not read `accelerate launch` commands" in refused.stderr


def test_oomkit_s_own_options_after_the_script_are_said_to_be_the_script_s(tmp_path):
    """`oomkit predict python train.py 4096 --json`: --json went to the script (as torchrun
    would pass it), and the reading says so."""
    (tmp_path / "train.py").write_text(SCRIPT)
    result = run_in_process(["predict", "python", "train.py", "4096", "--json"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        "oomkit: read as `oomkit predict train.py -- 4096 --json`; --json after the script went "
        "to the script: oomkit's own options go before the launch command"
    ) in result.stderr
