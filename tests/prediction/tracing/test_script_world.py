"""A torchrun script as written, on a fake process group (record_script(world_size=N))."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch

from oomkit.core.target import Target
from oomkit.prediction.predictor import predict_recording
from oomkit.prediction.tracing.script_run import record_script

H100 = Target.resolve("h100")

DDP_SCRIPT = """
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank)
data = TensorDataset(torch.randn(256, 512), torch.randint(0, 10, (256,)))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=32, sampler=sampler)
model = DDP(torch.nn.Linear(512, 1024).to(device), device_ids=[local_rank])
opt = torch.optim.AdamW(model.parameters())
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {loss.item():.3f}")
"""

FSDP_SCRIPT = """
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(dist.get_rank())
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
for layer in model:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
for step in range(5):
    loss = model(torch.randn(8, 1024, device="cuda")).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""

MiB = 2**20
LINEAR_BYTES = (512 * 1024 + 1024) * 4  # torch.nn.Linear(512, 1024), fp32


def _record(tmp_path, source, world_size):
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    return record_script(tmp_path / "train.py", target=H100, world_size=world_size, cwd=tmp_path)


def test_a_ddp_script_with_a_distributed_sampler_runs_as_rank_0(tmp_path, capsys):
    """init_process_group, LOCAL_RANK, DistributedSampler over a DataLoader, DDP: as written.
    The sampler's shuffle and the loader's seed are host work with values; each replica holds
    the whole Linear, its gradient, DDP's bucket and AdamW's two states."""
    run = _record(tmp_path, DDP_SCRIPT, world_size=4)
    assert run.steps_recorded == 3
    assert "rank 0 of 4: nan" in capsys.readouterr().out  # the loss is a stand-in
    p = predict_recording(run.recording, target=H100)
    by = p.peak_allocated_at.by_category_bytes
    assert by["parameter"] == LINEAR_BYTES
    assert by["optimizer_state"] == 2 * LINEAR_BYTES  # exp_avg, exp_avg_sq (steps: host)
    assert by["input"] == 32 * 512 * 4  # a batch's x: 32 rows (the sampler gives rank 0 64)
    assert any("DDP: every replica" in w for w in run.recording.warnings)
    assert any("world size 4" in w for w in run.recording.warnings)


def test_an_fsdp2_script_holds_its_shard(tmp_path):
    """fully_shard as written: rank 0 of 8 holds an eighth of each Linear at the step's peak."""
    run = _record(tmp_path, FSDP_SCRIPT, world_size=8)
    assert run.steps_recorded == 3
    assert run.layout is not None and (run.layout.fsdp, run.layout.dp) == (8, 1)  # no DDP
    p = predict_recording(run.recording, target=H100)
    assert p.peak_allocated_at.by_category_bytes["parameter"] == 4 * (1024 * 1024 + 1024) * 4 // 8


def test_the_same_script_on_more_ranks_shards_further(tmp_path):
    """The world size is the script's: FSDP2 over 2 ranks holds four times what 8 do."""
    two = predict_recording(_record(tmp_path, FSDP_SCRIPT, 2).recording, target=H100)
    eight = predict_recording(_record(tmp_path, FSDP_SCRIPT, 8).recording, target=H100)
    assert (
        two.peak_allocated_at.by_category_bytes["parameter"]
        == 4 * eight.peak_allocated_at.by_category_bytes["parameter"]
    )


