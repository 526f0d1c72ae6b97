"""``oomkit fit train.py``: a whole script's batch searched through its own argument
(``scenario/script_batch.py``), each batch recorded as ``oomkit predict train.py -- ARGS``
records it."""

from __future__ import annotations

import json
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.errors import OomkitError, ScenarioError
from oomkit.scenario.script_batch import (
    batch_arg_of,
    batch_in_argv,
    named_batch_args,
    parser_batch_args,
    script_argv,
)

pytest.importorskip("torch")

# A script as people write one: argparse, `device = "cuda"`, a loop at module level. One
# batch of 64 x 1024 float32 is 256 KiB times the batch.
SCRIPT = """
import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()
device = "cuda"
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024))
model.to(device)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
for _ in range(3):
    x = torch.randn(args.batch_size, 64, 1024, device=device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
"""

# Its batch argument read, and nothing sized by it.
FLAT = SCRIPT.replace("torch.randn(args.batch_size, 64", "torch.randn(8, 64")

OWN_SETTING = "import os\nos.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n" + SCRIPT

TORCHRUN = """
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--bs", type=int, default=2)
args = parser.parse_args()
dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
model = DDP(torch.nn.Linear(1024, 1024).to(local_rank), device_ids=[local_rank])
opt = torch.optim.SGD(model.parameters())
for _ in range(3):
    model(torch.randn(args.bs, 64, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def _write(folder, name, text):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _fit_json(capsys, *words):
    from oomkit.interfaces.cli import main

    code = main(["fit", "--json", *words])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


# --- the script's arguments ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "name", "expected"),
    [
        # argparse's two words, and `=`; every place it is given (argparse keeps the last)
        (["--batch-size", "8", "--lr", "1"], "--batch-size", ["--batch-size", "32", "--lr", "1"]),
        (["--batch_size=8", "x", "--batch_size=4"], "--batch_size",
         ["--batch_size=32", "x", "--batch_size=32"]),
        # not given: added as NAME=VALUE, which argparse, nanoGPT and Hydra read
        (["config/x.py"], "--batch_size", ["config/x.py", "--batch_size=32"]),
        ([], "data.batch_size", ["data.batch_size=32"]),
        # a short option as two words (argparse reads `-b=32` as the value "=32")
        (["--lr", "1"], "-b", ["--lr", "1", "-b", "32"]),
        # a longer name that starts the same is another argument
        (["--batch-size-eval", "8"], "--batch-size", ["--batch-size-eval", "8", "--batch-size=32"]),
    ],
)
def test_script_argv_writes_the_batch_where_the_script_reads_it(argv, name, expected):
    assert list(script_argv(argv, name, 32)) == expected


def test_a_batch_argument_without_its_value_is_refused():
    with pytest.raises(OomkitError, match=r"end with --batch-size, which has no value"):
        script_argv(["--lr", "1", "--batch-size"], "--batch-size", 8)


_WORDS = st.lists(st.sampled_from(["--lr", "1", "x.py", "--batch_size", "7", "--batch_size=3",
                                   "-b", "data.batch_size=2", "--batch_size_eval=5"]),
                  max_size=8)


@settings(max_examples=200, deadline=None)
@given(argv=_WORDS, name=st.sampled_from(["--batch_size", "-b", "data.batch_size"]),
       batch=st.integers(1, 10**6))
def test_the_batch_written_is_the_batch_read_and_nothing_else_changes(argv, name, batch):
    """Property: after script_argv, the script reads `batch` as `name`; every word that is
    not `name` or its value is kept, in order."""
    try:
        out = script_argv(argv, name, batch)
    except OomkitError:
        assert argv[-1] == name  # only a name that ends the arguments has no value
        return
    assert batch_in_argv(out, name) == batch
    assert len(out) in (len(argv), len(argv) + 1, len(argv) + 2)

    def others(words):  # the words that are neither the name nor its value
        skip, kept = False, []
        for word in words:
            if skip:
                skip = False
            elif word == name:
                skip = True
            elif not word.startswith(name + "="):
                kept.append(word)
        return kept

    assert others(out) == others(argv)


@pytest.mark.parametrize(
    ("argv", "found"),
    [
        (["config/train_shakespeare_char.py", "--batch_size=8"], ["--batch_size"]),
        (["--batch-size", "16", "--lr", "3"], ["--batch-size"]),
        (["--per_device_train_batch_size", "4", "--num_train_epochs", "1"],
         ["--per_device_train_batch_size"]),
        (["data.batch_size=4", "trainer.max_steps=10"], ["data.batch_size"]),
        (["--bs", "2"], ["--bs"]),
        # not a number, or not a batch: not named
        (["--batch-size", "auto", "--steps", "8"], []),
        (["--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8"],
         ["--per_device_train_batch_size", "--per_device_eval_batch_size"]),
    ],
)
def test_the_batch_arguments_the_script_is_given_are_found(argv, found):
    assert named_batch_args(argv) == found


def test_which_argument_is_varied_is_the_users_to_say_when_not_one():
    assert batch_arg_of("t.py", ["--bs", "2"], None) == "--bs"
    assert batch_arg_of("t.py", ["--bs", "2"], "--micro") == "--micro"
    with pytest.raises(OomkitError, match=r"2 batch sizes \(--a_batch_size, --b_batch_size\)"):
        batch_arg_of("t.py", ["--a_batch_size=1", "--b_batch_size=1"], None)
    with pytest.raises(OomkitError, match=r"name the argument with --batch-arg"):
        batch_arg_of("t.py", ["--lr", "1"], None)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ('p.add_argument("-b", "--batch-size", type=int)\np.add_argument("--lr")', ["--batch-size"]),
        ('group.add_argument("--batch_size", default=8)', ["--batch_size"]),
        ('p.add_argument("-bs", dest="batch_size")', ["-bs"]),
        ('p.add_argument("--batch-size")\np.add_argument("--eval-batch-size")',
         ["--batch-size", "--eval-batch-size"]),
        # not argparse's options: a positional, a non-constant name, a dict key
        ('p.add_argument("batch_size")\np.add_argument(NAME)\nd = {"--bs": 1}', []),
        ("def broken(:\n", []),
    ],
)
def test_the_batch_options_the_script_s_parser_defines_are_found(tmp_path, source, found):
    (tmp_path / "t.py").write_text(source)
    assert parser_batch_args(str(tmp_path / "t.py")) == found


def test_which_parser_option_is_varied_and_when_it_is_the_user_s_to_say(tmp_path):
    """The script's arguments come first; else its parser's one batch option; its several
    are the user's to choose among; a missing, unreadable or huge file names none."""
    script = tmp_path / "t.py"
    script.write_text('p.add_argument("--batch-size")\np.add_argument("--micro_bs")')
    with pytest.raises(OomkitError, match=r"parser has 2 batch-size options \(--batch-size, "
                       r"--micro_bs\): say which one fit varies with --batch-arg"):
        batch_arg_of(str(script), [], None)
    assert batch_arg_of(str(script), ["--micro_bs", "4"], None) == "--micro_bs"
    script.write_text('p.add_argument("-b", "--batch-size")')
    assert batch_arg_of(str(script), ["--lr", "1"], None) == "--batch-size"
    assert parser_batch_args(str(tmp_path / "missing.py")) == []
    assert parser_batch_args(str(tmp_path)) == []  # a folder
    script.write_text('p.add_argument("--batch-size")\n' + "#" * (3 * 2**20))
    assert parser_batch_args(str(script)) == []


