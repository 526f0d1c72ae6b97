"""Tests for oomkit.prediction.summary: what print(prediction) shows, and the empty-step verdict."""

from __future__ import annotations

import io

import pytest

import oomkit
from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.core.trace import TraceEvent
from oomkit.prediction import WorkloadSpec, predict_recording
from oomkit.prediction.summary import nothing_recorded, prediction_summary, verdict_line

torch = pytest.importorskip("torch")
from oomkit.prediction.tracing import TraceRecording  # noqa: E402

MiB = 2**20
GiB = 2**30
GPU = GpuSpec(name="test GPU", total_memory_bytes=GiB, context_overhead_bytes=100 * MiB)


def _alloc(ident, size, category, module=None):
    tags = [("category", category)] + ([("module", module)] if module is not None else [])
    return TraceEvent("alloc", ident, size, tags=tuple(tags))


def _blocks_recording():
    """Twelve identical blocks of 2 MiB activations, a 4 MiB head and a 1 MiB input.

    The input (<= 1 MiB) takes a 2 MiB small-pool segment; the 28 MiB of large requests take two
    20 MiB segments (CUDACachingAllocator.cpp get_allocation_size): 42 MiB reserved.
    """
    events = [_alloc(100, MiB, "input")]
    events += [_alloc(i, 2 * MiB, "activation", f"h.{i}.mlp") for i in range(12)]
    events += [_alloc(50, 4 * MiB, "activation", "lm_head")]
    return TraceRecording(events=tuple(events), step_starts=(1,), warnings=("a warning",))


SUMMARY = """\
blocks, batch 2 on test GPU (1.00 GiB total, 100.00 MiB outside PyTorch, allocator settings: default)
fits on test GPU: peak reserved 42.00 MiB of 924.00 MiB usable, 882.00 MiB headroom
at peak allocated (step 1): 29.00 MiB allocated, 42.00 MiB reserved
  activation   28.00 MiB
  input         1.00 MiB
largest modules at peak allocated:
  h.0-11.mlp (12 layers, 2.00 MiB each)   24.00 MiB
  lm_head                                  4.00 MiB
warning: a warning"""


def test_str_is_the_summary_and_repr_the_verdict():
    """print(prediction) gives the verdict and top lines (repeated layers merged), not a repr."""
    p = predict_recording(
        _blocks_recording(), target=Target.resolve(GPU), description="blocks, batch 2"
    )
    assert str(p) == SUMMARY
    assert str(p) == prediction_summary(p)
    assert repr(p) == f"<Prediction: {verdict_line(p)}>"
    assert len(repr(p)) < 200


def test_summary_counts_what_it_leaves_out():
    """With rows=1 the summary says how many rows, modules and bytes it left out."""
    p = predict_recording(
        _blocks_recording(), target=Target.resolve(GPU), description="blocks, batch 2"
    )
    lines = prediction_summary(p, rows=1).splitlines()
    assert "  (1 more row, 1.00 MiB)" in lines  # the input category
    assert "  (1 more row: 1 module, 4.00 MiB)" in lines  # lm_head


def test_a_step_that_allocated_nothing_is_not_a_fit():
    """A model left on the CPU allocates nothing on the traced device: the verdict says so."""
    p = predict_recording(TraceRecording(events=(), step_starts=(0,)), target=Target.resolve(GPU))
    assert nothing_recorded(p)
    assert verdict_line(p).startswith(
        "NOTHING PREDICTED for test GPU: the step allocated nothing on the traced device (peak "
        "allocated 0 B), so it ran somewhere else: a model or tensors left on the CPU"
    )
    assert "fits" not in str(p).splitlines()[1]
    out = io.StringIO()
    from rich.console import Console

    oomkit.render_prediction(p, Console(file=out, width=200, force_terminal=True))
    # The verdict is printed in bold red, not green.
    assert "\x1b[1;31mNOTHING PREDICTED" in out.getvalue()
    # JSON for scripts says the same: not a fit, and why.
    data = oomkit.prediction_to_json(p)
    assert data["fits"] is False and data["nothing_recorded"] is True
    assert oomkit.prediction_to_json(predict_recording(_blocks_recording(), target=Target.resolve(GPU)))["fits"] is True