ASYNC_SCRIPT = """
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
world = dist.get_world_size()
model = torch.nn.Linear(512, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    model(torch.randn(32, 512, device="cuda")).square().mean().backward()
    works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
    values = torch.futures.wait_all([w.get_future() for w in works])
    for p, (value,) in zip(model.parameters(), values):
        p.grad = value / world
    gathered = torch.empty(world * 1024, device="cuda")
    work = dist.all_gather_into_tensor(gathered, model.bias.detach(), async_op=True)
    (out,) = work.get_future().wait()
    assert out is gathered and work.result() == [gathered]
    shard = torch.empty(1024 // world, device="cuda")
    (out,) = dist.reduce_scatter_tensor(shard, model.bias.detach(), async_op=True).get_future().wait()
    assert out is shard
    (out,) = dist.broadcast(model.bias.detach(), src=0, async_op=True).get_future().wait()
    assert out.shape == (1024,)
    assert dist.all_reduce(model.bias.detach()) is None  # synchronous: no work
    opt.step()
    opt.zero_grad()
"""


def test_a_script_s_async_collectives_complete_with_their_outputs(tmp_path):
    """dist.all_reduce(..., async_op=True).get_future() gives [tensor] as NCCL's does
    (ProcessGroupNCCL.cpp collective(): WorkNCCL keeps its outputs, its future completes with
    them), and so do all_gather_into_tensor, reduce_scatter_tensor and broadcast: a script
    that averages with the value (`p.grad = value / world`) runs; the fake group gave None."""
    run = _record(tmp_path, ASYNC_SCRIPT, world_size=4)
    assert run.steps_recorded == 3
    p = predict_recording(run.recording, target=H100)
    by = p.peak_allocated_at.by_category_bytes
    assert by["parameter"] == LINEAR_BYTES
    # The reduced gradient and its average (value / world) are alive together at the peak.
    assert by["gradient"] == 2 * LINEAR_BYTES


def test_host_work_is_real_and_cuda_work_fake():
    """Inside a script's fake world: a CPU randint has values; a CUDA randn is fake, on the
    fake device; a CPU tensor moved to CUDA is a fake device copy."""
    from torch._subclasses.fake_tensor import FakeTensor

    from oomkit.prediction.tracing.distributed import FakeWorld
    from oomkit.prediction.tracing.host_compute import HostComputeReal

    world = FakeWorld(2, target=H100, host_inputs=True)
    with world.opened(), world.recording(), HostComputeReal(world.fake_mode):
        ids = torch.randint(0, 10, (4,))
        assert not isinstance(ids, FakeTensor) and ids.tolist() == ids.tolist()
        assert 0 <= int(ids.max()) < 10
        on_gpu = torch.randn(4, device="cuda")
        moved = ids.to("cuda")
        assert isinstance(on_gpu, FakeTensor) and isinstance(moved, FakeTensor)
    # Two device requests: the randn's 4 floats and the copy of the 4 int64 ids.
    events = world.recorded().events
    assert [e.size for e in events if e.action == "alloc"] == [16, 32]


UNUSED_SCRIPT = """
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("nccl")
local_rank = int(os.environ["LOCAL_RANK"])
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(local_rank)
model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(8, 64, device="cuda")).sum()
    loss.backward()
    if torch.isnan(loss) or torch.isinf(loss):
        raise SystemExit("a nan loss")
    opt.step()
    opt.zero_grad()
"""


def test_find_unused_parameters_and_a_nan_check_run(tmp_path):
    """DDP(find_unused_parameters=True), the HF Trainer's default: the reducer's host read of
    its used map answers 'used' (fake_ddp.py fill 4), so each parameter's gradient is copied
    out of the bucket; the script's own isnan/isinf test of the loss answers 'finite'."""
    run = _record(tmp_path, UNUSED_SCRIPT, world_size=2)
    assert run.steps_recorded == 3
    p = predict_recording(run.recording, target=H100)
    # One bucket of both layers' gradients, flat (33,280 bytes, a multiple of 512); the
    # parameters are four blocks, each bias's 256 bytes rounded up to 512.
    by = p.peak_allocated_at.by_category_bytes
    assert by["ddp_bucket"] == 2 * (64 * 64 + 64) * 4
    assert by["parameter"] == 2 * (64 * 64 * 4 + 512)
    assert "torch.isnan x3" in p.assumptions["finite values"]


