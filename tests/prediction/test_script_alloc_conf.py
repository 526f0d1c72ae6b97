"""A script that sets PYTORCH_CUDA_ALLOC_CONF itself is predicted with that setting."""

from __future__ import annotations

import os
import textwrap

import pytest

from oomkit.core.allocator.versions import behaviour_for
from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.errors import ConfigError
from oomkit.prediction.scripts import predict_script

pytest.importorskip("torch")

MiB = 2**20
TARGET = Target.resolve(GpuSpec("test GPU", 4096 * MiB, 0))

# Three growing requests, the first freed before the third: settings place them differently.
SCRIPT = """
import os
{setting}
import torch

w = torch.nn.Parameter(torch.empty(1024, device="cuda"))
{late}
opt = torch.optim.SGD([w], lr=0.1)
for _ in range(2):
    a = torch.empty(25 * 2**20, dtype=torch.uint8, device="cuda")
    b = torch.empty(30 * 2**20, dtype=torch.uint8, device="cuda")
    del a
    c = torch.empty(40 * 2**20, dtype=torch.uint8, device="cuda")
    del b, c
    (w * 2).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def _script(tmp_path, setting: str, late: str = "") -> str:
    """The script with ``setting`` at its top and ``late`` after its first CUDA tensor."""
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT.format(setting=setting, late=late)))
    return str(path)


@pytest.fixture
def clean_environment(monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


def test_the_script_s_own_setting_is_replayed_and_said(tmp_path, clean_environment):
    """os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True" in the script: the
    prediction equals the plain script's under --alloc-conf expandable_segments:True, says so,
    and leaves this process's environment as it was. It had been predicted with PyTorch's
    defaults."""
    setting = 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"'
    own = predict_script(_script(tmp_path, setting), steps=2, target=TARGET).prediction
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    plain = predict_script(_script(tmp_path, ""), steps=2, target=TARGET).prediction
    flagged = predict_script(
        _script(tmp_path, ""),
        steps=2,
        target=Target.resolve(TARGET.gpu, alloc_conf="expandable_segments:True"),
    ).prediction
    assert own.alloc_conf == "expandable_segments:True"
    # Expandable segments map whole 20 MiB pages (ref §8): 102 MiB here, 98 with the defaults.
    assert (own.peak_reserved_bytes, flagged.peak_reserved_bytes, plain.peak_reserved_bytes) == (
        102 * MiB, 102 * MiB, 98 * MiB
    )
    newest = behaviour_for(None).version_text
    assert own.assumptions["allocator setting"] == (
        "the script sets PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' itself, read as "
        f"torch {newest} reads it: replayed with expandable_segments:True"
    )
    assert "allocator setting" not in plain.assumptions


def test_the_script_s_setting_replaces_a_given_one_with_a_warning(tmp_path, clean_environment):
    """--alloc-conf max_split_size_mb:64 and a script that sets its own: the script's is
    replayed (as `PYTORCH_CUDA_ALLOC_CONF=... python train.py` would run), and a warning
    says the given one was replaced."""
    setting = 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"'
    given = Target.resolve(TARGET.gpu, alloc_conf="max_split_size_mb:64")
    prediction = predict_script(_script(tmp_path, setting), steps=2, target=given).prediction
    assert prediction.alloc_conf == "expandable_segments:True"
    assert any(
        w.startswith("--alloc-conf 'max_split_size_mb:64' is not what the script runs with")
        for w in prediction.warnings
    )


def test_a_setting_the_script_s_torch_rejects_is_a_config_error(tmp_path, clean_environment):
    """A script setting PyTorch would refuse: ConfigError naming it, environment restored."""
    setting = 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:2"'
    with pytest.raises(ConfigError, match=r"^the script sets PYTORCH_CUDA_ALLOC_CONF="
                       r"'max_split_size_mb:2' itself, which its run would refuse"):
        predict_script(_script(tmp_path, setting), steps=2, target=TARGET)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


@pytest.mark.parametrize(
    ("early", "late", "kept", "reserved_mib"),
    [
        # Set only after the first CUDA tensor: the run keeps the defaults (98 MiB), not
        # expandable segments' 102 MiB.
        ("", 'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"', "", 98),
        # Set before, changed after: the first one holds.
        (
            'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"',
            'os.environ.update(PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64")',
            "expandable_segments:True",
            102,
        ),
        # Unset after: still in effect.
        (
            'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"',
            'del os.environ["PYTORCH_CUDA_ALLOC_CONF"]',
            "expandable_segments:True",
            102,
        ),
    ],
)
def test_a_setting_made_after_the_first_cuda_tensor_is_ignored_as_pytorch_does(
    tmp_path, clean_environment, early, late, kept, reserved_mib
):
    """PyTorch parses its allocator variable once, at its allocator's first use: a change
    after the first CUDA allocation does nothing in a real run. It had been replayed."""
    prediction = predict_script(_script(tmp_path, early, late), steps=2, target=TARGET).prediction
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert prediction.alloc_conf == kept
    assert prediction.peak_reserved_bytes == reserved_mib * MiB
    late_warnings = [w for w in prediction.warnings if "after its first CUDA allocation" in w]
    assert len(late_warnings) == 1
    assert late_warnings[0].startswith(
        "the script unsets its allocator variable" if "del " in late else "the script sets "
    )
    assert ("allocator setting" in prediction.assumptions) == bool(kept)


BUILDER = """
import os
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import torch


