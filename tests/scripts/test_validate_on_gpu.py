"""Tests for the pure parts of scripts/validate_on_gpu.py (comparison, summary, file names)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "validate_on_gpu.py"
_spec = importlib.util.spec_from_file_location("validate_on_gpu", _PATH)
validate = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("validate_on_gpu", validate)  # dataclasses look their module up
_spec.loader.exec_module(validate)

MiB = 2**20


def _run(label, measured_reserved, predicted_reserved, verify=None):
    return validate.compare_run(
        label,
        {"peak_allocated_bytes": 100 * MiB, "peak_reserved_bytes": measured_reserved},
        {"peak_allocated_bytes": 90 * MiB, "peak_reserved_bytes": predicted_reserved},
        verify,
    )


def test_compare_run_signed_relative_errors():
    """Errors are (predicted - measured) / measured, signed."""
    r = _run("a", 200 * MiB, 210 * MiB)
    assert r["error_peak_reserved"] == pytest.approx(0.05)
    assert r["error_peak_allocated"] == pytest.approx(-0.10)
    assert r["verify"] is None and "verify_reproduced" not in r


def test_compare_run_verify_agreement():
    """A replay reproduces the run only if every segment event and the final state match."""
    ok = {"segment_events_recorded": 7, "segment_events_matched": 7,
          "final_state_matches": True, "allocs_misplaced": 0}
    assert _run("a", MiB, MiB, ok)["verify_reproduced"] is True
    assert _run("a", MiB, MiB, {**ok, "segment_events_matched": 6})["verify_reproduced"] is False
    assert _run("a", MiB, MiB, {**ok, "allocs_misplaced": 2})["verify_reproduced"] is False


def test_relative_error_of_nothing_measured_is_none():
    """A run that measured zero bytes has no relative error."""
    assert validate.relative_error(5, 0) is None


def test_summary_median_max_and_target():
    """The summary gives median and max |error| of peak reserved and checks 5% / 10%."""
    runs = [_run("a", 100 * MiB, 102 * MiB), _run("b", 100 * MiB, 96 * MiB),
            _run("c", 100 * MiB, 109 * MiB), {"run": "d", "error": "CUDA error"}]
    s = validate.summarize(runs)
    assert s["runs"] == 4 and s["runs_compared"] == 3
    assert s["peak_reserved_error"]["median"] == pytest.approx(0.04)
    assert s["peak_reserved_error"]["max"] == pytest.approx(0.09)
    assert s["peak_reserved_error"]["worst_run"] == "c"
    assert s["meets_target"] is True
    s = validate.summarize([*runs, _run("e", 100 * MiB, 120 * MiB)])
    assert s["meets_target"] is False


def test_as_measured_errors_and_their_summary():
    """The as-run prediction is kept beside the preset's, with its own errors and summary; a
    failed run (no as-run figures) is counted, not compared."""
    measured = {"peak_allocated_bytes": 100 * MiB, "peak_reserved_bytes": 200 * MiB}
    whole = {"peak_allocated_bytes": 101 * MiB, "peak_reserved_bytes": 196 * MiB,
             "warnings": ["w"], "fits": True}
    record = validate.add_as_measured(_run("a", 200 * MiB, 210 * MiB), whole, measured)
    assert record["predicted_as_measured"] == {
        "peak_allocated_bytes": 101 * MiB, "peak_reserved_bytes": 196 * MiB, "fits": True
    }
    assert record["error_peak_allocated_as_measured"] == pytest.approx(0.01)
    assert record["error_peak_reserved_as_measured"] == pytest.approx(-0.02)
    assert record["error_peak_reserved"] == pytest.approx(0.05)  # the preset's, unchanged
    s = validate.summarize_as_measured([record, {"run": "d", "error": "CUDA error"}])
    assert s["runs"] == 2 and s["runs_compared"] == 1
    assert s["peak_reserved_error"]["median"] == pytest.approx(0.02)
    assert s["peak_allocated_error"]["max"] == pytest.approx(0.01)


def test_summary_of_no_runs_does_not_meet_target():
    """With nothing compared there is no median and the target is not met."""
    s = validate.summarize([])
    assert s["peak_reserved_error"]["median"] is None and s["meets_target"] is False


def test_match_gpu_by_name_then_memory_then_size():
    """The device name finds the catalog entry; else its exact total memory; else a size."""
    from oomkit.core.gpus import get_gpu

    h100 = get_gpu("h100")
    assert validate.match_gpu("NVIDIA H100 80GB HBM3", 0).name == h100.name
    assert validate.match_gpu("Some OEM name", h100.total_memory_bytes).name == h100.name
    custom = validate.match_gpu("Mystery GPU", 12345 * MiB)
    assert custom.total_memory_bytes == 12345 * MiB


def test_output_path():
    """validation/<gpu>-torch<version>.json, with a safe name and no local version suffix."""
    path = validate.output_path(Path("/r"), "H100 SXM 80GB", "2.13.0+cu128")
    assert path == Path("/r/validation/h100-sxm-80gb-torch2.13.0.json")


def test_runs_have_distinct_labels():
    """Every run has its own label (the child process is chosen by it)."""
    labels = [r.label for r in validate.RUNS]
    assert len(labels) == len(set(labels))
    assert validate.RUNS[0].options() == {"batch_size": 4, "seq_len": 512, "precision": "fp32",
                                          "optimizer": "adamw", "mode": "train",
                                          "checkpointing": False}
    checkpointed = [r for r in validate.RUNS if r.checkpointing]
    assert [r.label for r in checkpointed] == ["llama-1b-b1-seq512-bf16-mixed-adamw-train-ckpt"]


def test_prediction_side_uses_the_devices_cudnn_for_the_sdpa_backend():
    """No GPU needed for the prediction half: cuDNN 9.15.1 on an H100 picks cuDNN attention."""
    pytest.importorskip("torch")
    from oomkit.core.gpus import get_gpu

    run = validate.Run("gpt2-124m", 1, seq_len=16, precision="bf16-mixed")
    h100 = get_gpu("h100-sxm")
    newer = validate._predict(run, 1, h100, 500 * 2**20, 91501)
    older = validate._predict(run, 1, h100, 500 * 2**20, 90100)
    assert "SDPA cudnn_attention" in newer["kernel_choices"]
    assert "SDPA cudnn_attention" not in older["kernel_choices"]
    assert "SDPA flash_attention" in older["kernel_choices"]
    assert older["peak_reserved_bytes"] > 0 and older["fits"] is True


def test_compiled_runs_are_labelled_and_pass_compile_to_step_options():
    """A compile run says so in its label and hands compile=True to StepOptions; eager ones don't."""
    from oomkit.prediction.models import StepOptions

    compiled = [r for r in validate.RUNS if r.compile]
    assert {r.preset for r in compiled} == {"gpt2-124m", "llama-1b"}
    for run in compiled:
        assert run.label.endswith("-compile")
        assert StepOptions(**run.options()).compile is True
    eager = validate.Run("gpt2-124m", 4, seq_len=512)
    assert "compile" not in eager.options() and not eager.label.endswith("-compile")


