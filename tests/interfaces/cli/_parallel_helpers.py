"""What the multi-GPU CLI tests share: a tiny Llama for the parallel builders, the JSON a
command prints, and ``file.py:function`` steps that shard (FSDP2) or wrap (DDP) their model."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from oomkit.interfaces.cli import main

# Tiny Llama: hidden 64, 4 heads (2 KV heads of 16), FFN 128, vocabulary 256, 2 blocks, untied.
HIDDEN, KV, FFN, VOCAB, LAYERS = 64, 32, 128, 256, 2
# Every weight but the five RMSNorm weights (2 per block + the final one), in elements.
MATRIX_NUMEL = 2 * VOCAB * HIDDEN + LAYERS * (2 * HIDDEN * HIDDEN + 2 * KV * HIDDEN + 3 * HIDDEN * FFN)


def use_tiny_llama(monkeypatch: Any) -> None:
    """The FSDP2, TP and DDP preset builders get the tiny Llama for any preset name."""
    from oomkit.prediction.models import data_parallel, parallel, tensor_parallel
    from oomkit.prediction.models.llama import LlamaShape
    from oomkit.prediction.models.presets import ModelPreset

    shape = LlamaShape(
        hidden=HIDDEN, intermediate=FFN, layers=LAYERS, heads=4, kv_heads=2, vocab=VOCAB,
        tied=False, positions=128,
    )
    preset = ModelPreset("llama3-8b", "Tiny Llama", shape, 16, "test", "bf16-mixed")
    for module in (parallel, tensor_parallel, data_parallel):
        monkeypatch.setattr(module, "shaped_preset", lambda name, options: preset)


def cli_json(argv: list[str]) -> tuple[int, dict]:
    """The exit code of ``oomkit ARGV`` and the JSON it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, json.loads(out.getvalue())


def write_step(tmp_path: Path, name: str, source: str) -> Path:
    """``source`` saved as ``tmp_path/name.py``, the file of a ``file.py:function`` target."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return path


def load_step_module(path: Path) -> ModuleType:
    """The module at ``path``, imported as the CLI imports a ``file.py:function`` target."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_user_step(
    path: Path, *, ranks: int, mesh_shape: Any = None, steps: int = 3, **build_kwargs: Any
) -> Any:
    """Rank 0's recording of ``path``'s ``build(mesh, **build_kwargs)`` through the API
    (``trace_distributed_step``), with ``cpu``, the fake mesh's device, as default device."""
    import torch

    from oomkit.prediction.tracing.distributed import trace_distributed_step

    module = load_step_module(path)

    def build(mesh: Any) -> Any:
        with torch.device("cpu"):
            return module.build(mesh, **build_kwargs)

    return trace_distributed_step(build, world_size=ranks, mesh_shape=mesh_shape, steps=steps)


def api_prediction(data: dict, recording: Any) -> Any:
    """``predict_recording`` of ``recording`` on the H100 and torch a CLI's JSON ``data`` names."""
    from oomkit.core.target import Target
    from oomkit.prediction.predictor import predict_recording

    target = Target.resolve("h100", torch_version=data["target"]["torch_version"])
    return predict_recording(recording, target=target)


# What both steps below end with: AdamW over the model, a batch of 64-wide rows, the step;
# and a plain model that neither shards nor wraps (the refused case).
_TRAIN_AND_PLAIN = """
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(batch_size, 64)
    assert world_size == mesh.size()

    def step():
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, (model, optimizer, batch)


def plain(batch_size=4):
    model = torch.nn.Linear(64, 8)
    return (lambda: model(torch.randn(batch_size, 64)).sum()), (model,)
"""

# build(mesh, world_size, batch_size): two 64x64 bias-free Linears, fully_shard per layer + root.
FSDP_STEP = """
import torch
from torch.distributed.fsdp import fully_shard


def build(mesh, world_size, batch_size=4):
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 64, bias=False)
    )
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)""" + _TRAIN_AND_PLAIN

# build(mesh, world_size, batch_size): a 64-256-8 MLP the function wraps in DDP itself.
DDP_STEP = """
import torch
from torch.nn.parallel import DistributedDataParallel


def build(mesh, world_size, batch_size=4):
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    model = DistributedDataParallel(model, bucket_cap_mb=1)""" + _TRAIN_AND_PLAIN
