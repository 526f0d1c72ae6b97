"""`oomkit fit PRESET --tp/--dp [--fsdp]`: rank 0's per-rank batch of every layout predict
predicts, checked against predict at the answer and one above, and what fit refuses."""

from __future__ import annotations

import pytest
from _parallel_helpers import DDP_STEP, FSDP_STEP, cli_json, use_tiny_llama, write_step

from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

# A GPU of a plain size with nothing outside PyTorch and no margin: fit's probe of a batch is
# then predict's prediction of it on the same GPU.
_ON = ["--seq", "16", "--steps", "1", "--context-overhead", "0"]
# fit's answer is predict's boundary when batches that fit only with allocator retries count
# (predict says they fit); by default fit answers the largest without retries.
_RETRIES = ["--set", "search.allow_retries=true"]
MiB = 2**20


def _fit(layout, gpu, start, stop):
    """fit's exit code and JSON searching batches start..stop."""
    return cli_json(
        ["fit", "llama3-8b", *layout, *_ON, *_RETRIES, "--gpu", gpu, "--margin", "0", "--batch", str(start),
         "--max-batch", str(stop), "--json"]
    )


@pytest.fixture(scope="module")
def tp_fit(tmp_path_factory):
    """``fit --tp 2`` on 67 MiB from 19 to 20 (the tiny Llama): the CLI answer that
    test_fit_tp_answer_is_predicts_boundary checks and test_api_searches_the_same_tp_batch
    compares the Python API with, searched once (with a recording cache of its own, as
    tests/conftest.py gives each test)."""
    with pytest.MonkeyPatch.context() as patch:
        use_tiny_llama(patch)
        patch.setenv("OOMKIT_CACHE_DIR", str(tmp_path_factory.mktemp("oomkit-cache")))
        return _fit(["--tp", "2"], "67MiB", 19, 20)


def _fit_and_predict_boundary(layout, gpu, start, stop, fitted=None):
    """fit's JSON searching batches start..stop (or ``fitted``, that search's answer already
    made), and predict's at the answer and answer + 1."""
    code, fit = fitted or _fit(layout, gpu, start, stop)
    assert code == 0
    answer = fit["batch_size"]
    # --no-remedies: the batch above the answer does not fit, and measuring its remedies
    # (re-predicting it with each) is not what is compared here.
    predicted = [
        cli_json(["predict", "llama3-8b", *layout, *_ON, "--gpu", gpu, "--batch", str(b),
                  "--no-remedies", "--json"])
        for b in (answer, answer + 1)
    ]
    return fit, predicted


def _assert_probes_are_predictions(fit, predicted):
    """The fit probes at the answer and one above are predict's predictions, to the byte."""
    (fits_code, at), (over_code, above) = predicted
    assert (fits_code, at["fits"]) == (0, True)
    assert (over_code, above["fits"]) == (1, False)
    curve = {p["batch_size"]: p for p in fit["curve"]}
    for batch, prediction in ((fit["batch_size"], at), (fit["batch_size"] + 1, above)):
        probe = curve[batch]
        assert probe["fits"] == prediction["fits"]
        assert probe["peak_reserved_bytes"] == prediction["required_bytes"]
        assert probe["peak_allocated_bytes"] == prediction["peak_allocated_bytes"]
    assert at["description"] == fit["description"]


def test_fit_tp_answer_is_predicts_boundary(tiny_llama, tp_fit):
    """--tp 2 on 67 MiB: batch 19 per rank fits in 66 MiB reserved, 20 needs 68 MiB; predict
    --tp 2 at 19 fits and at 20 does not, with the probes' peaks to the byte."""
    fit, predicted = _fit_and_predict_boundary(["--tp", "2"], "67MiB", 19, 20, fitted=tp_fit)
    assert (fit["batch_size"], fit["first_failing_batch"]) == (19, 20)
    assert fit["probe_order"] == [19, 20]
    assert fit["peak_reserved_bytes"] == 66 * MiB
    assert fit["curve"][-1]["peak_reserved_bytes"] == 68 * MiB
    assert fit["parallel"] == {
        "layout": "TP 2", "fsdp": 1, "tp": 2, "dp": 1, "world_size": 2, "rank": 0,
        "batch_is_per_rank": True, "data_parallel_ranks": 1, "global_batch_size": 19,
    }
    assert fit["verdict"].endswith(
        "; batch 19 is per rank (rank 0 of 2: TP 2); global batch 19 over 1 data-parallel rank"
    )
    assert fit["description"].endswith("tensor parallel over 2 ranks (torchtitan's Llama plan: "
                                       "sequence parallel, loss parallel), rank 0 of 2")
    assert any(w.startswith("tensor parallel: torchtitan's Llama plan") for w in fit["warnings"])
    _assert_probes_are_predictions(fit, predicted)


