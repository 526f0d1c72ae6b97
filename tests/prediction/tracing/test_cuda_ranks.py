"""as_cuda_rank: FSDP2 and DDP code written for torchrun on CUDA, recorded as rank 0 of a fake group."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from oomkit.errors import ConfigError
from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from oomkit.core.gpus import get_gpu  # noqa: E402
from oomkit.prediction.tracing.cuda_ranks import as_cuda_rank  # noqa: E402
from oomkit.prediction.tracing.distributed import fake_process_group  # noqa: E402
from oomkit.prediction.tracing.fake_storages import mark_host, stands_for_cuda  # noqa: E402

# FSDP2 as people write it for torchrun: NCCL group, LOCAL_RANK, a CUDA mesh, the model built
# under torch.device("cuda"), fully_shard per block and on the root, batches made on "cuda".
FSDP_CUDA = '''
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def build(batch_size=4):
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    assert torch.cuda.is_available() and torch.cuda.current_device() == 0
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    with torch.device("cuda"):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
        )
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(batch_size, 64, device="cuda")

    def step():
        x = torch.randn(batch_size, 64, device="cuda")
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, (model, optimizer, batch)
'''

# The same step written device-agnostically: the mesh handed in, tensors on the default device.
FSDP_AGNOSTIC = '''
import torch
from torch.distributed.fsdp import fully_shard


def build(mesh, batch_size=4):
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
    )
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(batch_size, 64)

    def step():
        x = torch.randn(batch_size, 64)
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, (model, optimizer, batch)
'''

# DDP as people write it: device_ids=[local_rank], .to(device), .cuda(), non_blocking copies.
DDP_CUDA = '''
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def build(batch_size=4):
    dist.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    name = torch.cuda.get_device_properties(local_rank).name
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)).to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank, bucket_cap_mb=1)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(batch_size, 64).to(device, non_blocking=True)

    def step():
        x = torch.randn(batch_size, 64).cuda()
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (model, optimizer, batch)
'''

DDP_AGNOSTIC = '''
import torch
from torch.nn.parallel import DistributedDataParallel


def build(batch_size=4):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    model = DistributedDataParallel(model, bucket_cap_mb=1)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(batch_size, 64)

    def step():
        x = torch.randn(batch_size, 64)
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, (model, optimizer, batch)
'''


# torchtitan's order: built on meta, fully_shard without a mesh (FSDP2's default mesh over the
# world, on the accelerator), then to_empty(device="cuda") and the weights' initialisation.
FSDP_META_INIT = '''
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def build(batch_size=4):
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
        )
    for block in model:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cuda")
    for block in model:
        block.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(batch_size, 64, device="cuda")

    def step():
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, (model, optimizer, batch)
'''


def _predict(tmp_path, name, source, flag, capsys):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    code = main(["predict", f"{path}:build", flag, "2", "--gpu", "h100", "--batch", "4", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    return json.loads(out)


def _figures(data):
    return data["peak_allocated_bytes"], data["peak_reserved_bytes"], data["by_category_bytes"]


def test_fsdp2_written_for_cuda_equals_its_device_agnostic_form(tmp_path, capsys):
    """--fsdp 2: init_process_group("nccl"), LOCAL_RANK, init_device_mesh("cuda"), a model built
    under torch.device("cuda"), batches on "cuda": the same bytes as the device-agnostic builder."""
    cuda = _predict(tmp_path, "fsdp_cuda", FSDP_CUDA, "--fsdp", capsys)
    agnostic = _predict(tmp_path, "fsdp_agnostic", FSDP_AGNOSTIC, "--fsdp", capsys)
    assert _figures(cuda) == _figures(agnostic)
    # The shards and FSDP2's buffers are there: 2 x 64x64 fp32 weights, half each on rank 0.
    assert cuda["by_category_bytes"]["parameter"] == 2 * 64 * 64 * 4 // 2
    assert cuda["by_category_bytes"]["allgather_buffer"] > 0


def test_ddp_written_for_cuda_equals_its_device_agnostic_form(tmp_path, capsys):
    """--dp 2: DDP(device_ids=[local_rank]), .to(device), .cuda(), non_blocking: the same bytes
    as the device-agnostic builder, DDP's buckets included."""
    cuda = _predict(tmp_path, "ddp_cuda", DDP_CUDA, "--dp", capsys)
    agnostic = _predict(tmp_path, "ddp_agnostic", DDP_AGNOSTIC, "--dp", capsys)
    assert _figures(cuda) == _figures(agnostic)
    numel = 64 * 256 + 256 + 256 * 8 + 8
    assert cuda["by_category_bytes"]["ddp_bucket"] == -(-numel * 4 // 512) * 512


def test_fsdp2_initialised_from_meta_on_cuda_equals_the_same_on_the_fake_device(tmp_path, capsys):
    """Meta init, fully_shard without a mesh, to_empty(device="cuda"): the bytes of the same
    builder with "cpu" (the fake device) for "cuda" and no process-group calls."""
    agnostic_source = (
        FSDP_META_INIT.replace('device="cuda"', 'device="cpu"')
        .replace('    dist.init_process_group("nccl")\n', "")
        .replace('    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n', "")
    )
    assert "cuda" not in agnostic_source
    cuda = _predict(tmp_path, "meta_cuda", FSDP_META_INIT, "--fsdp", capsys)
    agnostic = _predict(tmp_path, "meta_agnostic", agnostic_source, "--fsdp", capsys)
    assert _figures(cuda) == _figures(agnostic)


def test_init_process_group_with_another_world_size_exits_2(tmp_path, capsys):
    """init_process_group(world_size=4) under --fsdp 2: exit 2 naming both numbers."""
    source = FSDP_CUDA.replace('init_process_group("nccl")', 'init_process_group("nccl", world_size=4)')
    path = tmp_path / "fsdp_four.py"
    path.write_text(textwrap.dedent(source))
    assert main(["predict", f"{path}:build", "--fsdp", "2", "--batch", "4"]) == 2
    err = capsys.readouterr().err
    assert "init_process_group(world_size=4) in the code, but oomkit records world_size 2" in err


def test_nccl_lands_on_the_fake_group_and_everything_is_put_back():
    """Inside: init_process_group("nccl") joins the fake group (backend "fake"), the torchrun
    variables are set, CUDA tensors are on the fake device; outside, all as before."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    before = {name: os.environ.get(name) for name in names}
    init, destroy = dist.init_process_group, dist.destroy_process_group
    with fake_process_group(4), FakeTensorMode(), as_cuda_rank(4, gpu=get_gpu("h100-sxm")):
        assert dist.init_process_group("nccl") is None
        dist.destroy_process_group()  # left to the recording
        assert dist.is_initialized() and dist.get_backend() == "fake"
        assert dist.get_world_size() == 4 and dist.get_rank() == 0
        assert [os.environ[name] for name in names] == ["0", "0", "4", "4"]
        assert torch.cuda.device_count() == 4  # the node's GPUs, as a torchrun worker sees
        assert torch.cuda.get_device_properties(0).name == get_gpu("h100-sxm").name
        made = torch.empty(8, device="cuda:0")
        assert made.device.type == "cpu" and stands_for_cuda(made)
        assert torch.ones(2, device=0).device.type == "cpu"
        mesh = dist.device_mesh.init_device_mesh("cuda", (4,))
        assert mesh.device_type == "cpu"
    assert not dist.is_initialized()
    assert (dist.init_process_group, dist.destroy_process_group) == (init, destroy)
    assert {name: os.environ.get(name) for name in before} == before


def test_a_host_tensor_moved_to_cuda_is_a_new_device_tensor():
    """.cuda() / .to("cuda", non_blocking=True) of host memory copy it to the device, as CUDA
    does; of a device tensor, they are the tensor itself."""
    with fake_process_group(2), FakeTensorMode(), as_cuda_rank(2):
        host = torch.zeros(16)
        mark_host(host)  # what torch.tensor(data) makes in a recording (distributed.py)
        for moved in (host.cuda(), host.to("cuda", non_blocking=True), host.to(0)):
            assert moved is not host and stands_for_cuda(moved) and moved.shape == (16,)
        device = torch.zeros(16, device="cuda")
        assert device.cuda() is device and device.to("cuda:0") is device


@settings(max_examples=10, deadline=None)
@given(asked=st.integers(-5, 16), key=st.sampled_from(["world_size", "rank"]))
def test_init_process_group_naming_other_ranks_is_refused(asked, key):
    """A world_size or rank other than the recorded one (2 ranks, rank 0): ConfigError."""
    recorded = 2 if key == "world_size" else 0
    assume(asked not in (-1, recorded))  # -1: torch's "not given"
    with fake_process_group(2), FakeTensorMode(), as_cuda_rank(2):
        with pytest.raises(ConfigError, match=rf"init_process_group\({key}={asked}\)"):
            dist.init_process_group("nccl", **{key: asked})
