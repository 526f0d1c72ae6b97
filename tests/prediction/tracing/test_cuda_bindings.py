"""torch's CUDA bindings a CPU build lacks, answered for the emulated GPU (cuda_bindings.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from oomkit.core.gpus import GpuSpec
from oomkit.core.snapshot.reader import load_snapshot
from oomkit.core.target import Target
from oomkit.prediction.tracing.cuda_bindings import nested_stats
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu
from oomkit.prediction.tracing.step_failure import failure_text
from oomkit.prediction.tracing.step_runner import trace_step

MiB = 2**20
TARGET = Target.resolve(GpuSpec("test GPU", 1024 * MiB, 0))


def test_torch_cuda_memory_s_own_functions_read_the_recording():
    """torch.cuda.memory.memory_allocated and the deprecated memory_cached (which calls its
    module's memory_reserved) read what torch.cuda.memory_allocated reads: a 4 MiB tensor in a
    20 MiB segment (kLargeBuffer). They had read 0: only torch.cuda's names were answered.
    memory_stats_as_nested_dict nests the same counters."""
    read: list[object] = []

    def step() -> None:
        x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        read.append(
            (
                torch.cuda.memory.memory_allocated(),
                torch.cuda.memory_allocated(),
                torch.cuda.memory.memory_cached(),
                torch.cuda.memory.max_memory_reserved(),
            )
        )
        nested = torch.cuda.memory.memory_stats_as_nested_dict()
        read.append(nested["allocated_bytes"]["all"]["current"])
        read.append(torch.cuda.memory.memory_stats() == torch.cuda.memory_stats())
        del x

    trace_step(step, steps=1, target=TARGET)
    assert read == [(4 * MiB, 4 * MiB, 20 * MiB, 20 * MiB), 4 * MiB, True]


@given(
    st.dictionaries(
        st.lists(st.sampled_from(["a", "b", "all", "peak"]), min_size=1, max_size=3).map(".".join),
        st.integers(min_value=0, max_value=2**40),
        max_size=12,
    ).filter(
        # A key that is also another key's prefix cannot be both a value and a level.
        lambda d: not any(k != j and j.startswith(k + ".") for k in d for j in d)
    )
)
def test_nested_stats_is_what_torch_flattens_back(flat):
    """torch/cuda/memory.py memory_stats joins the nested levels with dots: nesting then
    flattening as it does gives the counters back."""

    def flatten(prefix: str, value: object, out: dict[str, int]) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                flatten(f"{prefix}.{key}" if prefix else key, inner, out)
        else:
            out[prefix] = value  # type: ignore[assignment]

    back: dict[str, int] = {}
    flatten("", nested_stats(flat), back)
    assert back == flat


def test_a_snapshot_dumped_by_the_step_holds_its_segments_and_history(tmp_path):
    """_record_memory_history(max_entries=2), then a 4 MiB and a 1 MiB tensor, the first freed:
    _dump_snapshot writes the simulated allocator's segments (20 MiB and 2 MiB, kLargeBuffer
    and kSmallBuffer) and the last two history entries, which oomkit reads back. It had
    stopped the step with AttributeError (torch._C._cuda_record_memory_history)."""
    path = tmp_path / "snap.pickle"

    def step() -> None:
        before = torch.empty(1024, dtype=torch.uint8, device="cuda")  # not in the history
        torch.cuda.memory._record_memory_history(max_entries=2)
        x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        y = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        del x
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        del y, before

    trace_step(step, steps=1, target=TARGET)
    snapshot = load_snapshot(path)
    assert sorted(s.total_size for s in snapshot.segments) == [2 * MiB, 20 * MiB]
    trace = snapshot.device_traces[0]
    assert [(e.action, e.size) for e in trace] == [
        ("free_requested", 4 * MiB),
        ("free_completed", 4 * MiB),
    ]
    large = next(s for s in snapshot.segments if s.total_size == 20 * MiB)
    assert trace[0].address == large.address  # the freed block is the segment's first
    assert {"top:segments", "top:device_traces"} <= set(snapshot.keys_seen)


def test_a_dumped_history_holds_the_segment_events_as_pytorch_s_does(tmp_path):
    """Expandable segments turned on by the step, eight 6 MiB tensors, every other freed, then
    empty_cache: the history has a segment_map (20 MiB pages) before the request that mapped
    it, and the unmaps after; replayed, the file needs what it recorded (60 MiB under the
    default setting too). Without the segment events the replay had taken the segment for
    one made before the history, and priced the default at 120 MiB."""
    from oomkit.plan.tuning import tune

    path = tmp_path / "snap.pickle"

    def step() -> None:
        torch.cuda.memory._record_memory_history(max_entries=1000)
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        xs = [torch.empty(6 * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
        del xs[::2]
        torch.cuda.memory._dump_snapshot(str(path))
        del xs
        torch.cuda.empty_cache()
        torch.cuda.memory._dump_snapshot(str(tmp_path / "emptied.pickle"))

    trace_step(step, steps=1, target=TARGET)
    actions = [(e.action, e.size // MiB) for e in load_snapshot(path).device_traces[0]]
    assert actions[:5] == [("segment_map", 20), ("alloc", 6), ("alloc", 6), ("alloc", 6), ("segment_map", 20)]
    assert actions.count(("segment_map", 20)) == 3
    emptied = [(e.action, e.size // MiB) for e in load_snapshot(tmp_path / "emptied.pickle").device_traces[0]]
    assert emptied[-1] == ("segment_unmap", 60)
    default = next(c for c in tune(load_snapshot(path), 1 << 40, candidates=("",)).candidates if c.alloc_conf == "")
    assert default.peak_reserved_bytes == 60 * MiB


def test_a_snapshot_names_the_target_s_setting_and_keeps_the_newest_entries(tmp_path):
    """A target with max_split_size_mb:64: the snapshot's allocator_settings carry it, so a
    replay of the file runs it; 1,000 requests with max_entries=3 keep the last three."""
    path = tmp_path / "snap.pickle"
    target = Target.resolve(GpuSpec("test GPU", 1024 * MiB, 0), alloc_conf="max_split_size_mb:64")

    def step() -> None:
        torch.cuda.memory._record_memory_history(max_entries=3)
        for _ in range(1000):
            x = torch.empty(512, dtype=torch.uint8, device="cuda")
            del x
        torch.cuda.memory._dump_snapshot(str(path))

    trace_step(step, steps=1, target=target)
    snapshot = load_snapshot(path)
    assert snapshot.allocator_settings == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}
    # 3,000 entries, the last request's three last: its alloc and its free, done at once.
    assert [(e.action, e.size) for e in snapshot.device_traces[0]] == [
        ("alloc", 512), ("free_requested", 512), ("free_completed", 512)
    ]


def test_the_small_bindings_answer_and_are_gone_after():
    """NVTX ranges, the sync debug mode, ipc_collect, the allocator backend, the host
    counters and the current stream's raw handle (bitsandbytes' CUDA backend reads it at
    import: its 8-bit optimizers had failed there) answer inside; outside, torch is as it was
    (a CPU build has none of them)."""
    had = {
        name: hasattr(torch._C, name)
        for name in ("_cuda_memorySnapshot", "_cuda_ipc_collect", "_cuda_getCurrentRawStream")
    }
    with as_one_cuda_gpu(TARGET.gpu):
        assert (torch.cuda.nvtx.range_push("step"), torch.cuda.nvtx.range_pop()) == (0, 0)
        with torch.cuda.nvtx.range("block"):
            pass
        torch.cuda.set_sync_debug_mode("warn")
        assert torch.cuda.get_sync_debug_mode() == 1
        assert torch.cuda.ipc_collect() is None
        assert torch.cuda.memory.get_allocator_backend() == "native"
        assert dict(torch.cuda.host_memory_stats()) == {}
        assert torch._C._cuda_getCurrentRawStream(0) == 0  # the default stream: nullptr
    assert {name: hasattr(torch._C, name) for name in had} == had
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="NVTX functions not installed"):
            torch.cuda.nvtx.range_push("step")


def test_a_cuda_api_not_answered_says_so_and_what_to_do():
    """torch.cuda.CUDAGraph() in a step: the failure names the call and says which CUDA APIs
    are answered, and that `oomkit run` measures the step on a GPU."""

    def step() -> None:
        torch.cuda.CUDAGraph()

    with pytest.raises(RuntimeError) as raised:
        trace_step(step, steps=1, target=TARGET)
    text = failure_text(raised.value)
    assert text.startswith("the step raised RuntimeError: Tried to instantiate dummy base class")
    assert text.endswith(
        "a CUDA API that oomkit's emulated GPU does not answer (CUDA graphs, memory pools and "
        "raw allocations are not modelled; side streams, the memory counters, empty_cache, the "
        "memory fraction, snapshots and NVTX are). Predict the step without that call, or "
        "measure it on a GPU with `oomkit run`"
    )


def test_set_allocator_settings_is_said_and_the_cpu_build_s_own_is_not_run():
    """torch.cuda.memory._set_allocator_settings in a step: the assumption names the last call
    and when it came; the CPU build's own binding is not called (it would change this
    process's allocator settings) and is back after. (What the calls do to the replay:
    test_allocator_settings_calls.py.)"""
    calls = []
    binding = torch._C._accelerator_setAllocatorSettings

    def step() -> None:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        x = torch.empty(1024, device="cuda")
        torch.cuda.memory._set_allocator_settings("max_split_size_mb:64")
        calls.append(torch._C._accelerator_setAllocatorSettings is binding)
        del x

    recording = trace_step(step, steps=1, target=TARGET)
    assert recording.assumptions["torch.cuda allocator settings"] == (
        "torch.cuda.memory._set_allocator_settings('max_split_size_mb:64') (the last of 2 "
        "call(s), after its first CUDA allocation) is replayed where the step made each call, "
        "as PyTorch updates its live allocator's settings then"
    )
    assert calls == [False]
    assert torch._C._accelerator_setAllocatorSettings is binding


def test_torch_version_cuda_is_the_target_s_cuda_inside_and_the_build_s_after():
    """Libraries branch on torch.version.cuda (transformers' TrainingArguments(tf32=True) had
    refused: "requires ... cuda>=11"): inside a recording it is the target's CUDA runtime, as
    in a CUDA build; after, this CPU build's again."""
    seen: list[object] = []
    outside = torch.version.cuda
    target = Target.resolve(GpuSpec("test GPU", 1024 * MiB, 0), cuda_version="12.8")

    def step() -> None:
        seen.append(torch.version.cuda)
        x = torch.empty(8, device="cuda")
        del x

    trace_step(step, steps=1, target=target)
    trace_step(step, steps=1, target=TARGET)
    assert seen == ["12.8", TARGET.cuda_version]
    assert TARGET.cuda_version is not None
    assert torch.version.cuda == outside