HF_TRAINER = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=128,
                                   n_positions=64))
data = [{"input_ids": torch.randint(0, 128, (32,)), "labels": torch.randint(0, 128, (32,))}
        for _ in range(64)]
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=5,
                         report_to=[], save_strategy="no", logging_steps=1)
Trainer(model=model, args=args, train_dataset=data).train()
"""


def test_the_hf_trainer_under_torchrun_wraps_ddp(tmp_path):
    """transformers' Trainer with torchrun's environment wraps the model in DDP (through
    accelerate, find_unused_parameters on): rank 0 of 2 records its steps with DDP's bucket."""
    pytest.importorskip("transformers")
    run = _record(tmp_path, HF_TRAINER, world_size=2)
    assert run.steps_recorded == 3
    assert run.layout is not None and run.layout.dp == 2
    p = predict_recording(run.recording, target=H100)
    assert p.peak_allocated_at.by_category_bytes["ddp_bucket"] > 0


LIGHTNING_DDP = """
import torch
import lightning as L


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(256, 512)

    def training_step(self, batch, idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


data = torch.utils.data.TensorDataset(torch.randn(512, 256))
trainer = L.Trainer(accelerator="gpu", devices=4, strategy="ddp", max_steps=5, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=32))
"""


ACCELERATE = """
import torch
from accelerate import Accelerator

accelerator = Accelerator(mixed_precision="bf16")
model = torch.nn.Linear(256, 512)
opt = torch.optim.AdamW(model.parameters())
loader = torch.utils.data.DataLoader(
    torch.utils.data.TensorDataset(torch.randn(512, 256)), batch_size=16, shuffle=True
)
model, opt, loader = accelerator.prepare(model, opt, loader)
for (x,) in loader:
    accelerator.backward(model(x).float().pow(2).mean())
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize(("library", "source"), [("lightning", LIGHTNING_DDP),
                                                ("accelerate", ACCELERATE)])
def test_a_framework_s_ddp_under_torchrun_runs_as_rank_0(tmp_path, library, source):
    """Lightning's Trainer(devices=4, strategy="ddp") sees the node's 4 GPUs
    (torch.cuda.device_count), launches nothing and wraps DDP itself. accelerate's data loader
    broadcasts the sampler's RNG state from rank 0 and sets it back (a device copy brought
    back unchanged is the host state again), and prepare() wraps DDP. Rank 0 of 4 holds the
    Linear(256, 512)'s gradient bucket either way."""
    pytest.importorskip(library)
    run = _record(tmp_path, source, world_size=4)
    assert run.steps_recorded == 3
    assert run.layout is not None and run.layout.dp == 4
    p = predict_recording(run.recording, target=H100)
    assert p.peak_allocated_at.by_category_bytes["ddp_bucket"] == (256 * 512 + 512) * 4

