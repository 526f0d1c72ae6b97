"""Golden tests: the terminal reports of predict and explain at 100 columns, without colour."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parents[2] / "diagnose"))
from cases.oom_cases import fragmented_oom_message  # noqa: E402

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace import Frame, TraceEvent
from oomkit.diagnose.diagnosis import diagnose_oom_text
from oomkit.diagnose.oom_text import parse_oom_text
from oomkit.interfaces.reports.diagnosis import render_diagnosis

MiB = 2**20
GiB = 2**30


def _render(render, record) -> str:
    console = Console(width=100, no_color=True, force_terminal=False, record=True, file=io.StringIO())
    render(record, console)
    return "\n".join(line.rstrip() for line in console.export_text().splitlines()) + "\n"


def _alloc(ident, size, category, module, op=None, frames=()):
    tags = [("category", category), ("phase", "forward"), ("module", module)]
    if op is not None:
        tags.append(("op", op))
    return TraceEvent("alloc", ident, size, frames=frames, tags=tuple(tags))


PREDICTION_GOLDEN = """\
a test workload on test GPU (1.00 GiB total, 100.00 MiB outside PyTorch, allocator settings:
default)
      Memory at peak allocated (step 1)
┏━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━┓
┃ category              ┃     bytes ┃      % ┃
┡━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━┩
│ temporary             │ 30.00 MiB │  55.6% │
│ activation            │  3.00 MiB │   5.6% │
│ parameter             │  1.00 KiB │   0.0% │
│ cached, not allocated │ 21.00 MiB │  38.9% │
│ reserved              │ 54.00 MiB │ 100.0% │
└───────────────────────┴───────────┴────────┘
      Top modules at peak allocated
┏━━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━━━━━━━━━┓
┃ module    ┃     bytes ┃ % of allocated ┃
┡━━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━━━━━━━━━┩
│ encoder.1 │ 30.00 MiB │          90.9% │
│ encoder.0 │  3.00 MiB │           9.1% │
└───────────┴───────────┴────────────────┘
             Peaks per step
┏━━━━━━┳━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━┓
┃ step ┃ peak allocated ┃ peak reserved ┃
┡━━━━━━╇━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━┩
│    1 │      33.00 MiB │     54.00 MiB │
│    2 │      33.00 MiB │     54.00 MiB │
└──────┴────────────────┴───────────────┘
warning: an example warning
fits on test GPU: peak reserved 54.00 MiB of 924.00 MiB usable, 870.00 MiB headroom
"""


def test_prediction_report_golden():
    """Header, category and module tables at the peak, peaks per step, verdict, warnings."""
    pytest.importorskip("torch")
    from oomkit.interfaces.reports.prediction import render_prediction
    from oomkit.prediction import predict_recording
    from oomkit.prediction.tracing import TraceRecording

    gelu = Frame("train.py", 12, "step")
    events = (
        _alloc(1, 1000, "parameter", "encoder.0"),
        _alloc(2, 3 * MiB, "activation", "encoder.0", "aten.mm.default"),
        _alloc(3, 30 * MiB + 1, "temporary", "encoder.1", "aten.gelu.default", (gelu,)),
        TraceEvent("free_requested", 3, 30 * MiB + 1),
        TraceEvent("free_completed", 3, 30 * MiB + 1),
        _alloc(4, 5 * MiB, "activation", "encoder.1", "aten.mm.default"),
    )
    recording = TraceRecording(events=events, warnings=("an example warning",), step_starts=(0, 3))
    gpu = GpuSpec(name="test GPU", total_memory_bytes=GiB, context_overhead_bytes=100 * MiB)
    prediction = predict_recording(
        recording, target=Target.resolve(gpu), description="a test workload"
    )
    assert _render(render_prediction, prediction) == PREDICTION_GOLDEN


DIAGNOSIS_GOLDEN = """\
Cause: fragmentation of PyTorch's cache — 2.90 GiB was reserved but unallocated, more than the 2.00
GiB requested, yet no cached block was large enough: the cache is fragmented.
Remedies: what lowers the peak first, then by bytes saved
1. expandable segments — saves ~2.90 GiB (medium confidence)
   Segments that grow in place let the cached-but-unallocated memory serve one large request. Replay
a snapshot (`oomkit tune`) to measure it exactly.
     # before CUDA initialises (read once, at the first CUDA allocation):
     PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python train.py
     # or at run time, in the script:
     torch.cuda.memory._set_allocator_settings("expandable_segments:True")
2. do not rely on torch.cuda.empty_cache() — saves nothing (high confidence)
   The 2.90 GiB cached but unallocated sits in segments that also hold live tensors; empty_cache()
cannot return it and would not have prevented this OOM.
     # PyTorch already released every unused cached segment and retried before raising
Allocated (4.10 GiB, torch.cuda.memory_allocated) is what live tensors use. Reserved (7.00 GiB,
torch.cuda.memory_reserved) is what PyTorch's caching allocator holds from the driver: the allocated
memory plus 2.90 GiB cached for reuse. nvidia-smi shows about 7.39 GiB used: the reserved memory
plus 400.00 MiB outside the allocator (the CUDA context and libraries such as cuBLAS and NCCL,
~400.00 MiB (256.00 MiB-1.17 GiB) on a typical GPU, lazy module loading, and any other process).
"""


def test_fragmentation_diagnosis_report_golden():
    """Verdict with its evidence, remedies with code, and the allocated/reserved paragraph."""
    message = fragmented_oom_message()
    diagnosis = diagnose_oom_text(parse_oom_text(f"torch.OutOfMemoryError: {message}"))
    assert _render(render_diagnosis, diagnosis) == DIAGNOSIS_GOLDEN


def test_kernels_line_names_what_the_recording_assumed():
    """One line under the header: the compute capability and each kernel choice with its calls."""
    pytest.importorskip("torch")
    import dataclasses

    from oomkit.core.gpus import get_gpu
    from oomkit.interfaces.reports.prediction import kernels_line
    from oomkit.prediction import predict_recording
    from oomkit.prediction.tracing import TraceRecording

    recording = TraceRecording(
        events=(_alloc(1, 1000, "parameter", "encoder.0"),),
        kernel_choices={"SDPA flash_attention": 24, "SDPA math": 1},
    )
    prediction = predict_recording(recording, target=Target.resolve(get_gpu("rtx4090")))
    assert kernels_line(prediction) == (
        "kernels as on compute capability 8.9: SDPA flash_attention (24 calls); SDPA math (1 call)"
    )
    custom = dataclasses.replace(prediction, gpu=get_gpu("24GiB"))
    assert kernels_line(custom).startswith("kernels as on compute capability 9.0: ")
    on_h100 = dataclasses.replace(
        prediction,
        gpu=get_gpu("h100"),
        kernel_choices={"SDPA cudnn_attention": 24},
        assumptions={"cuDNN": "9.20.0 (torch 2.13's default Linux wheel)"},
    )
    assert kernels_line(on_h100) == (
        "kernels as on compute capability 9.0, cuDNN 9.20.0 (torch 2.13's default Linux wheel): "
        "SDPA cudnn_attention (24 calls)"
    )
