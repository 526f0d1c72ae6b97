"""A DataLoader in a builder or its step, as people write it: workers, shuffling, a dataset that
makes its tensors in __getitem__ (prediction/tracing/data_loaders.py)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from oomkit.core.target import Target
from oomkit.errors import UserCodeError
from oomkit.prediction.predictor import predict
from oomkit.prediction.tracing.data_loaders import loaders_on_the_host
from oomkit.scenario.user_function import load_user_step

H100 = Target.resolve("h100")

BUILDER = '''
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset


class Images(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.randn(3, 32, 32), torch.randint(0, 10, ())


def build(batch_size=8):
    data = DATA
    loader = DataLoader(data, batch_size=batch_size, LOADER)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 10)).to("cuda")
    opt = torch.optim.AdamW(model.parameters())
    batches = iter(loader)

    def step():
        x, y = next(batches)
        x, y = x.to("cuda", non_blocking=True), y.to("cuda")
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step, (model, opt)
'''

TENSORS = "TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))"


def _peaks(tmp_path, data, loader):
    source = BUILDER.replace("DATA", data).replace("LOADER", loader)
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    user = load_user_step(f"{tmp_path / 'train.py'}:build", batch_size=8, gpu=H100.gpu)
    prediction = predict(user.step_fn, track=user.track, steps=3, target=H100)
    return prediction.peak_allocated_bytes, prediction.peak_reserved_bytes


@pytest.mark.parametrize("data", [TENSORS, "Images()"])
@pytest.mark.parametrize(
    "loader",
    [
        # shuffle=True had stopped the prediction at RandomSampler's seed (a meta value);
        # workers had died at torch.manual_seed of the loader's seed, printing tracebacks.
        "shuffle=True",
        "num_workers=2",
        "num_workers=4, shuffle=True, pin_memory=True, persistent_workers=True, timeout=30",
    ],
)
def test_a_builder_s_data_loader_runs_as_without_workers(tmp_path, data, loader):
    """Each loader gives the step the batches a plain one (no workers, no shuffling) gives:
    the same peaks to the byte, which hold the model, AdamW's states and a batch."""
    plain = _peaks(tmp_path, data, "shuffle=False")
    assert _peaks(tmp_path, data, loader) == plain
    params = (3 * 32 * 32 * 512 + 512 + 512 * 10 + 10) * 4
    assert plain[0] > 4 * params  # parameters, gradients and two states


def test_a_builder_that_fails_after_starting_its_loader_says_only_its_own_error(tmp_path, capfd):
    """No worker is started, so none prints its traceback: the builder's own error, one line."""
    source = BUILDER.replace("DATA", TENSORS).replace("LOADER", "num_workers=2").replace(
        "    batches = iter(loader)\n",
        "    batches = iter(loader)\n    next(batches)\n    raise ValueError('broke')\n",
    )
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    with pytest.raises(UserCodeError, match=r"build\(\) raised ValueError: broke, at .*train\.py"):
        load_user_step(f"{tmp_path / 'train.py'}:build", batch_size=8, gpu=H100.gpu)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "DataLoader worker" not in err


def test_the_loader_is_the_user_s_again_after():
    """Inside, a loader with workers gives a single-process iterator with host values and keeps
    its settings; outside, torch's own iterator choice is back."""
    from torch.utils.data import DataLoader, dataloader

    loader = DataLoader(list(range(10)), batch_size=4, num_workers=3, shuffle=True, timeout=5)
    with torch.device("meta"), loaders_on_the_host():
        batches = iter(loader)
        assert type(batches).__name__ == "_SingleProcessDataLoaderIter"
        assert isinstance(batches._base_seed, int)  # drawn on the host: a real seed
        indices = batches._next_index()  # shuffled: four distinct real indices
        assert len(set(indices) & set(range(10))) == 4
        assert next(batches).device.type == "meta"  # collated on the default device
        assert (loader.num_workers, loader.timeout) == (3, 5)
    assert dataloader.DataLoader._get_iterator.__qualname__ == "DataLoader._get_iterator"
    assert dataloader._BaseDataLoaderIter._next_index.__qualname__ == (
        "_BaseDataLoaderIter._next_index"
    )


SCRIPT = '''
import torch
from torch.utils.data import DataLoader, TensorDataset

device = "cuda" if torch.cuda.is_available() else "cpu"
data = TensorDataset(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))
loader = DataLoader(data, batch_size=8, LOADER)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 512),
                            torch.nn.GELU(), torch.nn.Linear(512, 10)).to(device)
opt = torch.optim.AdamW(model.parameters())
for x, y in loader:
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
'''


def test_a_script_s_pinning_loader_with_workers_gives_the_plain_loader_s_peaks(tmp_path):
    """A script's loader with workers and pin_memory=True: its workers run (CPU processes) and
    its pinning thread pins nothing (torch.accelerator says cuda, so torch starts one; a CPU
    build's Tensor.pin_memory had raised there). The peaks are the plain loader's to the byte,
    and outside, DataLoader pins with torch's own function again."""
    from torch.utils.data._utils import pin_memory as pinning

    from oomkit.prediction.scripts import predict_script

    def peaks(loader: str) -> tuple[int, int]:
        (tmp_path / "train.py").write_text(SCRIPT.replace("LOADER", loader))
        prediction = predict_script(tmp_path / "train.py", steps=3, target=H100).prediction
        return prediction.peak_allocated_bytes, prediction.peak_reserved_bytes

    plain = peaks("shuffle=False")
    assert peaks("num_workers=2, pin_memory=True, shuffle=True") == plain
    assert plain[0] > 4 * (3 * 32 * 32 * 512 + 512 + 512 * 10 + 10) * 4
    assert pinning.pin_memory.__qualname__ == "pin_memory"
