"""torch.load to CUDA and torch.set_default_device("cuda") on the emulated GPU, to the byte."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator

import pytest
import torch
import torch.serialization
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu


@contextlib.contextmanager
def _saved_as_from(location: str) -> Iterator[None]:
    """torch.save tags every storage with ``location``, as a checkpoint written on that GPU."""
    entry = (0, lambda storage: location, lambda storage, loc: None)
    torch.serialization._package_registry.insert(0, entry)
    try:
        yield
    finally:
        torch.serialization._package_registry.remove(entry)


def _checkpoint(state: object, location: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with _saved_as_from(location) if location else contextlib.nullcontext():
        torch.save(state, buffer)
    return buffer.getvalue()


def _allocations(step) -> list[int]:
    recording = trace_step(step)
    return sorted(e.size for e in recording.events if e.action == "alloc")


def _tied_state() -> dict[str, torch.Tensor]:
    weight = torch.ones(64, 32)  # 8192 bytes, saved once for both names
    return {"wte": weight, "lm_head": weight, "bias": torch.zeros(10, dtype=torch.float16)}


@pytest.mark.parametrize(
    "map_location", ["cuda", "cuda:0", torch.device("cuda"), {"cpu": "cuda:0"}]
)
def test_a_state_dict_mapped_to_cuda_is_one_allocation_per_storage(map_location):
    """Tied tensors share one 8192-byte storage on the device; the fp16 bias is 20 bytes."""
    data = _checkpoint(_tied_state())
    seen = {}

    def step() -> None:
        with as_one_cuda_gpu():
            state = torch.load(io.BytesIO(data), map_location=map_location)
            seen["devices"] = {t.device.type for t in state.values()}
            seen["shared"] = state["wte"].untyped_storage()._cdata == (
                state["lm_head"].untyped_storage()._cdata
            )
            seen["shape"] = tuple(state["wte"].shape)
            del state

    # torch's _rebuild_tensor makes an empty (0,) tensor per tensor before set_; those hold 0
    # bytes, which the recorder does not count as a request.
    assert [size for size in _allocations(step) if size] == [20, 8192]
    assert seen == {"devices": {"meta"}, "shared": True, "shape": (64, 32)}


def test_a_checkpoint_saved_on_a_gpu_lands_on_it_without_map_location():
    """A file tagged cuda:0 loads onto the GPU (torch's default_restore_location)."""
    data = _checkpoint({"w": torch.ones(256)}, "cuda:0")
    seen = {}

    def step() -> None:
        with as_one_cuda_gpu():
            seen["device"] = torch.load(io.BytesIO(data))["w"].device.type

    assert [size for size in _allocations(step) if size] == [1024]
    assert seen["device"] == "meta"


def test_a_gpu_index_the_machine_lacks_is_torch_own_error():
    """cuda:3 on a one-GPU machine fails as torch fails it (its _validate_device)."""
    data = _checkpoint({"w": torch.ones(4)}, "cuda:3")
    with as_one_cuda_gpu(), pytest.raises(RuntimeError, match="device_count\\(\\) is 1"):
        torch.load(io.BytesIO(data))


def test_map_location_cpu_keeps_real_values_and_allocates_nothing_on_the_gpu():
    data = _checkpoint({"w": torch.arange(6.0)}, "cuda:0")
    seen = {}

    def step() -> None:
        with as_one_cuda_gpu():
            seen["w"] = torch.load(io.BytesIO(data), map_location="cpu")["w"]

    assert [size for size in _allocations(step) if size] == []
    assert seen["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_outside_the_emulated_gpu_torch_own_deserializer_answers():
    """The registered deserializer declines: a CPU machine's torch error, unchanged."""
    data = _checkpoint({"w": torch.ones(4)}, "cuda:0")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine loads it for real")
    with pytest.raises(RuntimeError, match="torch.cuda.is_available\\(\\) is False"):
        torch.load(io.BytesIO(data))


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.sampled_from(_DTYPES)), min_size=1, max_size=6))
def test_each_saved_storage_is_allocated_once_with_its_bytes(specs):
    """Any state dict mapped to cuda: the recorded requests are its storages' bytes."""
    state = {f"t{i}": torch.zeros(n, dtype=dtype) for i, (n, dtype) in enumerate(specs)}
    data = _checkpoint(state)

    def step() -> None:
        with as_one_cuda_gpu():
            loaded = torch.load(io.BytesIO(data), map_location="cuda")
            del loaded

    expected = sorted(n * dtype.itemsize for n, dtype in specs)
    assert [size for size in _allocations(step) if size] == expected


def test_set_default_device_cuda_puts_factories_on_the_gpu():
    """torch.set_default_device("cuda") (its mode at the stack's bottom) lands on meta:
    nn.Linear(1024, 256)'s weight and bias and a randn are 1 MiB, 1 KiB and 32 KiB."""
    seen = {}

    def step() -> None:
        with as_one_cuda_gpu():
            torch.set_default_device("cuda")
            try:
                layer = torch.nn.Linear(1024, 256)
                x = torch.randn(32, 256)
                seen["devices"] = {layer.weight.device.type, x.device.type}
                del layer, x
            finally:
                torch.set_default_device(None)

    assert _allocations(step) == [1024, 32 * 1024, 1024 * 1024]
    assert seen["devices"] == {"meta"}


@pytest.mark.parametrize("default", ["cuda", "cuda:0", None])
def test_get_default_device_reads_the_cuda_default_as_the_gpu_does(default):
    """Under set_default_device("cuda"), torch.get_default_device() is cuda:0 (torch asks
    torch.tensor([]).device, which lands on meta here: it had read meta); with no CUDA default
    it is torch's own answer; both undone after."""
    before = torch.get_default_device()
    with as_one_cuda_gpu():
        torch.set_default_device(default)
        try:
            seen = torch.get_default_device()
        finally:
            torch.set_default_device(None)
    assert seen == (torch.device("cpu") if default is None else torch.device("cuda", 0))
    assert torch.get_default_device() == before