@settings(max_examples=40, deadline=None)
@given(content=st.binary(max_size=300))
def test_any_bytes_as_a_script_are_read_without_raising(tmp_path_factory, content):
    """Hostile or broken script files (bad encodings, null bytes, deep nesting): no options
    found, or the ones parsed, never an exception."""
    folder = tmp_path_factory.mktemp("s")
    (folder / "t.py").write_bytes(content + b"\n" + b"(" * 200 + b")" * 200)
    assert isinstance(parser_batch_args(str(folder / "t.py")), list)


@settings(max_examples=60, deadline=None)
@given(name=st.text(min_size=1, max_size=12).filter(
    lambda n: not n.strip("-") or "=" in n or any(c.isspace() or not c.isprintable() for c in n)
))
def test_a_batch_arg_that_is_not_one_word_is_a_scenario_error(name):
    """Bad --batch-arg values (empty, dashes only, a value, whitespace, escapes): a
    ScenarioError that names the flag, never a later failure in the script."""
    from oomkit.scenario import scenario_from_data

    with pytest.raises(ScenarioError, match="--batch-arg"):
        scenario_from_data({"model": {"script": "t.py", "script_batch_arg": name}})


def test_a_batch_arg_needs_a_script():
    from oomkit.scenario import scenario_from_data

    with pytest.raises(ScenarioError, match=r"names a whole script's batch argument"):
        scenario_from_data({"model": {"preset": "gpt2-124m", "script_batch_arg": "--bs"}})


