"""``torch.autograd.graph.save_on_cpu`` in a recorded step: saved activations leave the device.

It had failed ("pin_memory=True requires a CUDA or other accelerator backend", or without
pinning "Cannot copy out of meta tensor"), so a script that offloads its activations (or
FSDP's ``offload_wrapper``) could not be predicted (host_offload.py).
"""

from __future__ import annotations

import pytest
import torch

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.prediction.tracing.step_runner import trace_step

MiB = 2**20
TARGET = Target.resolve(GpuSpec("test GPU", 1024 * MiB, 0))
N = MiB  # float32 elements: 4 MiB per tensor


def _step(offload: bool | None, read: list[int]) -> None:
    """x (4 MiB); h = exp(x), saved by exp (its result) and by sin (its input); y = sin(h).
    Once the step drops h, only autograd's saved copies could keep it."""
    x = torch.empty(N, device="cuda", requires_grad=True)
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=bool(offload)) if offload is not None else None
    if hooks is not None:
        hooks.__enter__()
    h = x.exp()
    y = h.sin()
    if hooks is not None:
        hooks.__exit__(None, None, None)
    del h
    read.append(torch.cuda.memory_allocated())
    y.sum().backward()
    read.append(torch.cuda.max_memory_allocated())


@pytest.mark.parametrize("pin_memory", [False, True])
def test_saved_tensors_go_to_the_host_and_come_back_in_backward(pin_memory):
    """Kept on the device, h (4 MiB) outlives the step's reference: 12 MiB after the forward.
    Saved on the host it goes when dropped: 8 MiB (x and y); backward copies it back once per
    saved use, two 4 MiB device allocations (torch.empty_strided) in the backward phase."""
    kept: list[int] = []
    trace_step(lambda: _step(None, kept), steps=1, target=TARGET)
    offloaded: list[int] = []
    recording = trace_step(lambda: _step(pin_memory, offloaded), steps=1, target=TARGET)
    assert kept[0] == 12 * MiB
    assert offloaded[0] == 8 * MiB
    copies = [
        e
        for e in recording.events
        if e.action == "alloc" and e.tag("op") == "aten.empty_strided.default" and e.tag("phase") == "backward"
    ]
    assert [e.size for e in copies] == [4 * MiB, 4 * MiB]


def test_a_host_tensor_is_saved_as_torch_saves_it():
    """A CPU tensor's saved copy is torch's own (``tensor.cpu()``, itself): its gradient is
    computed from it as without the hooks."""
    x = torch.full((4,), 2.0, requires_grad=True)

    def step() -> None:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            y = (x * x).sum()
        y.backward()

    trace_step(step, steps=1, target=TARGET)
    assert x.grad is not None and x.grad.tolist() == [4.0, 4.0, 4.0, 4.0]


def test_save_on_cpu_is_torch_s_own_again_after_the_recording():
    own = torch.autograd.graph.save_on_cpu.__init__
    trace_step(lambda: _step(True, []), steps=1, target=TARGET)
    assert torch.autograd.graph.save_on_cpu.__init__ is own


DDP_SCRIPT = """
import os, torch, torch.nn as nn, torch.distributed as dist, sys
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
model = DDP(nn.Linear(1024, 1024, bias=False).cuda())
x = torch.empty(1024, 1024, device="cuda")
for _ in range(2):
    if sys.argv[1] == "offload":
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            h = model(x).exp().sin()
    else:
        h = model(x).exp().sin()
    print("after forward", torch.cuda.memory_allocated(), flush=True)
    h.sum().backward()
    model.zero_grad(set_to_none=True)
"""


def test_on_a_fake_process_group_the_saved_tensors_leave_the_device_too(tmp_path, capfd):
    """A torchrun script under --world-size 2: exp's result (4 MiB), saved by exp and by sin
    and not kept by the step, leaves the device with save_on_cpu, so after the forward rank 0
    holds 4 MiB less; its copies back are fake tensors of the fake process group."""
    from oomkit.prediction.scripts import predict_script

    script = tmp_path / "train.py"
    script.write_text(DDP_SCRIPT)
    after: dict[str, list[int]] = {}
    for mode in ("keep", "offload"):
        predict_script(script, [mode], steps=1, target=TARGET, world_size=2)
        printed = capfd.readouterr().out
        after[mode] = [int(line.split()[-1]) for line in printed.splitlines() if line.startswith("after forward")]
    assert after["keep"][0] - after["offload"][0] == 4 * MiB


PINNED_SCRIPT = """
import torch
buf = torch.zeros(256, pin_memory=True)
buf += 1
print("host", buf.device.type, float(buf.sum()), torch.cuda.memory_allocated(), flush=True)
on_device = buf.to("cuda", non_blocking=True)
print("moved", torch.cuda.memory_allocated(), flush=True)
"""


def test_a_pinned_host_buffer_is_host_memory_with_values(tmp_path, capfd):
    """A script's torch.zeros(..., pin_memory=True) had failed ("pin_memory=True requires a
    CUDA or other accelerator backend"); it is a host tensor with its values, not device
    memory, and its move to the device is a device allocation (256 floats: a 1 KiB block)."""
    from oomkit.prediction.scripts import predict_script

    script = tmp_path / "pinned.py"
    script.write_text(PINNED_SCRIPT)
    result = predict_script(script, steps=1, target=TARGET)
    printed = [line for line in capfd.readouterr().out.splitlines() if line.startswith(("host", "moved"))]
    assert printed == ["host cpu 256.0 0", "moved 1024"]
    assert result.prediction.peak_allocated_bytes == 1024
