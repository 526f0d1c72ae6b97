"""The CUDA emulation engine: op interception, storage sync, emulation hooks, through a sink."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from oomkit.core.gpus import get_gpu
from oomkit.prediction.tracing.categories import Phase
from oomkit.prediction.tracing.emulation import EmulationContext
from oomkit.prediction.tracing.engine import CudaEmulationEngine
from oomkit.prediction.tracing.storages import Allocation


class _Refused(Exception):
    pass


class _ListSink:
    """Logs what the engine asks; refuses allocations above ``limit_bytes``."""

    def __init__(self, limit_bytes: int = 1 << 40) -> None:
        self.limit_bytes = limit_bytes
        self.log: list[tuple[Any, ...]] = []
        self._next_id = 1

    def allocate(self, size_bytes: int, op: str | None, *, first_seen: bool) -> Allocation | Exception:
        if size_bytes > self.limit_bytes:
            self.log.append(("refused", size_bytes, op))
            return _Refused(f"{size_bytes} bytes do not fit")
        alloc = Allocation(self._next_id, size_bytes, "user", None, op, ())
        self._next_id += 1
        self.log.append(("alloc", alloc.alloc_id, size_bytes, op, first_seen))
        return alloc

    def free(self, alloc: Allocation) -> None:
        self.log.append(("free", alloc.alloc_id))

    def storage_released(self, alloc: Allocation) -> None:
        self.log.append(("died", alloc.alloc_id))

    def refused(self, error: Exception) -> BaseException:
        return error

    def op_failed(self, op: str, error: BaseException) -> None:
        self.log.append(("failed", op))

    def phase(self) -> Phase:
        return "user"


def _engine(sink: _ListSink, **kwargs: Any) -> CudaEmulationEngine:
    kwargs.setdefault("emulations", {})
    kwargs.setdefault("divergent_ops", {})
    return CudaEmulationEngine(sink, gpu=get_gpu("h100-sxm"), device_type="meta", **kwargs)


def test_inputs_seen_first_then_outputs_in_order_then_frees_when_storages_die():
    """An input made before interception is first_seen; outputs get the op; death is reported."""
    sink = _ListSink()
    engine = _engine(sink)
    x = torch.empty(10, device="meta")  # 40 bytes, made before the engine intercepts
    with engine.intercept():
        y = x + 1
        del y
    assert sink.log == [
        ("alloc", 1, 40, None, True),
        ("alloc", 2, 40, "aten.add.Tensor", False),
        ("died", 2),
    ]


def test_a_refused_output_raises_the_sinks_error_and_the_storage_is_not_kept():
    """The first refused allocation makes the op raise what ``sink.refused`` returns."""
    sink = _ListSink(limit_bytes=100)
    engine = _engine(sink)
    with engine.intercept(), pytest.raises(_Refused, match="4000 bytes do not fit"):
        torch.empty(1000, device="meta")
    assert sink.log == [("refused", 4000, "aten.empty.memory_format")]
    assert list(engine.table.live()) == []


def test_storage_resize_allocates_the_new_size_before_freeing_the_old():
    """Resize.cpp resize_bytes: the new block first, then the old one goes."""
    sink = _ListSink()
    engine = _engine(sink)
    with engine.intercept(), engine.storage_resize_accounted():
        x = torch.empty(10, device="meta")
        x.untyped_storage().resize_(80)
        x.untyped_storage().resize_(0)
    assert sink.log == [
        ("alloc", 1, 40, "aten.empty.memory_format", False),
        ("alloc", 2, 80, "UntypedStorage.resize_", False),
        ("free", 1),
        ("free", 2),
    ]


def test_a_refused_storage_resize_keeps_the_old_size():
    """A resize that does not fit raises and leaves the storage as it was."""
    sink = _ListSink(limit_bytes=100)
    engine = _engine(sink)
    with engine.intercept(), engine.storage_resize_accounted():
        x = torch.empty(10, device="meta")
        with pytest.raises(_Refused):
            x.untyped_storage().resize_(400)
        assert x.untyped_storage().nbytes() == 40


def test_hooks_add_synthetic_allocations_tagged_with_category_and_what():
    """``ctx.allocate`` / ``ctx.free`` reach the sink; the engine tags the allocation."""
    sink = _ListSink()
    seen: list[Allocation] = []

    def mm(ctx: EmulationContext) -> Any:
        alloc_id = ctx.allocate(1234, "workspace", "test_workspace")
        seen.extend(a for a in ctx._engine._synthetic.values())
        out = ctx.run()
        ctx.free(alloc_id)
        ctx.note_choice("test kernel")
        return out

    engine = _engine(sink, emulations={"aten.mm.default": mm})
    a = torch.empty(2, 3, device="meta")
    with engine.intercept():
        torch.mm(a, a.t())
    assert sink.log[1:] == [
        ("alloc", 2, 1234, "aten.mm.default", False),
        ("free", 2),
        ("alloc", 3, 16, "aten.mm.default", False),
        ("died", 3),
    ]
    assert (seen[0].explicit, seen[0].emulated) == ("workspace", "test_workspace")
    assert engine.kernel_choices == {"test kernel": 1}
    with pytest.raises(ValueError, match="2 is not a live synthetic allocation"):
        engine.free_synthetic(2)


def test_a_refused_synthetic_allocation_raises_inside_the_hook():
    """A workspace that does not fit raises from ``ctx.allocate``, before the op runs."""
    sink = _ListSink(limit_bytes=100)

    def mm(ctx: EmulationContext) -> Any:
        ctx.allocate(1000, "workspace")
        return ctx.run()

    engine = _engine(sink, emulations={"aten.mm.default": mm})
    a = torch.empty(2, 3, device="meta")
    with engine.intercept(), pytest.raises(_Refused):
        torch.mm(a, a.t())
    assert sink.log[1:] == [("refused", 1000, "aten.mm.default"), ("failed", "aten.mm.default")]


def test_divergent_ops_without_a_hook_are_counted():
    """An op listed as divergent that has no hook is counted, once per call."""
    sink = _ListSink()
    engine = _engine(sink, divergent_ops={"aten.mm.default": "cuBLAS workspace"})
    a = torch.empty(2, 2, device="meta")
    with engine.intercept():
        torch.mm(a, a)
        torch.mm(a, a)
    assert engine.divergent_calls == {"aten.mm.default": 2}


def test_storages_of_other_devices_are_not_accounted():
    """Only ``device_type`` storages reach the sink (a CPU tensor is host memory)."""
    sink = _ListSink()
    engine = _engine(sink)
    with engine.intercept():
        torch.ones(4) + 1
    assert sink.log == []