# --- fit of a script ------------------------------------------------------------------------


def test_fit_searches_the_scripts_own_batch_argument(tmp_path, capsys):
    """`oomkit fit s.py --batch-arg --batch-size --gpu 4GiB`: the answer is a batch whose
    script run fits and the next does not, each the figure `predict s.py -- --batch-size=N`
    gives; the JSON names the argument; the search started at 1 (the arguments give none)."""
    import oomkit

    script = _write(tmp_path, "s.py", SCRIPT)
    out = _fit_json(capsys, script, "--batch-arg", "--batch-size", "--gpu", "4GiB",
                    "--margin", "256MiB")
    assert out["batch_arg"] == "--batch-size"
    assert out["probe_order"][0] == 1
    batch = out["batch_size"]
    assert out["description"] == f"python {script} --batch-size={batch}"
    assert out["scenario"]["model"]["script_batch_arg"] == "--batch-size"
    usable = out["usable_bytes"] - 256 * 2**20
    fits = oomkit.predict(script, script_args=[f"--batch-size={batch}"], gpu="4GiB")
    over = oomkit.predict(script, script_args=[f"--batch-size={batch + 1}"], gpu="4GiB")
    assert fits.peak_reserved_bytes == out["peak_reserved_bytes"] <= usable
    assert over.peak_reserved_bytes > usable
    assert out["first_failing_batch"] == batch + 1


def test_fit_finds_the_batch_argument_the_script_is_given(tmp_path, capsys):
    """Without --batch-arg, the one batch argument after `--` is varied, starting from its
    value; the same search from Python."""
    import oomkit

    script = _write(tmp_path, "s.py", SCRIPT)
    out = _fit_json(capsys, script, "--gpu", "4GiB", "--max-batch", "64", "--", "--batch-size",
                    "16", "--lr", "0.1")
    assert out["batch_arg"] == "--batch-size"
    assert out["probe_order"][:3] == [16, 32, 64]
    assert out["batch_size"] == 64
    assert out["description"] == f"python {script} --batch-size 64 --lr 0.1"
    answer = oomkit.fit(script, script_args=["--batch-size", "16", "--lr", "0.1"], gpu="4GiB",
                        max_batch=64)
    assert (answer.batch_size, answer.batch_arg) == (64, "--batch-size")
    assert answer.peak_reserved_bytes == out["peak_reserved_bytes"]


def test_fit_finds_the_batch_option_the_script_s_parser_defines(tmp_path, capsys):
    """`oomkit fit s.py --gpu 4GiB`, no arguments: the parser's --batch-size is searched (from
    1), the answer the one --batch-arg --batch-size gives."""
    script = _write(tmp_path, "s.py", SCRIPT)
    out = _fit_json(capsys, script, "--gpu", "4GiB", "--max-batch", "64")
    named = _fit_json(capsys, script, "--gpu", "4GiB", "--max-batch", "64", "--batch-arg",
                      "--batch-size")
    assert out["batch_arg"] == "--batch-size"
    assert out["probe_order"][0] == 1
    assert out["batch_size"] == named["batch_size"] == 64
    assert out["peak_reserved_bytes"] == named["peak_reserved_bytes"]
    assert out["description"] == f"python {script} --batch-size=64"


def test_predict_batch_reaches_a_script_through_its_batch_argument(tmp_path):
    """`predict s.py --batch 24 -- --batch-size 8` is `predict s.py -- --batch-size 24`."""
    import oomkit

    script = _write(tmp_path, "s.py", SCRIPT)
    via = oomkit.predict(script, batch=24, script_args=["--batch-size", "8"], gpu="rtx4090")
    given = oomkit.predict(script, script_args=["--batch-size", "24"], gpu="rtx4090")
    assert via.peak_reserved_bytes == given.peak_reserved_bytes
    assert via.peak_allocated_bytes == given.peak_allocated_bytes
    assert via.description == f"{script} --batch-size 24"
    # Without the argument in ARGS: the option the script's parser defines.
    parsed = oomkit.predict(script, batch=24, gpu="rtx4090")
    assert parsed.peak_reserved_bytes == given.peak_reserved_bytes
    assert parsed.description == f"{script} --batch-size=24"