def test_cudnn_and_nccl_versions_are_the_target_s_inside_and_the_build_s_after(tmp_path):
    """A CPU build has no cuDNN or NCCL: ``torch.backends.cudnn.version()`` is None (a script's
    ``version() >= 8000`` raised TypeError), ``is_available()`` False, and
    ``torch.cuda.nccl.version()`` raised AttributeError (a script logging its environment).
    Inside a recording they answer for the target: its stated cuDNN (91002), else the cuDNN the
    SDPA emulation assumes (torch 2.13's default wheel's, 9.20.0), and the NCCL whose buffers
    oomkit models (2.30.7); after, the build's again."""
    from oomkit.core.gpus.nccl import NCCL_VERSION
    from oomkit.prediction.tracing.emulations.sdpa_backend import current_sdpa_settings

    seen: list[object] = []
    outside = (torch.backends.cudnn.version(), torch.backends.cudnn.is_available())

    def step() -> None:
        seen.append(
            (torch.backends.cudnn.version(), torch.backends.cudnn.is_available(),
             torch.cuda.nccl.version())
        )
        x = torch.empty(8, device="cuda")
        del x

    trace_step(step, steps=1, target=Target.resolve(TARGET.gpu, cudnn_version=91002))
    trace_step(step, steps=1, target=TARGET)
    assert NCCL_VERSION == (2, 30, 7)
    assert current_sdpa_settings().cudnn_version == 92000  # torch 2.13's default wheel: 9.20.0
    assert seen == [(91002, True, (2, 30, 7)), (92000, True, (2, 30, 7))]
    assert (torch.backends.cudnn.version(), torch.backends.cudnn.is_available()) == outside

    # A script, as `oomkit predict q.py --cudnn-version 91002` runs it.
    from oomkit.prediction.tracing.script_run import record_script

    script = tmp_path / "q.py"
    script.write_text(
        "import torch\n"
        "assert torch.backends.cudnn.version() == 91002, torch.backends.cudnn.version()\n"
        "assert torch.cuda.nccl.version() >= (2, 10)\n"
        "model = torch.nn.Linear(8, 8).cuda()\n"
        "opt = torch.optim.SGD(model.parameters())\n"
        "model(torch.ones(2, 8, device='cuda')).sum().backward()\n"
        "opt.step()\n"
    )
    run = record_script(script, steps=1, target=Target.resolve(TARGET.gpu, cudnn_version=91002))
    assert run.steps_recorded == 1


