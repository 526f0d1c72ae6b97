"""Model and training-loop remedies: estimated from memory by category, measured by re-predicting."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cases.oom_cases import GPU_8G, GiB, MiB, Recorder
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.gpus import GpuSpec
from oomkit.core.snapshot import load_snapshot
from oomkit.core.target import Target
from oomkit.diagnose._model_remedies import (
    MEASURED_WHY,
    estimated_model_remedies,
    measured_model_remedies,
)
from oomkit.diagnose.prediction_diagnosis import diagnose_prediction
from oomkit.diagnose.snapshot_diagnosis import diagnose_snapshot

FULL = {
    "activation": 4 * GiB,
    "parameter": GiB,
    "gradient": GiB,
    "optimizer_state": 2 * GiB,
    "temporary": 512 * MiB,
}


def _by_title(remedies):
    return {r.title: r for r in remedies}


def test_fp32_adamw_training_prices_each_change_from_its_category():
    """Mixed precision halves activations, checkpointing saves 3/4, SGD half the state, ..."""
    got = {r.title: r.saving_bytes for r in estimated_model_remedies(FULL, precision="fp32")}
    assert got == {
        "bf16 mixed precision (autocast)": 2 * GiB,
        "activation checkpointing": 3 * GiB,
        "SGD with momentum instead of Adam (one optimizer state, not two)": GiB,
        "fused (or non-foreach) optimizer step": 512 * MiB,
        "zero_grad(set_to_none=True)": GiB,
        "freeze pretrained layers (transfer learning)": 3 * GiB // 2,
    }
    assert all(r.estimate for r in estimated_model_remedies(FULL))


@pytest.mark.parametrize(
    ("capability", "title", "needles"),
    [
        ((7, 5), "fp16 mixed precision (autocast + GradScaler)", ("float16", "GradScaler()")),
        ((7, 0), "fp16 mixed precision (autocast + GradScaler)", ("float16", "GradScaler()")),
        ((8, 0), "bf16 mixed precision (autocast)", ("bfloat16",)),
        ((9, 0), "bf16 mixed precision (autocast)", ("bfloat16",)),
    ],
)
def test_mixed_precision_remedy_is_fp16_on_gpus_without_native_bf16(capability, title, needles):
    """T4 (7.5) and V100 (7.0) get fp16 + GradScaler; A100/H100 get bf16; same 2 GiB saving."""
    got = _by_title(estimated_model_remedies(FULL, precision="fp32", compute_capability=capability))
    assert got[title].saving_bytes == 2 * GiB
    assert all(needle in got[title].code for needle in needles)
    other = {"bf16 mixed precision (autocast)", "fp16 mixed precision (autocast + GradScaler)"}
    assert not (other - {title}) & set(got)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"precision": "bf16-mixed"},
        {"description": "GPT-2 124M, batch 8, seq 1024, fp16-mixed, adamw, train"},
        {"precision": None},  # with an autocast cache in the categories (below)
    ],
)
def test_no_mixed_precision_remedy_when_the_run_already_uses_it(kwargs):
    """A bf16/fp16 run or an autocast cache in the trace: mixed precision is not offered."""
    cats = dict(FULL)
    if kwargs == {"precision": None}:
        cats["autocast_cache"] = 64 * MiB
    titles = _by_title(estimated_model_remedies(cats, **kwargs))
    assert "bf16 mixed precision (autocast)" not in titles
    assert titles["activation checkpointing"].saving_bytes == 3 * GiB


def test_options_already_applied_are_not_offered():
    """SGD, checkpointing on, or the optimizer read from the description: those are left out."""
    titles = _by_title(estimated_model_remedies(FULL, optimizer="sgd", checkpointing=True))
    assert "activation checkpointing" not in titles
    assert not any(t.startswith("SGD") for t in titles)
    described = _by_title(
        estimated_model_remedies(FULL, description="x, batch 2, fp32, sgd, train")
    )
    assert not any(t.startswith("SGD") for t in described)
    assert "activation checkpointing" in described


def test_inference_gets_no_training_remedies():
    """Without training only mixed precision applies: no optimizer, gradient or freezing advice."""
    got = estimated_model_remedies({"activation": GiB, "parameter": GiB}, training=False)
    assert [(r.title, r.saving_bytes) for r in got] == [
        ("bf16 mixed precision (autocast)", GiB // 2)
    ]


def test_dataset_on_the_gpu_is_offered_only_for_a_large_input_share():
    """Inputs at a quarter or more of allocated memory: load batch by batch, saving them all."""
    big = _by_title(estimated_model_remedies({"input": 3 * GiB, "parameter": 3 * GiB}))
    remedy = big["keep the dataset on the CPU; move one batch at a time"]
    assert remedy.saving_bytes == 3 * GiB
    assert "DataLoader" in remedy.code
    small = _by_title(estimated_model_remedies({"input": GiB, "parameter": 4 * GiB}))
    assert "keep the dataset on the CPU; move one batch at a time" not in small


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["activation", "parameter", "gradient", "optimizer_state", "temporary", "input"]
        ),
        st.integers(0, 2**40),
    )
)
def test_estimates_never_exceed_what_was_allocated(cats):
    """Every estimate is marked as one and saves between 0 and the bytes allocated."""
    total = sum(cats.values())
    for remedy in estimated_model_remedies(cats):
        assert remedy.estimate
        assert 0 <= remedy.saving_bytes <= total


def test_snapshot_with_a_second_oom_after_a_caught_one_offers_releasing_references(tmp_path):
    """The failed step's 2 GiB still live at the retry's OOM: release references, saving 2 GiB."""
    rec = Recorder()
    rec.alloc(2 * GiB, line=3)  # parameters
    rec.alloc(GiB, line=10)
    rec.alloc(GiB, line=11)
    assert rec.alloc(4 * GiB, line=12) is None  # caught; the handler retries, holding the above
    rec.alloc(GiB, line=10)
    assert rec.alloc(3 * GiB, line=12) is None
    diagnosis = diagnose_snapshot(load_snapshot(rec.write(tmp_path / "s.pickle")), gpu=GPU_8G)
    remedy = _by_title(diagnosis.remedies)["release references after a caught OOM"]
    assert remedy.saving_bytes == 2 * GiB
    assert "except torch.OutOfMemoryError" in remedy.code


def test_snapshot_with_one_oom_does_not_offer_releasing_references(tmp_path):
    """One OOM: nothing was caught and retried, so the remedy is not offered."""
    rec = Recorder()
    for _ in range(7):
        rec.alloc(GiB)
    assert rec.alloc(GiB) is None
    diagnosis = diagnose_snapshot(load_snapshot(rec.write(tmp_path / "s.pickle")), gpu=GPU_8G)
    assert "release references after a caught OOM" not in _by_title(diagnosis.remedies)


# --- measured by re-predicting a small preset ------------------------------------------------

OPTIONS = {"batch_size": 8, "seq_len": 256}


@pytest.fixture(scope="module")
def saved():
    """`oomkit predict gpt2-124m --batch 8 --seq 256 --gpu 3GiB --steps 2 --json`, as JSON."""
    pytest.importorskip("torch")
    from oomkit.interfaces.reports.prediction import prediction_to_json
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.predictor import predict

    options = StepOptions(**OPTIONS)
    built = build_preset_step("gpt2-124m", options)
    p = predict(
        built.step_fn, target=Target.resolve("3GiB"), steps=2, track=built.track, description=built.description
    )
    # As the CLI saves it: the options as built (precision resolved to the preset's fp32).
    spec = {"preset": "gpt2-124m", "options": dataclasses.asdict(built.options), "steps": 2}
    return json.loads(json.dumps(prediction_to_json(p, spec)))


@pytest.fixture(scope="module")
def measured(saved):
    """``measured_model_remedies(saved)``: every change re-predicted, once for this module.

    Its ``--fsdp`` search is given the largest mesh alone (``FSDP_SIZES[-1]``, 64 ranks): on
    3 GiB rank 0 does not fit even there (NCCL's 640 MiB on each rank), and rank 0's need only
    grows on fewer ranks (the rule ``_measured_fsdp`` rests on), so the search over every size,
    which records the largest mesh first, answers no mesh too after this same one recording.
    The bisection itself is test_the_fsdp_remedy_is_the_smallest_mesh_whose_rank_0_fits's
    subject."""
    from oomkit.diagnose import remedy_measurement

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(remedy_measurement, "FSDP_SIZES", remedy_measurement.FSDP_SIZES[-1:])
        assert remedy_measurement.FSDP_SIZES == (64,)
        return measured_model_remedies(saved)


@pytest.fixture
def measured_once(measured, saved, monkeypatch):
    """The diagnosis and ``explain`` use this module's one measurement of ``saved`` (the same
    function's real result, not a stand-in), so each test re-predicts nothing; the calls they
    make are counted."""
    from oomkit.diagnose import prediction_diagnosis

    calls = []

    def again(data, progress=None):
        assert data == saved
        calls.append(data)
        return measured

    monkeypatch.setattr(prediction_diagnosis, "measured_model_remedies", again)
    return calls


def _repredicted_required(gpu="3GiB", **change):
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.predictor import predict

    built = build_preset_step("gpt2-124m", StepOptions(**(OPTIONS | change)))
    return predict(built.step_fn, target=Target.resolve(gpu), steps=2, track=built.track).required_bytes


def test_saved_prediction_carries_the_workload(saved):
    """`predict --json` of a preset saves the preset, its StepOptions and the step count."""
    assert saved["workload"]["preset"] == "gpt2-124m"
    assert saved["workload"]["options"]["batch_size"] == 8
    assert saved["workload"]["options"]["precision"] == "fp32"
    assert saved["workload"]["steps"] == 2
    assert saved["oom"] is not None


def test_measured_remedies_are_the_re_predicted_drop_in_required_memory(saved, measured):
    """Each change's saving is required bytes before minus after re-predicting it (high, exact)."""
    remedies = _by_title(measured[0])
    assert set(remedies) == {
        "bf16 mixed precision (autocast)",
        "activation checkpointing",
        "SGD with momentum instead of Adam (one optimizer state, not two)",
        # batch 2 fits alone but not with the gradients kept between micro-batches
        "batch size 1 with 8 gradient-accumulation steps",
        # the fine-tuning remedies (diagnose/_finetune_remedies.py) apply to GPT-2 too
        "LoRA adapters (peft, r8) instead of full fine-tuning",
        "QLoRA: 4-bit nf4 base weights + LoRA adapters (peft, r8)",
        "8-bit AdamW (bitsandbytes AdamW8bit)",
        # pure bf16 (the GPU has native bf16)
        "pure bf16 weights, gradients and optimizer states",
        # no FSDP mesh: on 3 GiB, NCCL's 640 MiB on each rank (core/gpus/nccl.py) leaves too
        # little even at 64 ranks (test_the_fsdp_remedy_is_the_smallest_mesh_whose_rank_0_fits)
    }
    for remedy in remedies.values():
        assert (remedy.confidence, remedy.estimate) == ("high", False)
        assert MEASURED_WHY in remedy.why
    required = saved["required_bytes"]
    assert remedies["activation checkpointing"].saving_bytes == required - _repredicted_required(
        checkpointing=True
    )
    # Recorded with its accumulation (two micro-batches: the later ones repeat the second's).
    assert remedies[
        "batch size 1 with 8 gradient-accumulation steps"
    ].saving_bytes == required - _repredicted_required(batch_size=1, grad_accum=2)
    assert _repredicted_required(batch_size=1, grad_accum=2) == _repredicted_required(
        batch_size=1, grad_accum=8
    )
    assert _repredicted_required(batch_size=2, grad_accum=2) > Target.resolve("3GiB").usable_bytes


def test_the_fsdp_remedy_is_the_smallest_mesh_whose_rank_0_fits():
    """A step whose optimizer state outweighs its activations (batch 1, seq 64) on 2.45 GiB: the
    FSDP search tries the largest mesh (64) first, then bisects to 32 ranks (rank 0 of 16 does
    not fit, of 32 does), with NCCL's fixed costs and buffers taken from each rank's usable
    memory; the saving is the re-predicted drop."""
    from oomkit.core.gpus.nccl import COMMUNICATOR_FIXED_BYTES, PROCESS_FIXED_BYTES
    from oomkit.diagnose.remedy_measurement import FSDP_SIZES, _measured_fsdp, repredict
    from oomkit.prediction.models import StepOptions, build_preset_step
    from oomkit.prediction.workload import WorkloadSpec

    workload = WorkloadSpec(kind="preset", name="gpt2-124m", batch_size=1, seq_len=64, steps=2)
    options = build_preset_step("gpt2-124m", StepOptions(batch_size=1, seq_len=64)).options
    target = Target.resolve("2.45GiB")
    tried = {}

    def again(opts, layout):
        chosen = target if layout is None else dataclasses.replace(target, parallel=layout)
        tried[None if layout is None else layout.fsdp] = p = repredict(workload, chosen, opts)
        return p

    one = again(options, None)
    remedy = _measured_fsdp(options, again, FSDP_SIZES, one.required_bytes, one.usable_bytes)
    assert remedy is not None and remedy.title == "shard with FSDP across 32 GPUs"
    assert [k for k in tried if k is not None] == [64, 8, 16, 32]
    assert not tried[16].fits and tried[32].fits
    assert remedy.saving_bytes == one.required_bytes - tried[32].required_bytes
    # each rank holds NCCL's fixed costs, ring (384 MiB) and NVLS (256 MiB) buffers beside the
    # CUDA context
    nccl = PROCESS_FIXED_BYTES + COMMUNICATOR_FIXED_BYTES + 640 * MiB
    assert tried[32].usable_bytes == target.gpu.total_memory_bytes - target.context_overhead_bytes - nccl


def test_an_fsdp_search_whose_largest_mesh_does_not_fit_records_only_it():
    """Activations FSDP does not shard: where rank 0 of the largest mesh does not fit, no mesh
    does, and the search stops after that one recording (it had bisected through three)."""
    from oomkit.diagnose.remedy_measurement import FSDP_SIZES, _measured_fsdp

    tried = []

    def again(opts, layout):
        tried.append(layout.fsdp)
        return dataclasses.make_dataclass("P", ["fits", "required_bytes"])(False, 10)

    assert _measured_fsdp(object(), again, FSDP_SIZES, 20, 5) is None
    assert tried == [64]
    assert _measured_fsdp(object(), again, (), 20, 5) is None and tried == [64]


def test_measured_mixed_precision_on_a_t4_is_fp16_re_predicted(saved, monkeypatch):
    """A saved prediction for a 7.5 GPU re-predicts fp16-mixed, not bf16 (which a T4 emulates)."""
    # The FSDP search is not this test's subject (test_the_fsdp_remedy_is_the_smallest_mesh...):
    # no mesh is tried, which saves its rank recordings.
    monkeypatch.setattr("oomkit.diagnose.remedy_measurement.FSDP_SIZES", ())
    # Nor are the changes that leave the precision as it is (checkpointing, SGD, LoRA, QLoRA,
    # 8-bit AdamW: test_measured_remedies_are_the_re_predicted_drop_in_required_memory) or
    # the batch halvings: of the changes the T4 gets (remedy_measurement.step_changes, unchanged),
    # only those that set the precision are re-predicted.
    from oomkit.diagnose import remedy_measurement

    every_change = remedy_measurement.step_changes

    def precision_changes(base, compute_capability):
        return [c for c in every_change(base, compute_capability) if "precision" in c.fields]

    monkeypatch.setattr(remedy_measurement, "step_changes", precision_changes)
    monkeypatch.setattr("oomkit.diagnose._batch_remedies._MAX_HALVINGS", 0)
    on_t4 = json.loads(json.dumps(saved))
    on_t4["gpu"]["compute_capability"] = [7, 5]
    remedies = _by_title(measured_model_remedies(on_t4)[0])
    assert "bf16 mixed precision (autocast)" not in remedies
    fp16 = remedies["fp16 mixed precision (autocast + GradScaler)"]
    # Re-predicted with the saved GPU's compute capability: a T4's kernels, not an H100's.
    t4_sized = GpuSpec(
        saved["gpu"]["name"],
        saved["capacity_bytes"],
        saved["context_overhead_bytes"],
        compute_capability=(7, 5),
    )
    assert fp16.saving_bytes == saved["required_bytes"] - _repredicted_required(
        t4_sized, precision="fp16-mixed"
    )
    assert fp16.saving_bytes != saved["required_bytes"] - _repredicted_required(
        precision="fp16-mixed"
    )


def test_diagnosis_ranks_the_measured_batch_first_and_skips_measuring_on_request(
    saved, measured_once
):
    """Measured: the batch remedy leads; measure=False keeps estimates only (no re-prediction)."""
    measured = diagnose_prediction(saved)
    assert len(measured_once) == 1
    assert measured.cause == "shortage"
    top = measured.remedies[0]
    # The remedies that make the step fit come first, by saving: pure bf16 saves the most.
    assert top.title == "pure bf16 weights, gradients and optimizer states"
    assert not top.estimate and top.fits is True
    assert top.peak_reserved_bytes == saved["required_bytes"] - top.saving_bytes
    fitting = [r for r in measured.remedies if getattr(r, "fits", None) is True]
    assert measured.remedies[: len(fitting)] == tuple(fitting)
    assert "batch size 1 with 8 gradient-accumulation steps" in {r.title for r in fitting}
    # the preset sets zero_grad(set_to_none=True) already: never offered
    assert "zero_grad(set_to_none=True)" not in {r.title for r in measured.remedies}
    # a measured figure replaces the estimate of the same change: one of each title
    titles = [r.title for r in measured.remedies]
    assert len(titles) == len(set(titles))
    estimated = diagnose_prediction(saved, measure=False)
    assert len(measured_once) == 1  # not measured again
    model = [r for r in estimated.remedies if r.title != "do not rely on torch.cuda.empty_cache()"]
    assert all(r.estimate for r in model)
    assert _by_title(estimated.remedies)["activation checkpointing"].confidence == "low"


def test_unknown_workload_is_not_measured():
    """Without a rebuildable workload (a user function, an old save) nothing is re-predicted."""
    assert measured_model_remedies({"required_bytes": 1, "usable_bytes": 0}) == ([], [])


def test_explain_cli_measures_by_default_and_not_with_no_measure(
    saved, measured_once, tmp_path, capsys
):
    """`oomkit explain p.json` re-predicts (measured top remedy); --no-measure only estimates."""
    from oomkit.interfaces.cli import main

    path = tmp_path / "p.json"
    path.write_text(json.dumps(saved))
    assert main(["explain", str(path), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["remedies"][0]
    assert measured["title"] == "pure bf16 weights, gradients and optimizer states"
    assert measured["estimate"] is False
    assert (measured["fits"], measured["flag"]) == (True, "--precision bf16")
    assert measured["peak_reserved_bytes"] == saved["required_bytes"] - measured["saving_bytes"]
    assert len(measured_once) == 1
    assert main(["explain", str(path), "--json", "--no-measure"]) == 0
    assert len(measured_once) == 1  # --no-measure re-predicts nothing
    remedies = json.loads(capsys.readouterr().out)["remedies"]
    assert not any(MEASURED_WHY in r["why"] for r in remedies)
    assert all(r["fits"] is None and r["peak_reserved_bytes"] is None for r in remedies)
    assert remedies[0]["estimate"] is True
