"""record_script(ooms=True) and a builder's prediction: a request the target GPU cannot serve
raises torch.OutOfMemoryError in the user's code, as on the GPU, so code that catches it goes on
as it would there (step_memory.ooms_raised); predict_script and a builder's prediction fall back
to the whole run without a limit when it is not caught."""

from __future__ import annotations

import textwrap

import pytest

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.scripts import predict_script
from oomkit.prediction.tracing.script_run import ScriptOutOfMemory, record_script

MiB = 2**20
# 1 GiB with 100 MiB outside PyTorch: a batch of 1024 x 1024 x 512 fp32 does not fit.
SMALL = Target.resolve(GpuSpec("small test GPU", 1024 * MiB, 100 * MiB))

RETRYING = """
import torch

model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batch = 1024
while True:
    print("trying", batch)
    try:
        for _ in range(3):
            model(torch.randn(batch, 512, 1024, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        break
    except torch.OutOfMemoryError as exc:
        assert " out of memory." in str(exc) and "Tried to allocate" in str(exc)
        opt.zero_grad()
        torch.cuda.empty_cache()
        batch //= 2
"""

NOT_CAUGHT = """
import torch

model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(1024, 512, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def _write(folder, name, text):
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_script_that_catches_ooms_retries_as_on_the_gpu(tmp_path, capsys):
    """On a 924 MiB budget batches 1024 to 128 raise (as the GPU's allocator would refuse
    them, the last attempt's tensors still alive where the script empties the cache) and are
    caught; 64 fits. The prediction is of that run, which fits, with a warning saying so."""
    run = record_script(_write(tmp_path, "retry.py", RETRYING), steps=3, target=SMALL, ooms=True)
    tried = [line.split()[1] for line in capsys.readouterr().out.splitlines() if "trying" in line]
    assert tried == ["1024", "512", "256", "128", "64"]
    assert run.steps_recorded == 3
    said = [w for w in run.recording.warnings if "out-of-memory" in w]
    assert len(said) == 1 and "caught 4 out-of-memory error(s)" in said[0]
    p = predict_recording(run.recording, target=SMALL)
    assert p.fits and p.peak_reserved_bytes <= SMALL.usable_bytes
    # Without the limit, the first batch is recorded as if it fitted.
    unlimited = predict_recording(
        record_script(tmp_path / "retry.py", steps=3, target=SMALL).recording, target=SMALL
    )
    assert not unlimited.fits


def test_a_script_that_does_not_catch_one_is_predicted_whole(tmp_path):
    """Not caught: record_script says so (ScriptOutOfMemory, PyTorch's message), and
    predict_script gives what the run without a limit needs, as before."""
    path = _write(tmp_path, "plain.py", NOT_CAUGHT)
    with pytest.raises(ScriptOutOfMemory, match=r"CUDA out of memory\. Tried to allocate"):
        record_script(path, steps=3, target=SMALL, ooms=True)
    scripted = predict_script(path, steps=3, target=SMALL)
    whole = predict_recording(record_script(path, steps=3, target=SMALL).recording, target=SMALL)
    assert not scripted.prediction.fits
    assert scripted.prediction.required_bytes == whole.required_bytes
    assert scripted.run.steps_recorded == 3


def test_a_fitting_script_records_the_same_events_either_way(tmp_path):
    """Where nothing is refused, the limit changes nothing: the same events."""
    path = _write(tmp_path, "fits.py", NOT_CAUGHT.replace("1024, 512, 1024", "8, 512, 1024"))
    limited = record_script(path, steps=3, target=SMALL, ooms=True).recording
    free = record_script(path, steps=3, target=SMALL).recording
    assert [(e.action, e.size) for e in limited.events] == [(e.action, e.size) for e in free.events]


RESILIENT = """
import logging
import torch
import oomkit

logging.basicConfig(level=logging.INFO, format="%(message)s")
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 1024)
).cuda()
opt = torch.optim.AdamW(model.parameters())


