"""record_script: a training script run as `python train.py ARGS`, up to its Nth optimizer step."""

from __future__ import annotations

import textwrap

import pytest
from _folders import files_in
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from oomkit import render_prediction
from oomkit.core.target import Target
from oomkit.errors import OomkitError, UserCodeError
from oomkit.prediction.predictor import predict, predict_recording
from oomkit.prediction.scripts import predict_script
from oomkit.prediction.tracing.script_run import ScriptSpec, record_script
from oomkit.scenario.user_function import load_user_step

RTX4090 = Target.resolve("rtx4090")

# A plain loop over a DataLoader of a Dataset, as tutorials write it.
PLAIN_LOOP = '''
import argparse
import torch
from torch.utils.data import DataLoader, Dataset

device = "cuda" if torch.cuda.is_available() else "cpu"


class Data(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.randn(32), torch.randint(0, 4, ())


parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--epochs", type=int, default=5)
args = parser.parse_args()
model = torch.nn.Sequential(
    torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)
).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(Data(), batch_size=args.batch_size, shuffle=True)
for epoch in range(args.epochs):
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"loss {loss.item():.3f}")
torch.save(model.state_dict(), "model.pt")
'''

# The same step as a builder (file.py:function): what the script's figure must equal.
PLAIN_TWIN = '''
import torch

device = "cuda" if torch.cuda.is_available() else "cpu"


def build(batch_size=16):
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"xy": (torch.randn(batch_size, 32, device=device),
                    torch.randint(0, 4, (batch_size,), device=device))}

    def step():
        x, y = state["xy"]
        state["loss"] = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        state["loss"].backward()
        opt.step()
        del x, y
        state["xy"] = (torch.randn(batch_size, 32, device=device),
                       torch.randint(0, 4, (batch_size,), device=device))

    return step, (model, opt, state)
'''

# The loop inside main(), behind the __main__ guard, with checkpoints written every step.
MAIN_LOOP = '''
import sys
import torch


def main(steps):
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    model = torch.nn.Linear(512, 512).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(steps):
        x = torch.randn(64, 512).pin_memory().to(device, non_blocking=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.save({"model": model.state_dict()}, f"ckpt_{i}.pt")
        torch.cuda.synchronize()
    with open("done.txt", "w") as f:
        f.write("finished")


if __name__ == "__main__":
    main(int(sys.argv[1]))
'''

MAIN_TWIN = '''
import torch


def build():
    model = torch.nn.Linear(512, 512).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {}

    def step():
        state.pop("x", None)
        state["x"] = x = torch.randn(64, 512, device="cuda")
        state["loss"] = model(x).square().mean()
        state["loss"].backward()
        opt.step()
        opt.zero_grad()

    return step, (model, opt, state)
'''


def _write(folder, name, text):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def _builder_peaks(folder, target_name):
    user = load_user_step(str(folder / target_name), gpu=RTX4090.gpu)  # builders default to 16
    prediction = predict(user.step_fn, track=user.track, target=RTX4090, steps=3)
    return prediction.peak_reserved_bytes, prediction.peak_allocated_bytes


def _script_peaks(run):
    prediction = predict_recording(run.recording, target=RTX4090)
    return prediction.peak_reserved_bytes, prediction.peak_allocated_bytes


def test_a_plain_dataloader_loop_equals_its_builder_form(tmp_path, monkeypatch):
    """`device = "cuda" if ... else "cpu"`, a DataLoader, argparse: 3 steps, the builder's bytes."""
    _write(tmp_path, "train.py", PLAIN_LOOP)
    _write(tmp_path, "twin.py", PLAIN_TWIN)
    monkeypatch.chdir(tmp_path)
    run = record_script("train.py", ["--batch-size", "16"], steps=3, target=RTX4090)
    assert run.steps_recorded == 3
    assert len(run.recording.step_starts) == 3
    assert _script_peaks(run) == _builder_peaks(tmp_path, "twin.py:build")
    # Stopped at the third step: the torch.save after the loop never ran.
    assert files_in(tmp_path) == ["train.py", "twin.py"]
    assert run.saves_skipped == 0