def test_an_argument_that_sizes_nothing_is_refused_naming_it(tmp_path, capsys):
    """The script reads --batch-size but sizes nothing by it: two batches allocate the same,
    so the search would run to --max-batch on nothing; exit 2 naming the argument."""
    from oomkit.interfaces.cli import main

    script = _write(tmp_path, "flat.py", FLAT)
    assert main(["fit", script, "--gpu", "4GiB", "--", "--batch-size", "4"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "allocated exactly the same at --batch-size 4 and 8" in err
    assert "Traceback" not in err


def test_a_batch_past_the_dataset_answers_where_memory_stops_growing(capsys):
    """examples/train_loop.py's dataset holds 1,024 examples: above that its loader gives all
    of them at once, so 1024 and 2048 allocate exactly the same while 512 did not. The answer
    is 1024, the figure `predict -- --batch_size 1024` gives, and the verdict says every larger
    batch allocates what it does (not "stopped at --max-batch", which the user did not set).
    An argument that sizes nothing at all is refused (the test above)."""
    from pathlib import Path

    import oomkit

    script = str(Path(__file__).resolve().parents[2] / "examples" / "train_loop.py")
    out = _fit_json(capsys, script, "--gpu", "rtx4090", "--", "--batch_size", "64")
    assert (out["batch_size"], out["memory_stops_growing_at"]) == (1024, 1024)
    assert out["first_failing_batch"] is None
    # The search found it (64 ... 1024, and 65536 traced ahead), then searched again up to
    # 1024, from it: one recording, which fits. The warning tells the first search's story.
    assert out["probe_order"] == [1024]
    assert any(
        w.startswith(f"{script} allocated exactly the same at --batch_size 1024 and 65536, and "
                     "less below")
        for w in out["warnings"]
    )
    alone = oomkit.predict(script, script_args=["--batch_size", "1024"], gpu="rtx4090")
    assert out["peak_reserved_bytes"] == alone.peak_reserved_bytes
    verdict = " ".join(out["verdict"].split())
    assert verdict.endswith(
        "; from batch 1024 up every batch allocates exactly the same (no larger batch is "
        "made: a dataset of at most 1024 examples, or a cap in the code)"
    )
    assert "--max-batch" not in verdict
    assert not any("(max_batch) fits" in w for w in out["warnings"])


def test_a_scripts_own_allocator_setting_is_the_searchs(tmp_path, capsys):
    """A script that sets PYTORCH_CUDA_ALLOC_CONF itself is searched with it, and says so."""
    script = _write(tmp_path, "own.py", OWN_SETTING)
    out = _fit_json(capsys, script, "--gpu", "4GiB", "--max-batch", "32", "--", "--batch-size",
                    "8")
    assert out["alloc_conf"] == "expandable_segments:True"
    assert any(w.startswith("allocator setting: ") and "expandable_segments:True" in w
               for w in out["warnings"])


def test_a_torchrun_scripts_batch_is_searched_per_rank(tmp_path, capsys):
    """`fit ddp.py --world-size 2 -- --bs 2`: rank 0 of 2 at each batch, as predict records
    it; its command line is torchrun's."""
    import oomkit

    script = _write(tmp_path, "ddp.py", TORCHRUN)
    out = _fit_json(capsys, script, "--world-size", "2", "--gpu", "4GiB", "--max-batch", "8",
                    "--", "--bs", "2")
    assert out["batch_arg"] == "--bs"
    assert out["batch_size"] == 8
    assert out["description"] == f"torchrun --nproc-per-node=2 {script} --bs 8"
    one = oomkit.predict(script, script_args=["--bs", "8"], world_size=2, gpu="4GiB")
    assert one.peak_allocated_bytes == out["peak_allocated_bytes"]


def test_smallest_gpu_checks_a_scripts_batch(tmp_path, capsys):
    script = _write(tmp_path, "s.py", SCRIPT)
    out = _fit_json(capsys, script, "--smallest-gpu", "--batch", "64", "--", "--batch-size", "8")
    assert out["batch_arg"] == "--batch-size"
    assert out["batch_size"] == 64
    assert out["smallest"] is not None


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["--gpu", "4GiB"], "name the argument with --batch-arg"),
        (["--global-batch", "64", "--smallest-gpu", "--", "--batch-size", "8"],
         "--global-batch and --lengths vary what the script sets itself"),
        (["--seq", "128", "--", "--batch-size", "8"], "--seq size a preset or a builder"),
    ],
)
def test_fit_of_a_script_refuses_what_it_cannot_vary(tmp_path, capsys, words, said):
    """The first: neither the arguments nor the script's parser name a batch size."""
    from oomkit.interfaces.cli import main

    text = SCRIPT if "--" in words else SCRIPT.replace('"--batch-size"', '"--width"')
    script = _write(tmp_path, "s.py", text)
    assert main(["fit", script, *words]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert said in err and "Traceback" not in err


def test_world_size_without_a_script_or_job_says_what_to_use(capsys):
    from oomkit.interfaces.cli import main

    assert main(["fit", "gpt2-124m", "--world-size", "8"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--world-size N is the ranks of a torchrun script" in err and "--fsdp N" in err


def test_a_torchrun_scripts_own_arguments_are_its_own_beside_world_size(tmp_path, capsys):
    """`predict ddp.py --world-size 2 -- --bs 4`: the words after -- are the script's (they
    had been taken for a torchtitan job's overrides, and refused)."""
    from oomkit.interfaces.cli import main

    script = _write(tmp_path, "ddp.py", TORCHRUN)
    assert main(["predict", script, "--world-size", "2", "--dump-config", "--", "--bs", "4"]) == 0
    import tomllib

    model = tomllib.loads(capsys.readouterr().out)["model"]
    assert (model["script_args"], model["script_world_size"]) == (["--bs", "4"], 2)


def test_fit_searches_the_batch_of_the_script_rank_asked(tmp_path, capsys):
    """model.script_rank: the search records that rank at each batch. Here rank 1 also holds
    a 3 GiB buffer: on 4 GiB less NCCL's buffers no batch of it fits, and the answer says so
    from batch 1 (the search went down from the script's --bs 32), with the usable bytes
    predict gives and the changes said as code (--precision and the like do not apply to a
    script). script_all_ranks is refused, with what to give instead."""
    import oomkit
    from oomkit.interfaces.cli import main

    heavy = TORCHRUN.replace(
        "opt = torch.optim.SGD",
        "held = torch.empty(3 * 2**30, dtype=torch.uint8, device='cuda') "
        "if dist.get_rank() == 1 else None\nopt = torch.optim.SGD",
    )
    script = _write(tmp_path, "ddp.py", heavy)
    words = [script, "--world-size", "2", "--gpu", "4GiB", "--max-batch", "64"]
    assert _fit_json(capsys, *words, "--", "--bs", "32")["batch_size"] == 64
    assert main(["fit", *words, "--set", "model.script_rank=1", "--", "--bs", "32"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    one = oomkit.predict(script, script_args=["--bs", "1"], world_size=2, rank=1, gpu="4GiB")
    assert one.required_bytes > one.usable_bytes - 256 * 2**20  # the default margin
    assert (
        f"not even batch 1 fits on custom 4.00 GiB: before train step 1 needs "
        f"{oomkit.format_bytes(one.required_bytes)} reserved, and of the "
        f"{oomkit.format_bytes(one.usable_bytes)} usable a margin of 256.00 MiB must stay free."
    ) in err
    assert 'Try mixed precision where your code has none (torch.autocast("cuda", ' in err
    assert "--precision" not in err and "--checkpointing" not in err
    assert "this same `oomkit fit` command with --batch 1 --smallest-gpu" in err
    with pytest.raises(oomkit.NoFeasibleBatchSizeError) as raised:
        oomkit.fit(script, script_args=["--bs", "32"], world_size=2, rank=1, gpu="4GiB",
                   max_batch=64)
    assert raised.value.batch_size == 1 and raised.value.usable_bytes == one.usable_bytes
    assert main(["fit", *words, "--set", "model.script_all_ranks=true", "--", "--bs", "2"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "fit searches one rank's batch of a torchrun script" in err
