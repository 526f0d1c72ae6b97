"""A ``DataLoader`` in a builder or its step: its host work on the host, its workers in-process.

A builder (``file.py:function``) and its step run with meta as the default device. A
``DataLoader``'s own host work made its tensors there too, so values it needs were ones oomkit
does not know: the shared seed every iterator draws (torch/utils/data/dataloader.py
``_BaseDataLoaderIter.__init__``: ``loader._get_shared_seed()``, an ``int64`` tensor's
``.item()``) and ``RandomSampler``'s seed (torch/utils/data/sampler.py ``RandomSampler.__iter__``:
``int(torch.empty((), dtype=torch.int64).random_().item())``), so ``shuffle=True`` stopped the
prediction. And worker processes cannot run on the meta device: each calls
``torch.manual_seed`` with the seed (torch/utils/data/_utils/worker.py ``_worker_loop``) and
fails, and a meta batch cannot be sent back through a worker's queue; the prediction ended with
"DataLoader worker exited unexpectedly" and the workers' own tracebacks.

While open, as in the loader's own process on a GPU machine:

- an iterator is made, and its sampler asked for the next indices, with the CPU as the default
  device, so the seeds and the sampler's permutation are host tensors with real values; the
  dataset is read as before (``_dataset_fetcher.fetch``), under the builder's default device:
  what its ``__getitem__`` makes without a device is meta, as the builder's own tensors are;
- an iterator over a loader with workers is the single-process one
  (``_SingleProcessDataLoaderIter``, what ``DataLoader._get_iterator`` gives for
  ``num_workers=0``): the same sampler, collate function and batches, from this process.

Nothing on the GPU changes: workers are CPU processes that never hold CUDA memory (their
batches are moved by the loop, and pinned by a thread of the main process with
``pin_memory=True``). Where it may differ: an ``IterableDataset`` that shards itself by
``get_worker_info()`` sees no worker info and yields every item, so it gives more batches than
one worker would (each the same size), and ``worker_init_fn`` is not called.

``pinning_on_the_host()`` (open wherever a GPU is emulated, ``cuda_device.as_one_cuda_gpu``):
a loader's ``pin_memory=True`` pins nothing. With ``torch.accelerator`` answering ``cuda``, a
loader pins its batches (torch/utils/data/dataloader.py ``_BaseDataLoaderIter.__init__``), with
workers in a thread of its own (``_utils/pin_memory.py`` ``_pin_memory_loop``), where the
emulation's tensor hooks (thread-local) do not reach and a CPU build's ``Tensor.pin_memory``
raises. Pinned host memory is host memory: the GPU's figures do not change.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["loaders_on_the_host", "pinning_on_the_host"]


@contextlib.contextmanager
def loaders_on_the_host() -> Iterator[None]:
    """While open, ``DataLoader`` iterators draw their seeds and indices on the CPU and load in
    this process (module docstring)."""
    import torch
    from torch.utils.data import dataloader

    get_iterator = dataloader.DataLoader._get_iterator
    next_index = dataloader._BaseDataLoaderIter._next_index

    def in_process(loader: Any) -> Any:
        with torch.device("cpu"):
            if loader.num_workers == 0:
                return get_iterator(loader)
            # _SingleProcessDataLoaderIter checks both at its construction; what else it reads
            # of the loader is the loader's own, and both are the user's again at once after.
            workers, timeout = loader.num_workers, loader.timeout
            loader.num_workers, loader.timeout = 0, 0
            try:
                return dataloader._SingleProcessDataLoaderIter(loader)
            finally:
                loader.num_workers, loader.timeout = workers, timeout

    def on_the_host(iterator: Any) -> Any:
        with torch.device("cpu"):  # the sampler's seed and permutation (RandomSampler.__iter__)
            return next_index(iterator)

    dataloader.DataLoader._get_iterator = in_process  # type: ignore[method-assign,assignment]
    dataloader._BaseDataLoaderIter._next_index = on_the_host  # type: ignore[method-assign]
    try:
        yield
    finally:
        dataloader.DataLoader._get_iterator = get_iterator  # type: ignore[method-assign]
        dataloader._BaseDataLoaderIter._next_index = next_index  # type: ignore[method-assign]


@contextlib.contextmanager
def pinning_on_the_host() -> Iterator[None]:
    """While open, a ``DataLoader``'s pinning returns its batch as it is (module docstring)."""
    from torch.utils.data._utils import pin_memory as pinning

    pin = pinning.pin_memory
    # _pin_memory_loop and _SingleProcessDataLoaderIter call the module's pin_memory(data,
    # device), which recurses into mappings and sequences: the batch unchanged is its result
    # for host tensors that are not pinned.
    pinning.pin_memory = lambda data, device=None: data
    try:
        yield
    finally:
        pinning.pin_memory = pin