@oomkit.resilient(optimizer=opt)
def train_step(batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


for _ in range(3):
    train_step((torch.randn(65536, 1024, device="cuda"), torch.randn(65536, 1024, device="cuda")))
"""


def test_oomkits_own_resilient_step_splits_as_on_the_gpu(tmp_path, caplog):
    """oomkit.resilient under the recording: on a 4 GiB GPU batch 65536 runs out of memory at
    micro-batch 65536 and 32768 and trains at 16384, as it would there; the prediction is of
    that run and fits."""
    import logging

    four = Target.resolve(GpuSpec("4 GiB test GPU", 4 * 1024 * MiB, 400 * MiB))
    with caplog.at_level(logging.INFO, logger="oomkit.runtime.resilient"):
        run = record_script(_write(tmp_path, "res.py", RESILIENT), steps=3, target=four, ooms=True)
    retries = [r.getMessage() for r in caplog.records if "retrying with micro-batch" in r.getMessage()]
    assert [m.rsplit(" ", 1)[1] for m in retries] == ["32768", "16384"]
    assert any("caught 2 out-of-memory error(s)" in w for w in run.recording.warnings)
    assert predict_recording(run.recording, target=four).fits


def test_the_gpus_allocator_runs_the_setting_the_script_sets_itself(monkeypatch):
    """At the step's first request the limited allocator takes a PYTORCH_CUDA_ALLOC_CONF the
    script set in os.environ (PyTorch reads it then), as the report's replay does; unchanged
    variables leave the target's."""
    from oomkit.core.allocator.versions import alloc_conf_variables
    from oomkit.prediction.tracing.script_run import _config_at_first_use

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    target = Target.resolve("rtx4090", alloc_conf="max_split_size_mb:128")
    config_of = _config_at_first_use(alloc_conf_variables())
    assert config_of(target) == target.allocator_config
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert config_of(target).expandable_segments is True
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:2")  # refused by PyTorch
    assert config_of(target) == target.allocator_config


BUILDERS = """
import torch
import oomkit


def _model():
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 8192), torch.nn.GELU(), torch.nn.Linear(8192, 1024)
    ).cuda()


def resilient(batch_size=65536):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())

    @oomkit.resilient(optimizer=opt)
    def train_step(batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    def step():
        x = torch.randn(batch_size, 1024, device="cuda")
        train_step((x, torch.randn(batch_size, 1024, device="cuda")))

    return step, (model, opt)


def plain(batch_size=65536):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())

    def step():
        x = torch.randn(batch_size, 1024, device="cuda")
        torch.nn.functional.mse_loss(model(x), torch.randn(batch_size, 1024, device="cuda")).backward()
        opt.step()
        opt.zero_grad()

    return step, (model, opt)
"""


def test_a_builders_step_that_catches_ooms_goes_on_and_one_that_does_not_is_whole(tmp_path):
    """`oomkit predict file.py:function`: a step wrapped in @oomkit.resilient catches the OOMs
    raised where the GPU would (2 on 4 GiB) and fits; a plain step is built again and recorded
    without the limit, so its required bytes are those of a recording that never raised."""
    import oomkit
    from oomkit.prediction.predictor import predict
    from oomkit.scenario.user_function import load_user_step

    path = _write(tmp_path, "steps.py", BUILDERS)
    four = "4GiB"
    caught = oomkit.predict(f"{path}:resilient", gpu=four)
    assert caught.fits
    assert any("step caught 2 out-of-memory error(s)" in w for w in caught.warnings)
    whole = oomkit.predict(f"{path}:plain", gpu=four)
    assert not whole.fits
    target = Target.resolve(four)
    user = load_user_step(f"{path}:plain", gpu=target.gpu)
    fresh = predict(user.step_fn, track=user.track, target=target, steps=3)
    assert whole.required_bytes == fresh.required_bytes
    assert not any("out-of-memory" in w for w in whole.warnings)


def test_a_builder_built_again_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    """The module sets its allocator variable when imported; built a second time after an OOM
    it did not catch, the variable is set back afterwards as after the first build."""
    import os

    import oomkit

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    source = "import os\nos.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'expandable_segments:True'\n"
    path = _write(tmp_path, "env_steps.py", source + BUILDERS)
    whole = oomkit.predict(f"{path}:plain", gpu="4GiB")
    assert not whole.fits
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