def test_argv_reaches_argparse(tmp_path, monkeypatch):
    """--batch-size 32 after `--` makes a bigger batch than the default 8: more bytes."""
    _write(tmp_path, "train.py", PLAIN_LOOP)
    monkeypatch.chdir(tmp_path)
    small = _script_peaks(record_script("train.py", [], steps=2, target=RTX4090))
    large = _script_peaks(record_script("train.py", ["--batch-size", "4096"], steps=2, target=RTX4090))
    assert large[1] > small[1]


def test_a_loop_in_main_stops_at_its_steps_and_writes_nothing(tmp_path):
    """main() behind __main__, cuda:0, set_device, pin_memory, synchronize: equal to its builder;
    the checkpoints it saves each step are skipped and the file after the loop never written."""
    _write(tmp_path, "loop.py", MAIN_LOOP)
    _write(tmp_path, "twin.py", MAIN_TWIN)
    before = files_in(tmp_path)
    run = record_script(tmp_path / "loop.py", ["20"], steps=3, target=RTX4090, cwd=tmp_path)
    assert run.steps_recorded == 3
    # Steps 1 and 2 reach their torch.save; step 3 stops at its optimizer step, before its own.
    assert run.saves_skipped == 2
    assert files_in(tmp_path) == before
    assert _script_peaks(run) == _builder_peaks(tmp_path, "twin.py:build")
    # Stopped: what it runs after its third step is not seen, and the answer says so.
    assert run.recording.assumptions["script stopped"].startswith(
        "after its first 3 optimizer step(s) (--steps); what it runs after them (an evaluation "
        "loop, a checkpoint, later epochs of other sizes) is not recorded"
    )


def test_a_script_that_ends_early_records_the_steps_it_ran(tmp_path):
    """A loop of 2 iterations asked for 3 steps: 2 recorded, and a warning says so."""
    _write(tmp_path, "loop.py", MAIN_LOOP)
    run = record_script(tmp_path / "loop.py", ["2"], steps=3, target=RTX4090, cwd=tmp_path)
    assert run.steps_recorded == 2
    assert any("ended after 2 optimizer step(s), fewer than the 3" in w for w in run.recording.warnings)
    assert "script stopped" not in run.recording.assumptions  # it ran to its end
    # It ran to its end: the file after its loop is written, as python would.
    assert (tmp_path / "done.txt").read_text() == "finished"


def test_a_script_without_an_optimizer_step_is_one_run_to_its_end(tmp_path):
    """A run with no optimizer step (an inference script, or a training script given 0
    iterations) is predicted whole: here the Linear(512, 512) it puts on the GPU, 1 MiB of
    weight and 2 KiB of bias, and a warning saying no step ran."""
    _write(tmp_path, "loop.py", MAIN_LOOP)
    run = record_script(tmp_path / "loop.py", ["0"], target=RTX4090, cwd=tmp_path)
    assert run.steps_recorded == 0 and run.recording.step_starts == ()
    assert sorted(e.size for e in run.recording.events if e.action == "alloc") == [2048, 1 << 20]
    assert any(w.startswith("no optimizer step ran: the prediction is of the whole script's")
               for w in run.recording.warnings)
    assert (tmp_path / "done.txt").read_text() == "finished"  # it ran to its end


def test_an_inference_script_peaks_where_its_forward_does(tmp_path):
    """model.eval() under inference_mode, 3 batches: the peak allocated is the weights, cuBLAS's
    workspace and one batch's tensors with the last batch's output."""
    _write(
        tmp_path,
        "infer.py",
        """
        import torch

        model = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
        ).to("cuda").eval()
        with torch.inference_mode():
            for _ in range(3):
                y = model(torch.randn(32, 256, device="cuda"))
        """,
    )
    prediction = predict_script(tmp_path / "infer.py", target=RTX4090)
    weights = (256 * 1024 + 1024 + 1024 * 256 + 256) * 4
    # At the second batch's ReLU: the first batch's y (still bound), x, the hidden and the
    # ReLU's output (not in place).
    batch = (32 * 256 + 32 * 256 + 2 * 32 * 1024) * 4
    workspace = prediction.prediction.peak_allocated_at.by_category_bytes.get("workspace", 0)
    assert prediction.prediction.steps == 0
    assert prediction.prediction.peak_allocated_bytes == weights + batch + workspace
    console = Console(record=True, width=120)
    render_prediction(prediction.prediction, console)
    shown = console.export_text()
    assert "Memory at peak allocated (the whole run)" in shown
    assert "warning: no optimizer step ran" in shown