def test_a_device_copy_comes_back_with_its_values_only_while_unchanged():
    """real.to("cuda") then .cpu(): the host values; after a broadcast from rank 0, still; after
    an in-place change on the device, a fake tensor (its values are not known)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor

    from oomkit.prediction.tracing.distributed import FakeWorld
    from oomkit.prediction.tracing.host_compute import HostComputeReal

    world = FakeWorld(2, target=H100, host_inputs=True)
    with world.opened(), world.recording():
        host = HostComputeReal(world.fake_mode)
        with host, host.broadcasts_kept():
            state = torch.arange(6, dtype=torch.uint8)
            copy = state.to("cuda")
            dist.broadcast(copy, 0)
            back = copy.cpu()
            assert not isinstance(back, FakeTensor) and back.tolist() == [0, 1, 2, 3, 4, 5]
            copy.add_(1)
            assert isinstance(copy.cpu(), FakeTensor)


def test_a_freed_device_copy_keeps_no_host_tensor():
    """Each batch moved to the GPU is remembered with its host tensor only while the copy
    lives: a loop of 50 moves keeps none of them after."""
    from oomkit.prediction.tracing.distributed import FakeWorld
    from oomkit.prediction.tracing.host_compute import HostComputeReal

    world = FakeWorld(2, target=H100, host_inputs=True)
    with world.opened(), world.recording():
        host = HostComputeReal(world.fake_mode)
        with host:
            for _ in range(50):
                batch = torch.randn(16, 16).to("cuda")
            assert len(host._copies) == 1  # the last batch, still referenced
            del batch
            assert host._copies == {}


FSDP_TP_SCRIPT = """
import os
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("dp", "tp"))
model = torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
).cuda()
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_2d_mesh_script_counts_a_communicator_per_dimension(tmp_path):
    """FSDP2 over the mesh's "dp" dimension and TP over its "tp": the layout is fsdp 2 x tp 4
    (it had been fsdp 8, one communicator), so NCCL is counted for a 2-rank and a 4-rank
    communicator, and rank 0 holds an eighth of each Linear."""
    from oomkit.prediction.distributed_memory import nccl_of

    run = _record(tmp_path, FSDP_TP_SCRIPT, world_size=8)
    assert run.layout is not None
    assert (run.layout.fsdp, run.layout.tp, run.layout.dp) == (2, 4, 1)
    p = predict_recording(run.recording, target=H100)
    weights = (1024 * 4096 + 4096 + 4096 * 1024) * 4
    # Colwise shards the first Linear's weight and bias, rowwise the second's weight (its bias
    # is replicated over TP); FSDP2 halves each again.
    assert p.peak_allocated_at.by_category_bytes["parameter"] == (weights // 4 + 1024 * 4) // 2
    memory, _ = nccl_of(dataclasses.replace(H100, parallel=run.layout))
    assert memory is not None
    fixed = [what for what, _, _ in memory.lines if what.endswith("fixed cost beside its buffers")]
    assert fixed == [
        "NCCL fsdp communicator (2 ranks): fixed cost beside its buffers",
        "NCCL tp communicator (4 ranks): fixed cost beside its buffers",
    ]


@pytest.mark.parametrize(
    ("meshes", "wrapped", "expected", "noted"),
    [
        ([], False, {"fsdp": 8}, False),
        ([], True, {"dp": 8}, False),
        ([((8,), ("tp",))], False, {"tp": 8}, False),
        ([((2, 4), ("dp", "tp"))], False, {"fsdp": 2, "tp": 4}, False),
        ([((2, 4), ("dp_replicate", "dp_shard"))], False, {"dp": 2, "fsdp": 4}, False),
        # the mesh of the most dimensions over every rank; a mesh over some ranks is not it
        ([((2, 2), ("dp", "tp")), ((8,), None), ((2, 4), ("fsdp", "tp"))], True,
         {"fsdp": 2, "tp": 4}, False),
        # no names (or two of one role): replicas, then shards, then TP, said in a note
        ([((2, 4), None)], False, {"dp": 2, "fsdp": 4}, True),
        ([((2, 2, 2), ("a", "b", "c"))], False, {"dp": 2, "fsdp": 2, "tp": 2}, True),
        ([((2, 4), ("shard_a", "shard_b"))], False, {"dp": 2, "fsdp": 4}, True),
    ],
)
def test_a_scripts_layout_is_its_device_mesh(meshes, wrapped, expected, noted):
    from oomkit.core.target import ParallelLayout
    from oomkit.prediction.tracing.cuda_ranks import script_layout

    layout, note = script_layout(8, wrapped, meshes)
    assert layout == ParallelLayout(**expected)
    assert (note is not None) == noted


SPAWN_SCRIPT = """
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    torch.cuda.set_device(rank)
    model = DDP(torch.nn.Linear(512, 1024).to(rank), device_ids=[rank])
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(5):
        model(torch.randn(32, 512, device=rank)).sum().backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = torch.cuda.device_count()
    JOIN
"""


@pytest.mark.parametrize(
    "join",
    [
        "mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)",
        # join=False: the caller joins the context itself
        "ctx = mp.spawn(train, args=(world_size,), nprocs=world_size, join=False)\n"
        "    while not ctx.join():\n        pass",
        "mp.start_processes(train, args=(world_size,), nprocs=world_size, start_method='fork')",
    ],
)
def test_an_mp_spawn_script_runs_rank_0_in_process(tmp_path, join):
    """`mp.spawn(train, args=(world_size,), nprocs=torch.cuda.device_count())` under
    --world-size 4: train(0, 4) runs here as rank 0 of the fake group (a spawned process had
    no emulated CUDA: "Distributed package doesn't have NCCL built in"); its tensors made
    with device=rank (a bare index: CUDA's) are recorded. The replica holds the Linear,
    its gradient, DDP's bucket and AdamW's two states."""
    run = _record(tmp_path, SPAWN_SCRIPT.replace("JOIN", join), world_size=4)
    assert run.steps_recorded == 3
    assert run.layout is not None and run.layout.dp == 4
    by = predict_recording(run.recording, target=H100).peak_allocated_at.by_category_bytes
    assert by["parameter"] == LINEAR_BYTES
    assert by["optimizer_state"] == 2 * LINEAR_BYTES
    assert by["ddp_bucket"] == LINEAR_BYTES


def test_an_mp_spawn_script_without_world_size_names_its_init_line(tmp_path):
    """On one emulated GPU the script spawns one rank, which runs here and is refused at its
    init_process_group line with what to give, not a spawned process's NCCL traceback."""
    from oomkit.errors import UserCodeError

    join = "mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)"
    said = r"train.py:12 calls torch.distributed.init_process_group.*--world-size 8"
    with pytest.raises(UserCodeError, match=said):
        (tmp_path / "train.py").write_text(textwrap.dedent(SPAWN_SCRIPT.replace("JOIN", join)))
        record_script(tmp_path / "train.py", target=H100, cwd=tmp_path)


LAST_RANK_HEAVY_SCRIPT = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
assert int(os.environ["RANK"]) == rank
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
layers = 4 if rank == world - 1 else 1  # the last stage holds the head, as a pipeline's does
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(layers)]).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""

