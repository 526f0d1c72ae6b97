"""One emulated CUDA GPU: torch.cuda's answers, cuda tensors on meta, meta kept off the CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from oomkit.core.gpus import get_gpu
from oomkit.errors import ConfigError
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu
from oomkit.prediction.tracing.values import known_value


def test_torch_cuda_reports_one_gpu_of_the_target_and_is_restored():
    """is_available/device_count/capability/name answer for the GPU; all undone on exit."""
    before = torch.cuda.is_available()
    with as_one_cuda_gpu(get_gpu("a100-80gb")):
        assert torch.cuda.is_available() is True
        assert torch.cuda.device_count() == 1
        assert torch.cuda.get_device_capability() == (8, 0)
        assert torch.cuda.get_device_properties(0).total_memory == get_gpu("a100-80gb").total_memory_bytes
        assert torch.cuda.is_bf16_supported() is True
        torch.cuda.set_device(0)  # nothing to act on: no error
    with as_one_cuda_gpu(get_gpu("v100-16gb")):
        # torch/cuda/__init__.py is_bf16_supported: natively from sm 8.0; below, only through
        # emulation (the default: a bf16 tensor can be made there).
        assert torch.cuda.is_bf16_supported() is True
        assert torch.cuda.is_bf16_supported(including_emulation=False) is False
    assert torch.cuda.is_available() is before


def test_tensors_bound_for_cuda_land_on_meta():
    """device="cuda", .to("cuda:0"), .cuda() and Module.to("cuda") give meta tensors."""
    with as_one_cuda_gpu():
        made = torch.zeros(4, 4, device="cuda")
        moved = torch.ones(3).to("cuda:0", non_blocking=True)
        copied = torch.ones(3).cuda()
        module = torch.nn.Linear(2, 2, device="cpu").to(torch.device("cuda"))
    assert {made.device.type, moved.device.type, copied.device.type} == {"meta"}
    assert module.weight.device.type == "meta"


def test_meta_tensors_sent_to_the_cpu_stay_on_meta():
    """Strategy teardown's model.cpu() / .to("cpu") of meta tensors keep them (no copy error)."""
    module = torch.nn.Linear(2, 2, device="meta")
    with as_one_cuda_gpu():
        module.cpu()
        module.to("cpu", torch.float32, False)
        kept = torch.empty(2, device="meta").to("cpu")
    assert module.weight.device.type == "meta"
    assert kept.device.type == "meta"


def test_copies_and_python_numbers_are_recorded_and_keep_known_values():
    """A CPU mask moved to cuda and tensor(len, device=cuda) allocate on meta with their values."""
    seen = {}

    def step() -> None:
        with as_one_cuda_gpu(), torch.device("cpu"):
            mask = torch.ones(2, 8, dtype=torch.long).to("cuda")
            length = torch.tensor(125, device="cuda")
            seen["mask"] = known_value(mask)
            seen["length"] = known_value(length)
            seen["empty"] = bool(length == 0)
            del mask, length

    recording = trace_step(step)
    assert seen["mask"] is not None and bool(seen["mask"].tensor.eq(1).all())
    assert seen["length"] is not None and int(seen["length"].tensor) == 125
    assert seen["empty"] is False
    # The mask (2 x 8 int64 = 128 bytes), the int64 scalar (8 bytes) and the comparison's bool
    # (1 byte) were allocated.
    sizes = sorted(e.size for e in recording.events if e.action == "alloc")
    assert sizes == [1, 8, 128]


def test_an_index_alone_is_cuda_and_lands_on_meta():
    """device=0 and .to(0) name cuda:0 (c10 Device): on meta, a CPU tensor's move a copy."""
    with as_one_cuda_gpu():
        made = torch.zeros(4, device=0)
        moved = torch.ones(3, device="cpu").to(0)
        cast = torch.ones(3, device="cpu").to(torch.float16)  # a dtype, not a device
    assert (made.device.type, moved.device.type, cast.device.type) == ("meta", "meta", "cpu")


def test_a_module_moved_by_index_is_on_the_gpu():
    """model.to(0) / .to(device=0) (a script's .to(local_rank)): Module.to parses a bare index
    through the accelerator the CPU build lacks; inside, it is cuda:0, and lands on meta. One
    GPU reports one device."""
    with as_one_cuda_gpu():
        assert torch.cuda.device_count() == 1
        model = torch.nn.Linear(4, 4).to(0)
        other = torch.nn.Linear(4, 4).to(device=0, dtype=torch.float16)
    assert {p.device.type for p in [*model.parameters(), *other.parameters()]} == {"meta"}
    assert other.weight.dtype == torch.float16


def test_a_model_already_on_the_device_is_left_as_it_is():
    """model.to("cuda") / .cuda() of a model already there: the same Parameter objects, no
    swap (torch's _apply swaps FakeTensor parameters, and fails: "Couldn't swap")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = torch.nn.Linear(2, 2, device="meta")
    with FakeTensorMode():
        fake = torch.nn.Linear(2, 2)
    weights = (meta.weight, fake.weight)
    with as_one_cuda_gpu():
        meta.to("cuda").cuda()
    with FakeTensorMode(), as_one_cuda_gpu(lands_on="cpu"):
        fake.to(torch.device("cuda", 0), non_blocking=True).cuda()
    assert meta.weight is weights[0] and fake.weight is weights[1]
    assert fake.weight.device.type == "cpu"


def test_a_nested_block_lands_where_its_caller_does():
    """as_one_cuda_gpu() inside lands_on="cpu" puts CUDA tensors on the CPU too (a builder
    inside a distributed recording), and reports the caller's GPU."""
    with as_one_cuda_gpu(get_gpu("a100-80gb"), lands_on="cpu"), as_one_cuda_gpu():
        made = torch.zeros(2, device="cuda")
        name = torch.cuda.get_device_name()
    assert made.device.type == "cpu"
    assert name == get_gpu("a100-80gb").name


@given(device=st.text(max_size=8).filter(lambda d: d not in ("meta", "cpu")))
def test_landing_elsewhere_is_refused(device):
    """lands_on other than "meta" / "cpu": ConfigError naming what was given."""
    with pytest.raises(ConfigError, match="lands_on must be 'meta' or 'cpu'"):
        with as_one_cuda_gpu(lands_on=device):
            pass


def test_data_put_on_meta_by_a_library_is_an_allocation_with_its_values():
    """transformers' generate makes its special tokens with torch.tensor(ids, device=
    input_ids.device), which is meta for a CUDA batch: recorded when made (3 x int64 = 24
    bytes, a float scalar 4 bytes), values known; torch's copy below the dispatcher had hidden
    them until first use."""
    seen = {}

    def step() -> None:
        with as_one_cuda_gpu():
            ids = torch.tensor([5, 6, 7], device=torch.device("meta"))
            scale = torch.tensor(0.5, device="meta")
            seen["ids"] = known_value(ids).tensor.tolist()
            seen["scale"] = float(known_value(scale).tensor)
            del ids, scale

    recording = trace_step(step)
    assert sorted(e.size for e in recording.events if e.action == "alloc") == [4, 24]
    assert seen == {"ids": [5, 6, 7], "scale": 0.5}
    assert not any("existed before tracing" in w for w in recording.warnings)