def test_a_script_that_puts_nothing_on_the_gpu_is_refused(tmp_path):
    """Nothing on the GPU and no optimizer step: UserCodeError saying there is nothing."""
    _write(tmp_path, "cpu.py", "import torch\nprint(torch.ones(3).sum())\n")
    with pytest.raises(UserCodeError, match="without putting anything on the GPU"):
        record_script(tmp_path / "cpu.py", target=RTX4090, cwd=tmp_path)


def test_torchrun_style_code_is_refused_by_name(tmp_path):
    """init_process_group without a world size: refused, naming the line and --world-size."""
    _write(
        tmp_path,
        "ddp.py",
        """
        import os
        import torch
        import torch.distributed as dist

        if int(os.environ.get("WORLD_SIZE", "1")) >= 1:
            dist.init_process_group("nccl")
        """,
    )
    with pytest.raises(UserCodeError) as raised:
        record_script(tmp_path / "ddp.py", target=RTX4090)
    message = str(raised.value)
    assert "ddp.py:7 calls torch.distributed.init_process_group" in message
    assert "`oomkit predict train.py --world-size 8 -- ARGS`" in message


def test_a_ddp_wrapper_is_refused_by_name(tmp_path):
    """DistributedDataParallel(model) without a process group: refused at its line."""
    _write(
        tmp_path,
        "ddp.py",
        """
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(torch.nn.Linear(4, 4).cuda())
        """,
    )
    with pytest.raises(UserCodeError, match=r"ddp\.py:5 calls DistributedDataParallel"):
        record_script(tmp_path / "ddp.py", target=RTX4090)


@settings(max_examples=12, deadline=None)
@given(
    code=st.one_of(st.none(), st.integers(-300, 300), st.text(min_size=1, max_size=20)),
    before_steps=st.booleans(),
)
def test_a_script_exit_is_the_users_failure_unless_after_its_steps(tmp_path_factory, code, before_steps):
    """sys.exit(code) with a non-zero code: UserCodeError naming the line and the code;
    sys.exit(0) / sys.exit(): what ran is kept (after the model is on the GPU, before any step:
    the whole run)."""
    folder = tmp_path_factory.mktemp("exit")
    _write(
        folder,
        "exits.py",
        f"""
        import sys
        import torch

        model = torch.nn.Linear(8, 8).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if {not before_steps}:
            model(torch.randn(4, 8, device="cuda")).sum().backward()
            opt.step()
        sys.exit({code!r})
        """,
    )
    if code in (None, 0):  # a clean exit: what ran is predicted (no step: the whole run)
        run = record_script(folder / "exits.py", steps=3, target=RTX4090)
        assert run.steps_recorded == (0 if before_steps else 1)
        return
    with pytest.raises(UserCodeError) as raised:
        record_script(folder / "exits.py", steps=3, target=RTX4090)
    said = "sys.exit()" if code is None else f"sys.exit({code!r})"
    assert f"called {said} at " in str(raised.value)
    assert "exits.py:10 in <module>" in str(raised.value)


@settings(max_examples=8, deadline=None)
@given(error=st.sampled_from([ValueError, KeyError, RuntimeError, AssertionError, ZeroDivisionError]))
def test_an_exception_in_a_script_names_its_line(tmp_path_factory, error):
    """The script raising any exception: UserCodeError with its type and line."""
    folder = tmp_path_factory.mktemp("raise")
    _write(folder, "boom.py", f"import torch\nx = 1\nraise {error.__name__}('bad config')\n")
    with pytest.raises(UserCodeError) as raised:
        record_script(folder / "boom.py", target=RTX4090)
    assert f"{error.__name__}" in str(raised.value)
    assert "boom.py:3 in <module>" in str(raised.value)


def test_a_missing_script_is_a_user_error(tmp_path):
    """No such file: UserCodeError naming it."""
    with pytest.raises(UserCodeError, match="nope.py: no such script"):
        record_script(tmp_path / "nope.py")


@given(steps=st.one_of(st.integers(max_value=0), st.floats(allow_nan=True), st.booleans()))
def test_steps_below_one_or_not_whole_are_refused(steps):
    """steps 0, -1, 2.5, True: OomkitError before anything runs."""
    with pytest.raises(OomkitError, match="steps must be a whole number"):
        ScriptSpec("train.py", steps=steps)


