"""Fake tensors stand for CUDA memory by their meta storage; tensors from Python data do not."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from oomkit.prediction.tracing.fake_storages import mark_host, stands_for_cuda
from oomkit.prediction.tracing.storages import tensor_storage


def test_fake_tensor_storage_is_its_meta_storage_shared_by_views():
    """A fake tensor reports cpu, but its storage is meta: a view shares it, nbytes as on CUDA."""
    with FakeTensorMode():
        x = torch.empty(4, 8)
        view = x[1:]
    storage = tensor_storage(x, "meta")
    assert x.device.type == "cpu"
    assert storage is not None and storage.nbytes() == 4 * 8 * 4
    assert tensor_storage(view, "meta")._cdata == storage._cdata
    assert stands_for_cuda(x) and stands_for_cuda(torch.empty(2, device="meta"))


def test_host_tensors_and_real_cpu_tensors_are_not_device_memory():
    """A fake tensor marked host (torch.tensor(0.0): AdamW's step) and a real CPU tensor count 0."""
    with FakeTensorMode():
        step = torch.tensor(0.0)
    mark_host(step)
    assert tensor_storage(step, "meta") is None and not stands_for_cuda(step)
    real = torch.zeros(3)
    assert tensor_storage(real, "meta") is None and not stands_for_cuda(real)
    assert tensor_storage("not a tensor", "meta") is None