LAYER_BYTES = (1024 * 1024 + 1024) * 4  # torch.nn.Linear(1024, 1024), fp32


@pytest.mark.parametrize(("rank", "layers"), [(0, 1), (2, 1), (3, 4)])
def test_a_script_runs_as_the_rank_asked(tmp_path, rank, layers):
    """record_script(world_size=4, rank=R): get_rank(), RANK and the script's own branch on
    them are rank R's; the last rank's four Linears are its parameters, the others' one."""
    (tmp_path / "train.py").write_text(textwrap.dedent(LAST_RANK_HEAVY_SCRIPT))
    run = record_script(tmp_path / "train.py", target=H100, world_size=4, rank=rank,
                        cwd=tmp_path)
    assert run.steps_recorded == 3
    by = predict_recording(run.recording, target=H100).peak_allocated_at.by_category_bytes
    assert by["parameter"] == layers * LAYER_BYTES


def test_an_mp_spawn_script_runs_the_rank_asked(tmp_path):
    """mp.spawn(train, nprocs=4) under rank 2: train(2, 4) runs here, its init_process_group
    given rank 2 as the fake group's (a rank the group does not have would raise)."""
    join = "mp.spawn(train, args=(world_size,), nprocs=world_size, join=True)"
    source = SPAWN_SCRIPT.replace("JOIN", join).replace(
        "    torch.cuda.set_device(rank)",
        "    assert dist.get_rank() == rank == 2, rank\n    torch.cuda.set_device(rank)",
    )
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    run = record_script(tmp_path / "train.py", target=H100, world_size=4, rank=2, cwd=tmp_path)
    assert run.steps_recorded == 3