def build(batch_size=1):
    def step():
        a = torch.empty(25 * 2**20, dtype=torch.uint8, device="cuda")
        b = torch.empty(30 * 2**20, dtype=torch.uint8, device="cuda")
        del a
        c = torch.empty(40 * 2**20, dtype=torch.uint8, device="cuda")
        del b, c

    return step
"""


def test_a_builder_s_module_setting_is_replayed_too(tmp_path, clean_environment):
    """file.py:function whose module sets the variable: predicted with it (the same need as
    --alloc-conf expandable_segments:True without the line), said, and the environment
    restored; a second prediction in the same process gives the same."""
    import oomkit

    own = tmp_path / "own.py"
    own.write_text(textwrap.dedent(BUILDER))
    plain = tmp_path / "plain.py"
    plain.write_text(textwrap.dedent(BUILDER).replace(
        'os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"', ""
    ))
    first = oomkit.predict(f"{own}:build", gpu="4GiB", context_overhead="0B")
    again = oomkit.predict(f"{own}:build", gpu="4GiB", context_overhead="0B")
    flagged = oomkit.predict(f"{plain}:build", gpu="4GiB", context_overhead="0B",
                             alloc_conf="expandable_segments:True")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert first.alloc_conf == again.alloc_conf == "expandable_segments:True"
    assert first.peak_reserved_bytes == again.peak_reserved_bytes == flagged.peak_reserved_bytes
    assert first.assumptions["allocator setting"].startswith(
        f"{own}:build sets PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True' itself"
    )


def test_fit_searches_with_the_builder_s_own_setting(tmp_path, clean_environment):
    """oomkit fit of that builder (its requests scale with the batch): the search runs with
    the module's setting, says so, and its answer is what predict gives at that batch; it
    had searched with PyTorch's defaults."""
    import oomkit

    own = tmp_path / "own.py"
    own.write_text(textwrap.dedent(BUILDER).replace("def build(batch_size=1):", (
        "def build(batch_size=1):\n    scale = batch_size"
    )).replace("25 * 2**20", "25 * 2**20 * scale").replace("30 * 2**20", "30 * 2**20 * scale")
        .replace("40 * 2**20", "40 * 2**20 * scale"))
    answer = oomkit.fit(f"{own}:build", gpu="2GiB", context_overhead="0B", margin="0B")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert answer.target.alloc_conf == "expandable_segments:True"
    assert answer.result.warnings[0].startswith(
        f"allocator setting: {own}:build sets PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'"
    )
    at = oomkit.predict(f"{own}:build", batch=answer.batch_size, gpu="2GiB", context_overhead="0B")
    assert at.fits and at.alloc_conf == "expandable_segments:True"
    assert answer.peak_reserved_bytes == at.peak_reserved_bytes