def test_arguments_that_are_not_strings_are_refused():
    """argv holding a number: refused, as no command line holds one."""
    with pytest.raises(OomkitError, match="must be strings"):
        ScriptSpec("train.py", argv=("--lr", 3))  # type: ignore[arg-type]


def test_the_description_is_the_command_line():
    """ScriptSpec.description is what `python` would be given."""
    assert ScriptSpec("train.py", ("config/a.py", "--n_layer=2")).description == (
        "train.py config/a.py --n_layer=2"
    )


def test_an_endless_loop_stops_at_the_bound_with_what_to_do(tmp_path, monkeypatch):
    """An inference loop that never ends (its own `except Exception` around each batch): the
    recording stops once its log passes the bound, with a UserCodeError saying so, instead of
    filling the memory."""
    from oomkit.prediction.tracing import script_steps

    monkeypatch.setattr(script_steps, "MAX_SCRIPT_ENTRIES", 3000)
    _write(
        tmp_path,
        "serve.py",
        """
        import torch

        model = torch.nn.Linear(64, 64).cuda().eval()
        with torch.no_grad():
            while True:
                try:
                    model(torch.randn(8, 64, device="cuda"))
                except Exception:
                    pass
        """,
    )
    with pytest.raises(UserCodeError) as raised:
        record_script(tmp_path / "serve.py", target=RTX4090, cwd=tmp_path)
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'serve.py'}: the script has logged ")
    logged = int(message.split("has logged ")[1].split(" ")[0].replace(",", ""))
    assert 3000 < logged < 3000 + 512 * 8  # checked every 512 module calls, 4 entries each
    assert "Give it the arguments of a short run" in message


GRAD_SCALER = '''
import torch

model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.AdamW(model.parameters())
scaler = torch.amp.GradScaler("cuda")
for _ in range(3):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(torch.randn(64, 1024, device="cuda")).float().square().mean()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
'''


def test_a_grad_scaler_runs_as_torch_wrote_it(tmp_path):
    """fp16 with torch.amp.GradScaler, made with CUDA emulated, is recorded as torch runs it
    (torch/amp/grad_scaler.py): at the first step the float32 scale and int32 growth tracker
    (_lazy_init_scale_growth_tracker) and, each step, unscale_'s found_inf (torch.full) and
    inv_scale (scale.double().reciprocal(): 8 bytes). Its overflow check answers "none", said
    under the assumptions; no warning claims the scaler is not modelled (one had)."""
    (tmp_path / "fp16.py").write_text(GRAD_SCALER)
    run = record_script(tmp_path / "fp16.py", steps=3, target=RTX4090)
    recording = run.recording

    def per_step(op, size):
        return [
            sum(1 for e in recording.step_events(s)
                if e.action == "alloc" and e.size == size and dict(e.tags).get("op") == op)
            for s in range(3)
        ]

    assert per_step("aten.full.default", 4) == [3, 1, 1]
    assert per_step("aten.reciprocal.default", 8) == [1, 1, 1]
    assert not any("GradScaler" in w for w in recording.warnings)
    prediction = predict_recording(recording, target=RTX4090)
    finite = prediction.assumptions["finite values"]
    assert "_amp_foreach_non_finite_check_and_unscale_ x3" in finite
    assert "GradScaler skipped no optimizer step" in finite
    # step()'s read of found_inf is that line's: not said twice (as "read at grad_scaler.py")
    assert not [k for k in prediction.assumptions if "grad_scaler.py" in k]