def test_fit_dp_answer_is_predicts_boundary(tiny_llama):
    """--dp 2 (DDP) on 69 MiB: batch 22 per rank fits, 23 does not, as predict --dp 2 says;
    the global batch is 44 over the 2 replicas."""
    fit, predicted = _fit_and_predict_boundary(["--dp", "2"], "69MiB", 21, 23)
    assert (fit["batch_size"], fit["first_failing_batch"]) == (22, 23)
    assert fit["probe_order"] == [21, 23, 22]
    assert fit["parallel"]["layout"] == "DDP 2"
    assert (fit["parallel"]["global_batch_size"], fit["parallel"]["data_parallel_ranks"]) == (44, 2)
    assert "DDP over 2 replicas (buckets 25 MiB (first 1 MiB)), rank 0" in fit["description"]
    _assert_probes_are_predictions(fit, predicted)


@pytest.mark.parametrize(
    ("layout", "gpu", "answer", "words", "global_batch"),
    [
        (["--dp", "2", "--fsdp", "2"], "73MiB", 49, "HSDP replicas 2 x FSDP2 2", 196),
        (["--fsdp", "2", "--tp", "2"], "70MiB", 60, "FSDP2 2 x TP 2", 120),
    ],
)
def test_fit_hsdp_and_fsdp_by_tp(tiny_llama, layout, gpu, answer, words, global_batch):
    """HSDP and FSDP2 x TP are searched as rank 0 of 4 (the answer fits, one above does not:
    the same boundary a search from batch 1 finds); the global batch counts the data-parallel
    ranks (replicas x shards), not the TP ranks, which share a batch."""
    code, fit = cli_json(
        ["fit", "llama3-8b", *layout, *_ON, *_RETRIES, "--gpu", gpu, "--margin", "0", "--batch", str(answer),
         "--max-batch", str(answer + 1), "--json"]
    )
    assert code == 0
    assert (fit["batch_size"], fit["first_failing_batch"]) == (answer, answer + 1)
    assert fit["parallel"]["layout"] == words and fit["parallel"]["world_size"] == 4
    assert fit["parallel"]["global_batch_size"] == global_batch


def test_fit_dp_terminal_says_the_batch_is_per_rank(tiny_llama, capsys):
    """Without --json the last line after the verdict says the batch is rank 0's, per rank."""
    code = main(
        ["fit", "llama3-8b", "--dp", "2", *_ON, *_RETRIES, "--gpu", "69MiB", "--margin", "0", "--batch", "22",
         "--max-batch", "22"]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "batch 22 is per rank (rank 0 of 2: DDP 2); global batch 44 over 2 data-parallel ranks"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["llama3-8b", "--dp", "2", "--tp", "2"], "is not modelled: add --fsdp S"),
        (["--tp", "2", "--hf", "gpt2"], "--hf models are not sharded by oomkit yet"),
        (["gpt2-124m", "--tp", "2"], "--tp is modelled for the Llama presets"),
        (["llama3-8b", "--tp", "3"], "--tp 3 must divide"),
        (["llama3-8b", "--dp", "2", "--lengths", "l.txt"], "--lengths is not searched sharded"),
        (["llama3-8b", "--tp", "2", "--smallest-gpu", "--batch", "2"], "--global-batch B"),
        (["llama3-8b", "--tp", "2", "--eval", "e.py:f"], "--eval is not sharded"),
        (["gpt2-124m", "--bucket-cap-mb", "5"], "go with --dp N alone"),
        (["gpt2-124m", "--dp", "2", "--mode", "inference"], "--dp predicts training steps"),
    ],
)
def test_fit_parallel_refusals_exit_2(argv, message, capsys):
    """What predict refuses of a layout, fit refuses too: exit 2, saying what to do."""
    assert main(["fit", *argv, "--seq", "16", "--steps", "1"]) == 2
    assert message in capsys.readouterr().err


def test_fit_tp_of_a_user_function_is_refused(tmp_path, capsys):
    """A file.py:function gets no TP plan: fit exits 2 pointing at --fsdp, as predict does."""
    path = write_step(tmp_path, "sharded", FSDP_STEP)
    assert main(["fit", f"{path}:build", "--tp", "2"]) == 2
    assert "step is not parallelized by oomkit: use --fsdp N" in capsys.readouterr().err


