"""torch's process-wide settings: a user's code keeps its own, the caller gets its own back."""

from __future__ import annotations

import textwrap

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.target import Target
from oomkit.prediction.scripts import predict_script
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.torch_globals import TorchGlobals, UsersGlobals
from oomkit.scenario.user_function import load_user_step

# What scripts set for the whole of torch, each a change from torch's defaults.
SCRIPT_SETTINGS = """
torch.set_default_dtype(torch.float16)
torch.set_default_device("cuda")
torch.backends.cudnn.benchmark = True
torch.backends.cuda.enable_flash_sdp(False)
torch.use_deterministic_algorithms(True, warn_only=True)
torch.set_float32_matmul_precision("high")
torch.manual_seed(0)
"""


def _state() -> tuple[object, ...]:
    return (
        torch.get_default_dtype(),
        torch.get_default_device().type,
        torch.backends.cudnn.benchmark,
        torch.backends.cuda.flash_sdp_enabled(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_float32_matmul_precision(),
        torch.is_grad_enabled(),
    )


def test_a_script_runs_with_its_settings_and_leaves_the_callers(tmp_path):
    """The script's fp16 default and CUDA default device make its 1024 x 1024 weight 2 MiB on
    the GPU; after it, this process has fp32, the CPU and its random stream back."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        + SCRIPT_SETTINGS
        + textwrap.dedent(
            """
            w = torch.randn(1024, 1024, requires_grad=True)
            assert w.dtype == torch.float16 and torch.backends.cudnn.benchmark
            opt = torch.optim.SGD([w], lr=0.1)
            for _ in range(2):
                (torch.randn(8, 1024) @ w).sum().backward()
                opt.step()
                opt.zero_grad()
            """
        )
    )
    before = _state()
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    run = predict_script(script, steps=2, target=Target.resolve("rtx4090")).run
    assert _state() == before
    assert torch.equal(torch.rand(3), expected_draw)
    sizes = {e.size for e in run.recording.events if e.action == "alloc"}
    assert 1024 * 1024 * 2 in sizes  # the fp16 weight (and its gradient), on the device
    assert 1024 * 1024 * 4 not in sizes


def test_a_builders_module_settings_reach_its_steps_not_the_caller(tmp_path):
    """A module-level fp16 default: the step's randn(256) is 512 bytes; between the pieces,
    the caller's fp32 default is in effect."""
    (tmp_path / "build.py").write_text(
        textwrap.dedent(
            """
            import torch
            torch.set_default_dtype(torch.float16)
            torch.backends.cudnn.benchmark = True

            def build():
                w = torch.nn.Parameter(torch.zeros(256, device="cuda"))
                opt = torch.optim.SGD([w], lr=0.1)

                def step():
                    assert torch.backends.cudnn.benchmark
                    (torch.randn(256, device="cuda") * w).sum().backward()
                    opt.step()
                    opt.zero_grad()

                return step, (w, opt)
            """
        )
    )
    before = _state()
    user = load_user_step(f"{tmp_path / 'build.py'}:build")
    assert _state() == before
    recording = trace_step(lambda *tracked: user.step_fn(), *user.track, steps=2)
    assert _state() == before
    sizes = sorted(e.size for e in recording.events if e.action == "alloc")
    assert sizes.count(512) >= 2  # the fp16 parameter's gradient and the step's input
    assert 1024 not in sizes


def test_a_step_that_changes_a_setting_carries_it_to_the_next():
    """UsersGlobals: what one piece leaves, the next sees; the caller never does."""
    users = UsersGlobals()
    seen = []
    for _ in range(3):
        with users.running():
            seen.append(torch.get_default_dtype())
            torch.set_default_dtype(torch.float64)
        assert torch.get_default_dtype() == torch.float32
    assert seen == [torch.float32, torch.float64, torch.float64]


_CHANGES = {
    "dtype": lambda: torch.set_default_dtype(torch.bfloat16),
    "device": lambda: torch.set_default_device("meta"),
    "grad": lambda: torch.set_grad_enabled(False),
    "cudnn": lambda: setattr(torch.backends.cudnn, "benchmark", True),
    "cudnn_enabled": lambda: setattr(torch.backends.cudnn, "enabled", False),
    "sdpa": lambda: torch.backends.cuda.enable_mem_efficient_sdp(False),
    "math": lambda: torch.backends.cuda.enable_math_sdp(False),
    "deterministic": lambda: torch.use_deterministic_algorithms(True),
    "anomaly": lambda: torch.autograd.set_detect_anomaly(True, check_nan=False),
    "precision": lambda: torch.set_float32_matmul_precision("medium"),
    # torch >= 2.9's precision API (transformers' enable_tf32 sets it): the legacy readers
    # raise after it ("mix of the legacy and new APIs"), and the record had read them.
    "tf32": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "tf32_legacy": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "conv_ieee": lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
    "threads": lambda: torch.set_num_threads(1),
    "seed": lambda: torch.manual_seed(1234),
}


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(sorted(_CHANGES)), unique=True))
def test_restore_undoes_any_set_of_changes(names):
    """Whatever a user's code changes, ``restore`` gives back the record, random state too."""
    before = TorchGlobals.now()
    try:
        for name in names:
            _CHANGES[name]()
        if set(names) - {"seed", "threads"}:  # 1 thread may be what this machine has
            assert TorchGlobals.now().values != before.values
    finally:
        before.restore()
    after = TorchGlobals.now()
    assert after.values == before.values
    assert torch.equal(after.rng_state, before.rng_state)


def test_a_script_that_sets_the_new_precision_api_runs_and_leaves_the_caller_s(tmp_path):
    """transformers' TrainingArguments(tf32=True) sets torch.backends.fp32_precision = "tf32";
    the script had failed when oomkit read the legacy matmul precision to give the caller its
    own back. Now it runs, and the caller's legacy reads work after it."""
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "torch.backends.fp32_precision = 'tf32'\n"
        "w = torch.randn(64, 64, device='cuda', requires_grad=True)\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "(w @ w).sum().backward()\n"
        "opt.step()\n"
    )
    before = torch.get_float32_matmul_precision()
    run = predict_script(script, steps=1, target=Target.resolve("rtx4090")).run
    assert run.steps_recorded == 1
    assert torch.get_float32_matmul_precision() == before
    assert torch.backends.fp32_precision == "none"