NODE_SCRIPT = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
print("ranks", os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"])
torch.cuda.set_device(DEVICE)
model = torch.nn.Linear(512, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(8, 512, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_rank_of_the_second_node_has_its_local_rank(tmp_path, capfd):
    """Rank 9 of 16 (two nodes of 8) is local rank 1, as torchrun numbers workers node by node;
    set_device(LOCAL_RANK) runs, and set_device(RANK) fails as on the GPU: device 9 of a node
    of 8 is an invalid ordinal."""
    from oomkit.errors import UserCodeError

    source = NODE_SCRIPT.replace("DEVICE", 'int(os.environ["LOCAL_RANK"])')
    run = _record_rank(tmp_path, source, rank=9)
    assert run.steps_recorded == 3
    assert "ranks 9 1 8" in capfd.readouterr().out
    source = NODE_SCRIPT.replace("DEVICE", "dist.get_rank()")
    with pytest.raises(UserCodeError, match=r"invalid device ordinal \(torch.cuda.set_device\(9\) "
                       r"on a node of 8 GPU\(s\).*train.py:8"):
        _record_rank(tmp_path, source, rank=9)


def _record_rank(tmp_path, source, rank):
    (tmp_path / "train.py").write_text(textwrap.dedent(source))
    return record_script(tmp_path / "train.py", target=H100, world_size=16, rank=rank,
                         cwd=tmp_path)


def test_a_script_that_picks_its_backend_by_nccl_s_availability_asks_for_nccl(tmp_path, capsys):
    """`"nccl" if dist.is_nccl_available() else "gloo"`: on a CUDA build NCCL is available, and
    the script asks for it (a CPU wheel's answer had made it pick gloo); outside the recording
    the CPU build's own answer is back."""
    import torch.distributed as dist

    before = dist.is_nccl_available()
    source = DDP_SCRIPT.replace(
        'dist.init_process_group("nccl")',
        'backend = "nccl" if dist.is_nccl_available() else "gloo"\n'
        'print("backend:", backend)\n'
        "dist.init_process_group(backend)",
    )
    run = _record(tmp_path, source, world_size=2)
    assert run.steps_recorded == 3
    assert "backend: nccl" in capsys.readouterr().out
    assert dist.is_nccl_available() == before


@pytest.mark.parametrize(
    "put",
    [
        'torch.randn(8, 512, device=f"cuda:{dist.get_rank()}")',
        'torch.randn(8, 512).to(f"cuda:{dist.get_rank()}")',
        "torch.randn(8, 512).cuda(dist.get_rank())",
        "torch.randn(8, 512).to(torch.device('cuda', dist.get_rank()))",
    ],
)
def test_a_tensor_put_on_a_gpu_past_the_node_s_fails_as_on_the_gpu(tmp_path, put):
    """Rank 9 of 16 putting its batch on cuda:9, a GPU its node of 8 does not have: CUDA's
    invalid device ordinal, at the script's line, whichever way the tensor is put there (it had
    passed, recorded as if on a GPU of the node). cuda:LOCAL_RANK runs."""
    from oomkit.errors import UserCodeError

    source = NODE_SCRIPT.replace("DEVICE", 'int(os.environ["LOCAL_RANK"])')
    local = source.replace('torch.randn(8, 512, device="cuda")', put.replace(
        "dist.get_rank()", "int(os.environ['LOCAL_RANK'])"))
    assert _record_rank(tmp_path, local, rank=9).steps_recorded == 3
    bad = source.replace('torch.randn(8, 512, device="cuda")', put)
    with pytest.raises(UserCodeError, match=r"invalid device ordinal \(a tensor put on cuda:9 on "
                       r"a node of 8 GPU\(s\).*train.py:12"):
        _record_rank(tmp_path, bad, rank=9)