def test_precision_named_with_its_source_in_the_verdict():
    """A precision taken from a model config is named, with where it came from."""
    workload = WorkloadSpec("hf", "llama", precision="bf16",
                            precision_source="from the config's torch_dtype")
    p = predict_recording(_blocks_recording(), target=Target.resolve(GPU), workload=workload)
    assert verdict_line(p).startswith(
        "fits on test GPU (bf16, from the config's torch_dtype): peak reserved 42.00 MiB"
    )
    given = predict_recording(_blocks_recording(), target=Target.resolve(GPU), workload=WorkloadSpec("hf", "x",
                                                                             precision="bf16"))
    assert verdict_line(given).startswith("fits on test GPU: peak reserved")


def test_renderers_are_public():
    """The facade exports the renderers, and each works on a prediction."""
    for name in ("render_prediction", "prediction_to_json", "prediction_summary", "verdict_line"):
        assert name in oomkit.__all__
    p = predict_recording(_blocks_recording(), target=Target.resolve(GPU))
    data = oomkit.prediction_to_json(p)
    assert data["verdict"] == oomkit.verdict_line(p)
    assert data["peak_allocated_at"]["modules"][:2] == [
        {"module": "lm_head", "bytes": 4 * MiB},
        {"module": "h.0.mlp", "bytes": 2 * MiB},
    ]
    assert len(data["peak_allocated_at"]["modules"]) == 13


def test_a_model_left_on_the_cpu_is_refused_before_the_step_runs():
    """oomkit.predict with a CPU nn.Module (in args, track or a dict) raises, naming the fix."""
    from oomkit.errors import UserCodeError

    ran = []
    model = torch.nn.Linear(4, 4)  # on the CPU: a mistake

    def step(model):
        ran.append(True)
        model(torch.ones(2, 4)).sum().backward()

    with pytest.raises(UserCodeError, match="a Linear passed to oomkit.predict .or tracked by a builder. has its parameters on"):
        oomkit.predict(step, model, gpu="rtx4090")
    with pytest.raises(UserCodeError, match="Build it on the meta device"):
        oomkit.predict(lambda: None, track=[{"model": model}], gpu="rtx4090")
    assert ran == []
    # A host batch that the step moves to the device is not a mistake.
    with torch.device("meta"):
        meta_model = torch.nn.Linear(4, 4)
    host_batch = torch.ones(2, 4)
    p = oomkit.predict(lambda m, x: m(x.to("meta")).sum().backward(), meta_model, host_batch,
                       gpu="rtx4090", steps=1)
    assert p.peak_allocated_bytes > 0


def test_cli_exits_2_on_a_step_that_allocated_nothing(tmp_path, capsys):
    """`oomkit predict file.py:function` whose step runs on the CPU is not a fit: exit 2."""
    from oomkit.interfaces.cli import main

    (tmp_path / "cpu.py").write_text(
        "import torch\n\n"
        "def build():\n"
        "    return lambda: torch.ones(64, device='cpu') * 2\n"
    )
    code = main(["predict", f"{tmp_path / 'cpu.py'}:build", "--gpu", "rtx4090", "--steps", "1"])
    captured = capsys.readouterr()
    assert code == 2
    assert "NOTHING PREDICTED" in captured.out + captured.err or "nothing" in captured.err


def test_terminal_module_table_merges_layers_and_counts_rows_left_out():
    """The report's module table: one row for h.0-11, numeric order, a row for the rest."""
    from rich.console import Console

    events = [_alloc(i, 2 * MiB, "activation", f"h.{i}.mlp") for i in range(12)]
    # Eleven distinct modules of decreasing size: ten rows fit, so one is left out.
    events += [_alloc(100 + k, (11 - k) * 512 * 1024, "activation", f"head{k}") for k in range(11)]
    p = predict_recording(
        TraceRecording(events=tuple(events), step_starts=(0,)), target=Target.resolve(GPU)
    )
    out = io.StringIO()
    oomkit.render_prediction(p, Console(file=out, width=120, no_color=True))
    text = out.getvalue()
    rows = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│ h")]
    assert rows[0] == "h.0-11.mlp (12 layers, 2.00 MiB each)"
    assert "│ (2 more rows: 2 modules left out)" in text
    assert "h.10.mlp " not in text and "h.2.mlp " not in text