def test_api_searches_the_same_tp_batch(tiny_llama, tp_fit):
    """From Python, max_batch_size with a RecordingBuilder that records rank 0 of the layout
    (trace_distributed_step of build_tp_preset_step) finds the CLI's --tp 2 answer and peaks."""
    import dataclasses

    from oomkit.core.target import ParallelLayout, Target
    from oomkit.plan.batch_probe import RecordingBuilder
    from oomkit.plan.batch_search import max_batch_size
    from oomkit.prediction.models import StepOptions
    from oomkit.prediction.models.tensor_parallel import build_tp_preset_step
    from oomkit.prediction.tracing.distributed import trace_distributed_step

    layout = ParallelLayout(tp=2)

    def record(batch_size, target, steps):
        options = StepOptions(batch_size=batch_size, seq_len=16, precision="bf16-mixed")
        described = []

        def build(mesh):
            built = build_tp_preset_step("llama3-8b", options, mesh)
            described.append(built.description)
            return built.step_fn, built.track

        recording = trace_distributed_step(
            build, world_size=layout.world_size, mesh_shape=layout.mesh_shape, steps=steps,
            target=target,
        )
        return recording, described[0]

    target = Target.resolve("67MiB", context_overhead_bytes=0)
    result = max_batch_size(
        RecordingBuilder(record), target=dataclasses.replace(target, parallel=layout),
        margin_bytes=0, steps=1, start_batch=19, max_batch=20, allow_retries=True,
    )
    assert (result.batch_size, result.first_failing_batch) == (19, 20)
    assert result.peak_reserved_bytes == 66 * MiB
    assert result.description.startswith("Tiny Llama, batch 19, seq 16, bf16-mixed, adamw, train")
    _, cli = tp_fit  # fit --tp 2 on 67 MiB from 19 to 20, searched from the CLI
    assert [(p.peak_reserved_bytes, p.peak_allocated_bytes) for p in result.curve] == [
        (p["peak_reserved_bytes"], p["peak_allocated_bytes"]) for p in cli["curve"]
    ]


def test_fit_dp_of_a_function_without_batch_size_is_refused(tmp_path, capsys):
    """A sharded file.py:function that takes no batch_size cannot vary the batch: exit 2 after
    its first recording, not a search of a constant step up to --max-batch."""
    source = DDP_STEP.replace("def build(mesh, world_size, batch_size=4):", "def build(mesh, world_size):")
    path = write_step(tmp_path, "ddp_fixed", source.replace("batch_size, 64)", "4, 64)", 1))
    assert main(["fit", f"{path}:build", "--dp", "2", "--steps", "1"]) == 2
    assert "has no batch_size parameter" in capsys.readouterr().err


def test_fit_takes_predicts_ddp_flags(tiny_llama):
    """--bucket-cap-mb and --gradient-as-bucket-view reach fit's DDP probes as predict's."""
    code, fit = cli_json(
        ["fit", "llama3-8b", "--dp", "2", *_ON, *_RETRIES, "--gpu", "69MiB", "--margin", "0", "--batch", "8",
         "--max-batch", "8", "--bucket-cap-mb", "5", "--gradient-as-bucket-view", "--json"]
    )
    assert code == 0
    assert "DDP over 2 replicas (buckets 5 MiB, gradient_as_bucket_view), rank 0" in fit["description"]


def test_fit_s_usable_and_headroom_are_predict_s_with_nccl(tiny_llama):
    """Without --context-overhead, NCCL's buffers come off what the allocator may reserve;
    fit's usable bytes and headroom at its answer are predict's at that batch (they had been
    the GPU's whole usable memory, 605 MiB more for FSDP2 4 on an RTX 4090), and the
    prediction's own record says how much came off."""
    layout = ["--dp", "2"]
    on = ["--seq", "16", "--steps", "1", "--gpu", "2GiB", "--batch", "4"]
    code, fit = cli_json(
        ["fit", "llama3-8b", *layout, *on, "--margin", "0", "--max-batch", "4", "--json"]
    )
    assert code == 0 and fit["batch_size"] == 4
    code, predicted = cli_json(["predict", "llama3-8b", *layout, *on, "--no-remedies", "--json"])
    assert code == 0
    nccl = predicted["distributed"]["off_usable_bytes"]
    assert nccl == predicted["distributed"]["nccl_bytes"] > 100 * MiB
    assert fit["usable_bytes"] == predicted["usable_bytes"] == (
        2 * 2**30 - predicted["context_overhead_bytes"] - nccl
    )
    assert fit["headroom_bytes"] == predicted["headroom_bytes"]
    assert fit["curve"][0]["headroom_bytes"] == predicted["headroom_bytes"]