def test_repredicted_keeps_the_gpus_figures_and_predicts_again_here():
    """--repredict: no GPU; each saved run predicted again, compared with its measured peaks."""
    pytest.importorskip("torch")
    from oomkit.core.gpus import get_gpu

    run = validate.Run("gpt2-124m", 1, seq_len=16)
    measured = {"peak_allocated_bytes": 2_000_000_000, "peak_reserved_bytes": 2_100_000_000,
                "context_overhead_bytes": None}
    document = {
        "gpu": "H200", "torch_version": "2.11.0+cu130", "steps": 1,
        "runs": [
            {"run": run.label, "measured": measured, "cudnn_version": 91900, "verify": None},
            {"run": "a-run-this-checkout-lacks", "measured": measured},
            {"run": run.label + "-failed", "error": "RuntimeError: ..."},
        ],
    }
    out = validate.repredicted(document, {run.label: run})
    [record] = out["runs"]
    direct = validate._predict(run, 1, get_gpu("h200"), get_gpu("h200").context_overhead_bytes, 91900)
    assert record["measured"] == measured
    assert record["predicted"]["peak_reserved_bytes"] == direct["peak_reserved_bytes"]
    assert record["error_peak_reserved"] == (
        direct["peak_reserved_bytes"] - 2_100_000_000
    ) / 2_100_000_000
    assert out["measured_with_torch"] == "2.11.0+cu130"
    assert out["summary"]["runs_compared"] == 1


def test_a_clipping_run_is_labelled_and_passes_max_grad_norm_to_step_options():
    """The gradient-clipping run (foreach_norm.py's partials, not yet measured) says so in its
    label and clips at 1.0; the others do not clip."""
    from oomkit.prediction.models import StepOptions

    clipped = [r for r in validate.RUNS if r.max_grad_norm]
    assert [r.label for r in clipped] == ["gpt2-124m-b4-seq512-fp32-adamw-train-clip"]
    assert StepOptions(**clipped[0].options()).max_grad_norm == 1.0
    assert "max_grad_norm" not in validate.RUNS[0].options()