def test_torch_accelerator_is_the_emulated_cuda_gpu_and_reads_the_recording():
    """torch.accelerator (accelerate 1.16 picks its device from current_accelerator; torch's
    optimizers check current_stream().is_capturing()) answers as the GPU does: cuda, one
    device of index 0, a 4 MiB tensor in a 20 MiB segment (kLargeBuffer) in its counters, the
    target's free and total memory; outside, a CPU build has no accelerator again."""
    before = torch.accelerator.current_accelerator()
    read: list[object] = []

    def step() -> None:
        x = torch.empty(4 * MiB, dtype=torch.uint8, device=torch.accelerator.current_accelerator())
        torch.accelerator.synchronize()
        torch.accelerator.set_device_index(0)
        with torch.accelerator.device_index(0):
            read.append(
                (
                    torch.accelerator.current_accelerator(check_available=True),
                    torch.accelerator.is_available(),
                    torch.accelerator.device_count(),
                    torch.accelerator.current_device_index(),
                    torch.accelerator.current_stream().is_capturing(),
                    torch.accelerator.memory_allocated(),
                    torch.accelerator.max_memory_reserved(),
                    torch.accelerator.get_memory_info() == torch.cuda.mem_get_info(),
                )
            )
        del x

    trace_step(step, steps=1, target=TARGET)
    assert read == [(torch.device("cuda"), True, 1, 0, False, 4 * MiB, 20 * MiB, True)]
    assert torch.accelerator.current_accelerator() == before
