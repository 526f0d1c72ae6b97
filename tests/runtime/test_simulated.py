"""The simulated CUDA device: real CPU code, GPU accounting, the real torch.OutOfMemoryError."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.allocator import STAT_KEYS
from oomkit.core.replay import replay_snapshot
from oomkit.core.snapshot import load_snapshot, snapshot_from_data, write_snapshot
from oomkit.errors import SimulatedDeviceError, TorchRequiredError
from oomkit.runtime import (
    DeviceMemory,
    SimulatedCudaDevice,
    current_device,
    is_out_of_memory,
    release_after_oom,
)

MiB = 2**20
# CUDACachingAllocator.cpp kSmallBuffer: requests of at most 1 MiB share 2 MiB small segments.
SMALL_SEGMENT = 2 * MiB
# kLargeBuffer: requests between 1 and 10 MiB get a 20 MiB segment.
LARGE_SEGMENT = 20 * MiB

OOM_40MIB_ON_64MIB = (
    "CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 64.00 MiB "
    "of which 24.00 MiB is free. Of the allocated memory 40.00 MiB is allocated by PyTorch, and "
    "0 bytes is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
    "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html"
    "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
)


def _line() -> int:
    return sys._getframe(1).f_lineno


# ---------------------------------------------------------------------- accounting


def test_a_small_tensor_takes_a_512_byte_multiple_in_a_2_mib_segment(simulated_device):
    """torch.empty(1000) requests 4000 B: a 4096 B block in one 2 MiB small segment."""
    device = simulated_device("64MiB")
    t = torch.empty(1000)
    stats = device.memory_stats()
    assert stats["requested_bytes.all.current"] == 4000
    assert device.memory_allocated() == 4096
    assert device.memory_reserved() == SMALL_SEGMENT
    assert stats["segment.small_pool.current"] == 1
    assert stats["segment.large_pool.current"] == 0
    assert t.numel() == 1000


def test_a_freed_tensor_returns_its_block_to_the_cache(simulated_device):
    """Deleting the last reference frees the block; the segment stays cached until empty_cache."""
    device = simulated_device("64MiB")
    t = torch.empty(3 * MiB // 4)  # 3 MiB: a large-pool request, 20 MiB segment
    assert device.memory_allocated() == 3 * MiB
    del t
    assert device.memory_allocated() == 0
    assert device.memory_reserved() == LARGE_SEGMENT
    device.empty_cache()
    assert device.memory_reserved() == 0
    assert device.memory_stats()["num_device_free"] == 1


def test_views_share_their_base_storage(simulated_device):
    """A view allocates nothing; the block is freed only when the last alias dies."""
    device = simulated_device("64MiB")
    base = torch.empty(4, 256)
    view = base.view(256, 4).t()[1:]
    assert device.memory_allocated() == 4096
    del base
    assert device.memory_allocated() == 4096
    del view
    assert device.memory_allocated() == 0


def test_zero_byte_tensors_allocate_nothing(simulated_device):
    """An empty tensor makes no allocator call (malloc(0) returns nullptr)."""
    device = simulated_device("64MiB")
    empty = torch.empty(0, 128)
    assert device.memory_stats()["allocation.all.allocated"] == 0
    assert empty.numel() == 0


def test_resize_allocates_the_new_size_before_freeing_the_old(simulated_device):
    """resize_ to more bytes: new block first, then the old one goes (CUDA resize_bytes)."""
    device = simulated_device("64MiB", record_history=True)
    t = torch.empty(100)  # 400 B -> 512 B block
    t.resize_(1000)  # 4000 B -> 4096 B block
    assert device.memory_allocated() == 4096
    actions = [(e.action, e.size) for e in device.events() if not e.action.startswith("seg")]
    assert actions == [
        ("alloc", 400),
        ("alloc", 4000),
        ("free_requested", 400),
        ("free_completed", 400),
    ]
    assert device.max_memory_allocated() == 512 + 4096


def test_storage_resize_to_zero_and_back_is_accounted_at_once(simulated_device):
    """untyped_storage().resize_(0) frees the block now; resizing up allocates again (FSDP)."""
    device = simulated_device("64MiB")
    t = torch.empty(1000)
    t.untyped_storage().resize_(0)
    assert device.memory_allocated() == 0
    t.untyped_storage().resize_(8000)
    assert device.memory_allocated() == 8192
    del t
    assert device.memory_allocated() == 0


def test_a_refused_storage_resize_leaves_the_storage_as_it_was(simulated_device):
    """A storage resize_ the device cannot serve raises OOM and keeps the old size and block."""
    device = simulated_device("64MiB")
    t = torch.empty(1000)
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 128.00 MiB"):
        t.untyped_storage().resize_(128 * MiB)
    assert t.untyped_storage().nbytes() == 4000
    assert device.memory_allocated() == 4096
    assert torch.UntypedStorage.resize_ is not torch._C.StorageBase.resize_


def test_storage_resize_is_restored_on_exit():
    """The resize_ wrapper is installed only while the device is active."""
    with SimulatedCudaDevice("64MiB", context_overhead_bytes=0):
        assert torch.UntypedStorage.resize_ is not torch._C.StorageBase.resize_
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_
    assert "resize_" not in vars(torch.UntypedStorage)


def test_storages_made_before_entering_are_accounted_by_track(simulated_device):
    """track() accounts an existing module, its optimizer's state and nested tensors, once."""
    model = torch.nn.Linear(256, 256)  # 256 KiB weight + 1 KiB bias
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 256)).sum().backward()
    opt.step()  # momentum buffers: 256 KiB + 1 KiB; grads: the same again
    inputs = {"x": [torch.empty(10)]}  # 40 B -> 512 B block
    device = simulated_device("64MiB")
    assert device.memory_allocated() == 0
    device.track(model, opt, inputs)
    assert device.memory_allocated() == 3 * (256 * 1024 + 1024) + 512
    device.track(model, opt)
    assert device.memory_allocated() == 3 * (256 * 1024 + 1024) + 512