def test_a_failure_in_bitsandbytes_4bit_layers_points_to_the_qlora_emulation(tmp_path):
    """A 4-bit layer of bitsandbytes fails on meta (its quant state is made when moved to
    CUDA); the error names oomkit's own --quantize nf4. Its 8-bit optimizers' folder is not
    named so."""
    nn = tmp_path / "bitsandbytes" / "nn"
    nn.mkdir(parents=True)
    (tmp_path / "bitsandbytes" / "__init__.py").write_text("")
    (nn / "__init__.py").write_text(
        "def fix_4bit_weight_quant_state_from_module(module):\n    assert module.quant_state\n"
    )
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        from bitsandbytes.nn import fix_4bit_weight_quant_state_from_module

        model = torch.nn.Linear(8, 8).cuda()
        model.quant_state = None
        fix_4bit_weight_quant_state_from_module(model)
    """))
    with pytest.raises(UserCodeError) as raised:
        record_script(tmp_path / "train.py", cwd=tmp_path)
    said = str(raised.value)
    assert "bitsandbytes' 4-bit layers (load_in_4bit, Params4bit) are not run" in said
    assert "--quantize nf4" in said


def test_a_failure_inside_deepspeed_says_it_is_not_modelled_and_what_to_use(tmp_path):
    """deepspeed.initialize fails without a GPU (its fused Adam needs CUDA_HOME): the error
    says DeepSpeed's engine is not modelled and names FSDP2 (--world-size / --fsdp), not only
    the library's internal error."""
    package = tmp_path / "deepspeed"
    package.mkdir()
    (package / "__init__.py").write_text(
        "def initialize(**kwargs):\n"
        "    raise OSError('CUDA_HOME environment variable is not set.')\n"
    )
    (tmp_path / "train.py").write_text(textwrap.dedent("""
        import torch
        import deepspeed

        model = torch.nn.Linear(8, 8).cuda()
        engine = deepspeed.initialize(model=model, config={})
    """))
    with pytest.raises(UserCodeError) as raised:
        record_script(tmp_path / "train.py", cwd=tmp_path)
    said = str(raised.value)
    assert "OSError: CUDA_HOME environment variable is not set." in said
    assert "DeepSpeed's engine is not modelled" in said
    assert "--world-size N (a script) or --fsdp N (a builder)" in said


BATCH_FINDER = '''
import torch
from accelerate.utils import find_executable_batch_size


@find_executable_batch_size(starting_batch_size=4096)
def train(batch_size):
    print("batch", batch_size)
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters())
    for _ in range(3):
        model(torch.randn(batch_size, 256, 256, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()


train()
'''


def test_a_script_that_finds_its_batch_by_catching_ooms_retries_as_on_the_gpu(tmp_path, capsys):
    """accelerate's find_executable_batch_size retries 0.9x the batch on each OOM, which the
    recording raises where the GPU would (ooms=True): from 4096 on a 1 GiB GPU it goes on at
    the first batch that fits, and a warning says how many it caught; accelerate is put back."""
    pytest.importorskip("accelerate")
    import accelerate.utils
    import accelerate.utils.memory

    from oomkit.core.gpus import GpuSpec

    small = Target.resolve(GpuSpec("small test GPU", 2**30, 100 * 2**20))
    before = (accelerate.utils.find_executable_batch_size,
              accelerate.utils.memory.find_executable_batch_size)
    (tmp_path / "finder.py").write_text(BATCH_FINDER)
    run = record_script(tmp_path / "finder.py", steps=3, target=small, ooms=True)
    tried = [int(line.split()[1]) for line in capsys.readouterr().out.splitlines()
             if line.startswith("batch ")]
    assert tried[0] == 4096 and all(b == int(a * 0.9) for a, b in zip(tried, tried[1:], strict=False))
    said = [w for w in run.recording.warnings if "find_executable_batch_size" in w]
    assert len(said) == 1 and "starting at 4096" in said[0]
    assert f"it caught {len(tried) - 1}," in said[0]
    assert predict_recording(run.recording, target=small).fits
    inputs = [e.size for e in run.recording.events
              if e.action == "alloc" and dict(e.tags).get("category") == "input"]
    assert inputs[-1] == tried[-1] * 256 * 256 * 4  # the last batch tried is the run's
    assert (accelerate.utils.find_executable_batch_size,
            accelerate.utils.memory.find_executable_batch_size) == before


GAN = """
import torch
g, d = torch.nn.Linear(8, 8).cuda(), torch.nn.Linear(8, 1).cuda()
opt_g, opt_d = torch.optim.Adam(g.parameters()), torch.optim.SGD(d.parameters(), lr=0.1)
for _ in range(10):
    fake = g(torch.randn(4, 8, device="cuda"))
    d(fake.detach()).mean().backward()
    opt_d.step(); opt_d.zero_grad()
    d(fake).mean().backward()
    opt_g.step(); opt_g.zero_grad()
"""