def test_storages_first_seen_as_op_inputs_are_accounted_then(simulated_device):
    """A tensor made before the device is accounted when an op first reads it."""
    x = torch.ones(1024)  # 4 KiB, made outside
    device = simulated_device("64MiB")
    y = x * 2
    assert device.memory_allocated() == 2 * 4096
    assert y.sum().item() == 2048.0


def test_meta_device_type_accounts_meta_storages_only(simulated_device):
    """With device_type='meta' a meta tensor is a CUDA allocation and a CPU one is host memory."""
    device = simulated_device("64MiB", device_type="meta")
    m = torch.empty(5 * MiB // 4, device="meta")  # 5 MiB
    c = torch.empty(1000)
    assert device.memory_allocated() == 5 * MiB
    assert device.memory_reserved() == LARGE_SEGMENT
    assert (m.device.type, c.device.type) == ("meta", "cpu")


def test_current_device_is_the_simulated_one_inside_the_block():
    """use_device is installed with the dispatch mode and removed on exit."""
    device = SimulatedCudaDevice("64MiB", context_overhead_bytes=0)
    with device:
        assert current_device() is device
        assert device.active
    assert not device.active
    assert isinstance(device, DeviceMemory)


def test_frees_after_exit_are_still_accounted():
    """A storage made inside the block and dropped after it is given back."""
    device = SimulatedCudaDevice("64MiB", context_overhead_bytes=0)
    with device:
        t = torch.empty(1000)
    assert device.memory_allocated() == 4096
    del t
    assert device.memory_allocated() == 0


def test_mem_get_info_reports_capacity_less_context_and_reserved(simulated_device):
    """free = total - context - reserved, as cudaMemGetInfo would say."""
    device = simulated_device("64MiB", context_overhead_bytes=4 * MiB)
    t = torch.empty(1000)
    assert device.mem_get_info() == (64 * MiB - 4 * MiB - SMALL_SEGMENT, 64 * MiB)
    assert t.numel() == 1000


def test_memory_stats_have_torch_keys(simulated_device):
    """memory_stats() carries torch.cuda.memory_stats()'s keys (with the 2.12+ rejection count)."""
    device = simulated_device("64MiB")
    assert set(device.memory_stats()) == set(STAT_KEYS) | {"num_oom_rejections"}


def test_frees_from_another_thread_are_accounted(simulated_device):
    """A tensor dropped on another thread is freed once the allocator is idle."""
    device = simulated_device("64MiB")
    box = [torch.empty(1000)]
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert device.memory_allocated() == 0


# ---------------------------------------------------------------------- OOM


def test_oom_is_raised_at_the_allocation_with_pytorchs_message(simulated_device):
    """The second 40 MiB tensor on a 64 MiB device raises torch.OutOfMemoryError there."""
    device = simulated_device("64MiB")
    first = torch.empty(10 * MiB)  # 40 MiB
    with pytest.raises(torch.OutOfMemoryError) as info:
        line = _line() + 1
        torch.empty(10 * MiB)
    assert type(info.value) is torch.OutOfMemoryError
    assert str(info.value) == OOM_40MIB_ON_64MIB
    assert info.traceback[-1].lineno + 1 != line  # raised below the user's line, in the op
    assert any(entry.lineno + 1 == line for entry in info.traceback)
    assert device.oom_count == 1
    assert device.memory_stats()["num_ooms"] == 1
    assert device.memory_allocated() == 40 * MiB
    assert first.numel() == 10 * MiB


def test_an_op_that_ooms_on_its_second_output_frees_the_first(simulated_device):
    """sort's values fit and its int64 indices do not: the values' block is freed again."""
    device = simulated_device("64MiB")
    keep = torch.empty(10 * MiB)  # 40 MiB segment
    x = torch.randn(3 * MiB // 2)  # 6 MiB in a new 20 MiB segment: 60 MiB reserved
    before = device.memory_allocated()
    # values (6 MiB) fit in the 14 MiB left; indices (12 MiB) need a new segment: no room.
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 12.00 MiB"):
        torch.sort(x)
    assert device.memory_allocated() == before
    assert device.memory_stats()["allocation.all.current"] == 2
    assert device.oom_count == 1
    assert keep.numel() == 10 * MiB


def test_oom_is_detected_by_type(simulated_device):
    """oomkit.runtime.is_out_of_memory recognises the simulated device's error."""
    simulated_device("8MiB")
    try:
        torch.empty(4 * MiB)
    except Exception as exc:  # noqa: BLE001 - the point is the type check
        caught = exc
    assert is_out_of_memory(caught)


def test_after_an_oom_released_memory_is_usable_again(simulated_device):
    """Once the failed step's tensors are released, the same allocation succeeds."""
    device = simulated_device("64MiB")

    def step() -> None:
        held = torch.empty(10 * MiB)  # 40 MiB held by the frame
        torch.empty(10 * MiB)  # noqa: F841 - OOMs while `held` is alive
        del held

    try:
        step()
    except torch.OutOfMemoryError as exc:
        assert device.memory_allocated() == 40 * MiB  # the traceback keeps `held` alive
        release_after_oom(exc)
        assert device.memory_allocated() == 0
        assert device.memory_reserved() == 0
    assert device.oom_count == 1
    again = torch.empty(10 * MiB)
    assert device.memory_allocated() == 40 * MiB
    assert again.numel() == 10 * MiB


def test_oom_in_backward_raises_the_same_type(simulated_device):
    """An allocation refused during loss.backward() surfaces as torch.OutOfMemoryError."""
    device = simulated_device("32MiB")
    w = torch.randn(1024, 1024, requires_grad=True)  # 4 MiB -> 20 MiB segment
    x = torch.randn(1024, 1024)  # 4 MiB in the same segment
    y = (x @ w).sum()  # x @ w: 4 MiB, 12 MiB left in the segment
    filler = torch.empty(3 * MiB // 2)  # 6 MiB, 6 MiB left
    filler2 = torch.empty(3 * MiB // 2)  # 6 MiB, 0 left; 12 MiB of device remain
    with pytest.raises(torch.OutOfMemoryError):
        y.backward()  # grad of w (4 MiB) needs a new 20 MiB segment
    assert device.oom_count >= 1
    assert filler.numel() + filler2.numel() == 3 * MiB


def test_oom_observers_get_device_size_total_and_free(simulated_device):
    """Observers see (device, segment size, device total, device free) before the raise."""
    device = simulated_device("64MiB")
    seen: list[tuple[int, int, int, int]] = []
    device.attach_oom_observer(lambda *args: seen.append(args))
    keep = torch.empty(10 * MiB)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(10 * MiB)
    assert seen == [(0, 40 * MiB, 64 * MiB, 24 * MiB)]
    assert keep.numel() == 10 * MiB


def test_a_model_that_does_not_fit_ooms_in_track(simulated_device):
    """track() raises torch.OutOfMemoryError when the existing storages exceed the device."""
    big = torch.empty(3 * MiB)  # 12 MiB
    device = simulated_device("8MiB")
    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 12.00 MiB"):
        device.track(big)
    assert device.memory_allocated() == 0


def test_a_per_process_fraction_caps_the_device(simulated_device):
    """alloc_conf per_process_memory_fraction:0.5 makes a 64 MiB device refuse 40 MiB."""
    device = simulated_device("64MiB", alloc_conf="per_process_memory_fraction:0.5")
    with pytest.raises(torch.OutOfMemoryError, match="32.00 MiB allowed"):
        torch.empty(10 * MiB)
    assert device.oom_count == 1


# ---------------------------------------------------------------------- training


def _sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_a_linear_training_loop_has_the_exact_peak(simulated_device):
    """Linear(512, 512) + SGD on a 128x512 batch peaks at 2,622,464 allocated bytes."""
    device = simulated_device("64MiB")
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512, bias=False)  # weight 1 MiB
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(128, 512)  # 256 KiB
    assert device.memory_allocated() == MiB + 256 * 1024
    for _ in range(3):
        _sgd_step(model, opt, x)
    # Peak at the weight gradient's allocation in backward: weight 1 MiB + batch 256 KiB
    # + loss (4 B -> 512 B block) + its seed gradient (512 B) + grad of the output
    # (256 KiB) + weight.grad (1 MiB). The forward's output and square (2 x 256 KiB) are dead
    # by then.
    assert device.max_memory_allocated() == 2 * MiB + 2 * 256 * 1024 + 2 * 512
    assert device.memory_allocated() == MiB + 256 * 1024  # zero_grad(set_to_none)
    # Every block is at most 1 MiB: two 2 MiB small segments, no large one.
    stats = device.memory_stats()
    assert (stats["segment.small_pool.peak"], stats["segment.large_pool.peak"]) == (2, 0)
    assert device.max_memory_reserved() == 2 * SMALL_SEGMENT


def test_a_step_that_ooms_works_when_retried_smaller(simulated_device):
    """A batch of 4096 OOMs on 8 MiB; after release_after_oom the batch of 256 trains."""
    device = simulated_device("8MiB")
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tried: list[tuple[int, bool]] = []

    def step(batch: int) -> None:
        x = torch.randn(batch, 256)  # 4 MiB needs a 20 MiB segment; 256 KiB fits
        _sgd_step(model, opt, x)

    for batch in (4096, 256):
        try:
            step(batch)
        except torch.OutOfMemoryError as exc:
            tried.append((batch, False))
            release_after_oom(exc)
            continue
        tried.append((batch, True))
    assert tried == [(4096, False), (256, True)]
    assert device.oom_count == 1
    # Only the parameters remain: 256 KiB weight and 1 KiB bias.
    assert device.memory_allocated() == 256 * 1024 + 1024
    assert device.memory_stats()["num_ooms"] == 1


# ---------------------------------------------------------------------- history and snapshot


def test_history_records_allocs_frees_and_segments_with_user_frames(simulated_device):
    """Events carry the user's line: segment_alloc + alloc where made, frees where dropped."""
    device = simulated_device("64MiB", record_history=True, get_time_us=lambda: 7)
    made = _line() + 1
    t = torch.empty(1000)
    dropped = _line() + 1
    del t
    events = device.events()
    assert [(e.action, e.size) for e in events] == [
        ("segment_alloc", SMALL_SEGMENT),
        ("alloc", 4000),
        ("free_requested", 4000),
        ("free_completed", 4000),
    ]
    assert [e.frames[0].line for e in events] == [made, made, dropped, dropped]
    assert {e.frames[0].filename for e in events} == {__file__}
    assert {e.time_us for e in events} == {7}


def test_history_records_the_oom_entry(simulated_device):
    """An OOM leaves an `oom` entry: device free bytes as address, the rounded size."""
    device = simulated_device("64MiB", record_history=True)
    keep = torch.empty(10 * MiB)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(10 * MiB + 1)
    last = device.events()[-1]
    assert (last.action, last.address, last.size) == ("oom", 24 * MiB, 40 * MiB + 512)
    assert keep.numel() == 10 * MiB


def test_max_entries_keeps_the_newest_events(simulated_device):
    """max_entries bounds the history to the newest events, like _record_memory_history."""
    device = simulated_device("64MiB", record_history=True, max_entries=2)
    t = torch.empty(1000)
    del t
    assert [e.action for e in device.events()] == ["free_requested", "free_completed"]


def test_history_can_start_and_stop_later(simulated_device):
    """record_memory_history starts the trace; stop_memory_history stops and clears it."""
    device = simulated_device("64MiB")
    before = torch.empty(1000)
    device.record_memory_history(max_entries=10)
    after = torch.empty(2000)
    assert [(e.action, e.size) for e in device.events()] == [("alloc", 8000)]
    device.stop_memory_history()
    del before, after
    assert device.events() == ()
    assert device.memory_allocated() == 0


def test_a_detached_observer_is_not_called(simulated_device):
    """detach_oom_observer removes the observer; unknown ones are ignored."""
    device = simulated_device("8MiB")
    seen: list[tuple[int, ...]] = []
    observer = seen.append
    device.attach_oom_observer(lambda *args: observer(args))
    device.attach_oom_observer(observer)
    device.detach_oom_observer(observer)
    device.detach_oom_observer(print)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(4 * MiB)
    assert seen == [(0, 16 * MiB, 8 * MiB, 8 * MiB)]


def test_no_history_without_record_history(simulated_device):
    """events() is empty unless record_history was asked for."""
    device = simulated_device("64MiB")
    t = torch.empty(1000)
    assert device.events() == ()
    assert t.numel() == 1000


def test_snapshot_loads_and_replays_to_the_same_state(simulated_device, tmp_path):
    """snapshot() written with write_snapshot loads, and replaying it matches the final state."""
    device = simulated_device("64MiB", record_history=True)
    keep = [torch.empty(n) for n in (1000, 3_000_000, 20, 5_000_000)]
    del keep[1]
    big = torch.empty(2_000_000)
    data = device.snapshot()
    live = [b for s in data["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert len(live) == 4 and all(b["frames"] for b in live)
    snapshot = snapshot_from_data(data)
    path = write_snapshot(tmp_path / "sim.pickle", snapshot.segments, snapshot.device_traces)
    loaded = load_snapshot(path)
    result = replay_snapshot(loaded, verify=True, capacity_bytes=64 * MiB)
    assert result.final_state_matches is True
    assert result.allocs_misplaced == 0
    assert result.final_allocated_bytes == device.memory_allocated()
    assert result.peak_reserved_bytes == device.max_memory_reserved()
    assert big.numel() == 2_000_000


# ---------------------------------------------------------------------- misuse


def test_the_device_is_not_reentrant():
    """Entering an active device again, or a second device, is refused."""
    device = SimulatedCudaDevice("64MiB", context_overhead_bytes=0)
    other = SimulatedCudaDevice("64MiB", context_overhead_bytes=0)
    with device:
        with pytest.raises(SimulatedDeviceError, match="not reentrant"):
            device.__enter__()
        with pytest.raises(SimulatedDeviceError, match="only one SimulatedCudaDevice"):
            other.__enter__()
    with other:
        assert current_device() is other


def test_an_unknown_device_type_is_refused():
    """device_type must be cpu or meta; the message says which to use."""
    with pytest.raises(SimulatedDeviceError, match="'cpu' or 'meta'"):
        SimulatedCudaDevice("64MiB", device_type="cuda")


def test_the_error_without_torch_names_the_extra():
    """TorchRequiredError is an ImportError that names oomkit[torch]."""
    assert issubclass(TorchRequiredError, ImportError)


# ---------------------------------------------------------------------- invariants


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(min_value=1, max_value=12 * MiB)),
            st.tuples(st.just("free"), st.integers(min_value=0, max_value=50)),
            st.tuples(st.just("empty_cache"), st.just(0)),
        ),
        max_size=30,
    )
)
def test_random_allocs_and_frees_keep_the_stats_consistent(ops):
    """allocated <= reserved <= usable; requested bytes equal the live tensors' bytes."""
    usable = 48 * MiB - 4 * MiB
    with SimulatedCudaDevice("48MiB", context_overhead_bytes=4 * MiB) as device:
        live: list[torch.Tensor] = []
        ooms = 0
        for kind, value in ops:
            if kind == "alloc":
                try:
                    live.append(torch.empty(value, dtype=torch.uint8))
                except torch.OutOfMemoryError:
                    ooms += 1
            elif kind == "free" and live:
                live.pop(value % len(live))
            elif kind == "empty_cache":
                device.empty_cache()
            stats = device.memory_stats()
            assert device.memory_allocated() <= device.memory_reserved() <= usable
            assert stats["requested_bytes.all.current"] == sum(t.nbytes for t in live)
            assert stats["allocation.all.current"] == len(live)
        assert device.oom_count == ooms == device.memory_stats()["num_ooms"]
        live.clear()
        assert device.memory_allocated() == 0
        device.empty_cache()
        assert device.memory_reserved() == 0


# ---------------------------------------------------------------------- emulations (shared engine)


def _sdpa_step(emulations):
    from torch.nn import functional as F

    q, k, v = (torch.empty(2, 4, 128, 64, device="meta", requires_grad=True) for _ in range(3))
    with SimulatedCudaDevice(
        "1GiB",
        context_overhead_bytes=0,
        device_type="meta",
        emulations=emulations,
        record_history=True,
    ) as device:
        device.track(q, k, v)
        base = device.memory_allocated()
        F.scaled_dot_product_attention(q, k, v)
        sizes = [e.size for e in device.events() if e.action == "alloc"][3:]
        return sizes, device.max_memory_allocated() - base


def test_without_emulations_sdpa_runs_the_meta_math_path():
    """By default nothing is emulated: meta's math path materialises the 128x128 scores."""
    sizes, peak = _sdpa_step(None)
    # scores [2, 4, 128, 128] fp32 = 524288 bytes (twice: matmul, softmax); output 262144.
    assert sizes == [262144, 262144, 524288, 524288, 262144]
    assert peak == 1572864


def test_emulations_run_the_sdpa_kernel_cuda_picks_through_the_tracers_engine():
    """With the tracer's SDPA hook, fp32 goes to the memory-efficient kernel, as on CUDA."""
    from oomkit.prediction.tracing import DEFAULT_EMULATIONS
    from oomkit.prediction.tracing.emulations.sdpa import SDPA_FUNCTION

    sizes, peak = _sdpa_step({SDPA_FUNCTION: DEFAULT_EMULATIONS[SDPA_FUNCTION]})
    # Output, fp32 logsumexp [2, 4, 128], philox seed and offset (8 bytes each, 512 rounded).
    assert sizes == [262144, 4096, 8, 8]
    assert peak == 262144 + 4096 + 512 + 512


def test_an_emulated_workspace_that_does_not_fit_raises_out_of_memory():
    """A hook's synthetic allocation asks the simulated allocator and can OOM like a storage."""

    def mm_with_workspace(ctx):
        workspace = ctx.allocate(ctx.state.get("workspace_bytes", 8 * MiB), "workspace")
        out = ctx.run()
        ctx.free(workspace)
        return out

    a = torch.empty(64, 64)
    with SimulatedCudaDevice(
        "64MiB", context_overhead_bytes=0, emulations={"aten.mm.default": mm_with_workspace}
    ) as device:
        device.track(a)
        torch.mm(a, a)
        # `a` and the 8 MiB workspace; the output is accounted when the hook has returned (the
        # workspace is gone by then: ctx.record_outputs would account it earlier).
        assert device.max_memory_allocated() == 16384 + 8 * MiB
        assert device.memory_allocated() == 16384
        device._engine.state["workspace_bytes"] = 100 * MiB
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 100.00 MiB"):
            torch.mm(a, a)
        assert device.oom_count == 1
        assert device.memory_allocated() == 16384