def test_two_optimizers_stepping_are_said_to_split_the_steps(tmp_path):
    """A GAN's discriminator and generator each step once an iteration: the 4 steps recorded
    are 2 iterations, and the note says how many steps record N iterations. One optimizer
    (the plain loop) gets no such note."""
    _write(tmp_path, "gan.py", GAN)
    run = record_script(tmp_path / "gan.py", [], steps=4, target=RTX4090, cwd=tmp_path)
    assert run.steps_recorded == 4
    assert (
        "2 optimizers stepped (SGD, Adam): each optimizer.step() counts as one of the steps "
        "recorded, so the 4 recorded hold about 2 iteration(s) of the loop (the per-step table "
        "is per optimizer step). To record N iterations, give --steps N x 2"
    ) in run.notes
    _write(tmp_path, "train.py", PLAIN_LOOP)
    plain = record_script(tmp_path / "train.py", [], steps=2, target=RTX4090, cwd=tmp_path)
    assert not any("optimizers stepped" in note for note in plain.notes)


WARNING_SCRIPT = '''
import warnings
import torch

warnings.warn("old api", FutureWarning)
model = torch.nn.Linear(8, 8).to("cuda")
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    warnings.warn("recorded by the script", UserWarning)
print("caught", len(caught))
for _ in range(3):
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    if _ == 1:
        warnings.warn("in the loop", UserWarning)
    opt.step()
'''


def test_a_script_s_warnings_are_shown_once_across_its_runs(tmp_path, capsys):
    """Each run of a script is a new __main__ with a new warning registry: a batch search's runs
    had printed its warnings again each time. Now each place's warning is shown by the first
    run only; a warning the script catches itself still reaches it in every run."""
    import warnings

    _write(tmp_path, "warns.py", WARNING_SCRIPT)
    shown = []
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, category, *rest: shown.append(
            f"{category.__name__}: {message}"
        )
        hook = warnings.showwarning
        for _ in range(3):
            record_script(tmp_path / "warns.py", [], steps=2, target=RTX4090, cwd=tmp_path)
        assert warnings.showwarning is hook
    assert capsys.readouterr().out.count("caught 1") == 3
    assert shown.count("FutureWarning: old api") == 1, shown
    assert shown.count("UserWarning: in the loop") == 1, shown
    assert not [line for line in shown if "recorded by the script" in line]


LOGGING_IMPORTS = '''
import logging

import torch

# What torchao logs when imported on a machine without its CUDA kernels (transformers'
# quantizers import it when installed), and a line of the script's own.
logging.getLogger("torchao").warning("Failed to load _C_cutlass_90a.abi3.so")
logging.getLogger("torch.utils._pytree").warning("Enum subclass is now natively supported")
logging.getLogger("torchao").error("a real torchao error")
logging.getLogger("train").warning("the script's own line")
model = torch.nn.Linear(8, 8).to("cuda")
opt = torch.optim.SGD(model.parameters())
model(torch.randn(4, 8, device="cuda")).sum().backward()
opt.step()
'''


def test_torchao_s_import_chatter_is_not_shown_but_the_script_s_logs_are(tmp_path, caplog):
    """torchao's "Failed to load ..._C_*.so" and torch's pytree note on its Enums (the CPU
    machine's, not the GPU run's) are not shown while the script runs; the script's own
    warnings and torchao's errors are; the loggers' levels are restored after."""
    import logging

    _write(tmp_path, "logs.py", LOGGING_IMPORTS)
    levels = [logging.getLogger(n).level for n in ("torchao", "torch.utils._pytree")]
    with caplog.at_level(logging.WARNING):
        run = record_script(tmp_path / "logs.py", target=RTX4090, cwd=tmp_path)
    assert run.steps_recorded == 1
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("torchao", "a real torchao error"),
        ("train", "the script's own line"),
    ]
    assert [logging.getLogger(n).level for n in ("torchao", "torch.utils._pytree")] == levels

    # The same imports in a file.py:function builder's module.
    _write(tmp_path, "builder.py", LOGGING_IMPORTS.split("model =")[0] + (
        "def build(batch_size):\n"
        "    model = torch.nn.Linear(8, 8)\n"
        "    return model, lambda: model(torch.randn(batch_size, 8)).sum().backward()\n"
    ))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_user_step(f"{tmp_path / 'builder.py'}:build", batch_size=2)
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("torchao", "a real torchao error"),
        ("train", "the script's own line"),
    ]
    assert [logging.getLogger(n).level for n in ("torchao", "torch.utils._pytree")] == levels
