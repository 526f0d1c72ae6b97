"""torchtitan's own code path: a job named as its launcher names it, recorded as its trainer runs it.

The recorded model is torchtitan 0.3.0's llama3 ``debugmodel`` cut to its first 2 blocks, a
registry module of one's own (``_torchtitan_two_blocks:llama3_debug_two_blocks`` in
tests/prediction; the full 6 blocks only take three times as long to record): 2,753,792
parameters, a 2048 x 256 embedding and LM head, 2 blocks of a fused 768 x 256 qkv, a 256 x 256
output, a 768-wide SwiGLU and two 256 norms, and the final norm, trained in fp32
(``training.dtype``) with torchtitan's fused AdamW; every row count divides by 2, so no FSDP2
shard is padded. The Float8 job is the registry's own ``debugmodel_float8`` cut the same way
(``_torchtitan_two_blocks_float8``). The recordings several test modules make are shared
(``_torchtitan_recordings``).
"""

from __future__ import annotations

import collections

import pytest

pytest.importorskip("torchtitan")

from _torchtitan_recordings import recorded_job  # noqa: E402
from _torchtitan_small_job import SMALL_STEP, TWO_BLOCKS, TWO_BLOCKS_FLOAT8  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from oomkit.core.target import Target  # noqa: E402
from oomkit.errors import OomkitError  # noqa: E402
from oomkit.prediction._torchtitan_env import SUPPORTED_TORCHTITAN, torchtitan_version  # noqa: E402
from oomkit.prediction.torchtitan_job import (  # noqa: E402
    TorchtitanJob,
    load_job_config,
    parse_job_name,
    record_torchtitan_job,
)

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

# The debugmodel's first 2 blocks: 2 x 2048 x 256 (embedding, LM head) + 2 blocks of 852,480 +
# the 256 final norm.
_BLOCKS = 2
_PARAMETERS = 2_753_792
# The 5 RMSNorm weights of 256 (2 per block, the final norm): replicated over TP (torchtitan's
# sequence-parallel norms), sharded over FSDP like every other parameter.
_NORM_PARAMETERS = 5 * 256
# torchtitan's fused AdamW (components/optimizer default_adamw, implementation "fused") keeps
# exp_avg and exp_avg_sq per parameter shard, and a 4-byte fp32 `step` per parameter (17: the
# embedding, the LM head, the final norm and 7 a block).
_STEP_BYTES = 17 * 4
# Small steps: 2 sequences of 256 tokens; the 2024 runs' eager step (no CUDA graphs); DTensor
# TP and FSDP2 over plain parameters (torch 2.13's fully_shard refuses spmd_types' annotations).
_TP2 = ("--parallelism.tensor_parallel_degree", "2")
_NO_AC = ("activation_checkpoint:none",)


def _job(world_size: int, *extra: str, **fields: object) -> TorchtitanJob:
    return TorchtitanJob("llama3", "debugmodel", SMALL_STEP + extra, world_size=world_size, **fields)  # type: ignore[arg-type]


def _two_blocks_job(world_size: int, *extra: str, **fields: object) -> TorchtitanJob:
    return TorchtitanJob(*TWO_BLOCKS, SMALL_STEP + extra, world_size=world_size, **fields)  # type: ignore[arg-type]


def _bytes_by_category(events) -> dict[str, int]:
    found: collections.Counter[str] = collections.Counter()
    for event in events:
        if event.action == "alloc":
            found[dict(event.tags)["category"]] += event.size
    return dict(found)


@pytest.fixture(scope="module")
def recorded():
    """(FSDP degree, TP degree, AC) -> (recording, run, prediction) of two train steps of the
    debugmodel's first 2 blocks on an H100."""
    out = {}
    for world_size, tp, ac in ((2, 1, True), (2, 1, False), (4, 2, True), (4, 2, False)):
        extra = (*(_TP2 if tp > 1 else ()), *(() if ac else _NO_AC))
        out[(world_size // tp, tp, ac)] = recorded_job(_two_blocks_job(world_size, *extra))
    return out


@pytest.mark.parametrize("ac", [True, False])
def test_fsdp2_rank_holds_half_of_every_parameter(recorded, ac):
    """FSDP 2: rank 0 holds the parameter count x 4 bytes (fp32) / 2 before step 0."""
    recording, run, _ = recorded[(2, 1, ac)]
    before = _bytes_by_category(recording.events[: recording.step_starts[0]])
    assert run.parameters == _PARAMETERS
    assert run.layout == {"dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert before["parameter"] == _PARAMETERS * 4 // 2 == 5_507_584


@pytest.mark.parametrize("ac", [True, False])
def test_fsdp2_x_tp2_rank_holds_a_quarter_but_the_norms_half(recorded, ac):
    """FSDP 2 x TP 2: TP shards all but the norms (replicated over TP), FSDP halves the rest."""
    recording, run, _ = recorded[(2, 2, ac)]
    before = _bytes_by_category(recording.events[: recording.step_starts[0]])
    expected = ((_PARAMETERS - _NORM_PARAMETERS) // 4 + _NORM_PARAMETERS // 2) * 4
    assert run.layout == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    assert before["parameter"] == expected == 2_755_072


@pytest.mark.parametrize(("fsdp", "tp"), [(2, 1), (2, 2)])
def test_adamw_state_is_twice_the_shard_plus_the_step_counters(recorded, fsdp, tp):
    """The first optimizer step allocates exp_avg + exp_avg_sq of rank 0's shards, and 17 step counters."""
    recording, _, _ = recorded[(fsdp, tp, True)]
    shard = _bytes_by_category(recording.events[: recording.step_starts[0]])["parameter"]
    step_0 = _bytes_by_category(recording.step_events(0))
    step_1 = _bytes_by_category(recording.step_events(1))
    assert step_0["optimizer_state"] == 2 * shard + _STEP_BYTES
    assert "optimizer_state" not in step_1  # steady state: updated in place


@pytest.mark.parametrize(("fsdp", "tp"), [(2, 1), (2, 2)])
def test_selective_ac_saves_fewer_activations_and_a_lower_peak(recorded, fsdp, tp):
    """torchtitan's SelectiveAC (the config's) keeps fewer activation bytes than no AC."""
    with_ac, _, predicted_ac = recorded[(fsdp, tp, True)]
    without, _, predicted = recorded[(fsdp, tp, False)]
    saved_ac = _bytes_by_category(with_ac.step_events(1))["activation"]
    saved = _bytes_by_category(without.step_events(1))["activation"]
    assert saved_ac < saved
    assert predicted_ac.peak_allocated_bytes < predicted.peak_allocated_bytes


def test_tp_halves_the_fsdp2_all_gather_buffers(recorded):
    """The all-gathered (bf16) parameters of a TP 2 rank are its TP half: FSDP2's buffers halve
    but for the norms, which TP does not shard."""
    fsdp, _, _ = recorded[(2, 1, True)]
    both, _, _ = recorded[(2, 2, True)]
    gathered = _bytes_by_category(fsdp.step_events(1))["allgather_buffer"]
    gathered_tp = _bytes_by_category(both.step_events(1))["allgather_buffer"]
    assert gathered > gathered_tp > gathered // 2


def test_the_recording_says_what_it_changed_and_leaves_out(recorded):
    """FlexAttention recorded as SDPA, and NCCL's memory, are stated in the warnings."""
    recording, run, _ = recorded[(2, 1, True)]
    text = " ".join(recording.warnings)
    assert "FlexAttention (2 layers) is recorded as torchtitan's ScaledDotProductAttention" in text
    assert "NCCL" in text
    assert "CUDA graphs" not in text  # --training.disable_cuda_graphs
    assert run.description.startswith(f"torchtitan 0.3.0 {TWO_BLOCKS[0]}:debugmodel (2,753,792 parameters)")


def test_fsdp_norms_run_the_fused_kernel_and_tp_norms_say_they_do_not(recorded):
    """torchtitan's nn.RMSNorm under FSDP2 (plain unsharded weights, plain activations) is
    torch 2.13's fused _fused_rms_norm, 5 a step without AC (2 blocks x 2, the final norm);
    under TP its sequence-parallel DTensor inputs stay the composite, which the recording
    says."""
    fsdp, _, _ = recorded[(2, 1, False)]
    fused = [e for e in fsdp.step_events(1)
             if e.action == "alloc" and e.tag("op") == "aten._fused_rms_norm.default"]
    assert len(fused) == 5 * 2  # each call's output and rstd
    assert not [w for w in fsdp.warnings if "DTensor inputs" in w]
    tp, _, _ = recorded[(2, 2, False)]
    assert not [e for e in tp.events if e.tag("op") == "aten._fused_rms_norm.default"]
    assert [w for w in tp.warnings if w.startswith("torch.nn.functional.rms_norm ran ")
            and "CUDA's fused kernel for DTensor inputs" in w]


def test_the_recorded_rank_is_the_one_asked_for():
    """rank=1 of FSDP 2 holds the same (unpadded) shard as rank 0, and says its rank (one step:
    the shard is made before it)."""
    recording, _ = record_torchtitan_job(
        _two_blocks_job(2, rank=1), target=Target.resolve("h100"), steps=1
    )
    before = _bytes_by_category(recording.events[: recording.step_starts[0]])
    assert before["parameter"] == 5_507_584
    assert any("rank 1 of a fake process group" in warning for warning in recording.warnings)


def test_preset_route_counts_the_same_llama3_8b():
    """torchtitan's 8B and oomkit's llama3-8b preset have the same parameters, so their FSDP
    shards agree to the byte (the peaks differ by the step: see benchmarks/torchtitan_rows.py)."""
    import torch

    from oomkit.prediction._torchtitan_env import import_torchtitan
    from oomkit.prediction.models.llama import llama_parameter_count
    from oomkit.prediction.models.presets import get_preset

    llama3 = import_torchtitan("torchtitan.models.llama3")
    with torch.device("meta"):
        model = llama3.model_registry("8B").model.build()
    titan = sum(p.numel() for p in model.parameters())
    preset = get_preset("llama3-8b")
    assert titan == llama_parameter_count(preset.shape) == 8_030_261_248


def test_job_names_parse_and_refuse():
    """MODULE:CONFIG splits on its one colon; anything else says the form."""
    assert parse_job_name("llama3:llama3_8b") == ("llama3", "llama3_8b")
    for bad in ("llama3", ":8b", "llama3:", "a:b:c"):
        with pytest.raises(OomkitError, match="MODULE:CONFIG"):
            parse_job_name(bad)


def test_short_config_names_find_the_registry_function():
    """``8b``/``debugmodel`` find ``llama3_8b``/``llama3_debugmodel``; overrides are applied."""
    config = load_job_config(TorchtitanJob("llama3", "debugmodel", ("--training.seq_len", "512")))
    assert config.training.seq_len == 512
    assert config.model_spec.flavor == "debugmodel"


_NAMES = st.text("abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=12)
_QUICK = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_QUICK
@given(_NAMES)
def test_an_unknown_module_is_refused_with_the_list(name):
    """A module torchtitan does not have, nor an importable one of the user's, is refused,
    listing those it has."""
    import importlib.util

    assume(name != "llama3")
    from oomkit.prediction._torchtitan_env import import_torchtitan

    assume(name not in import_torchtitan("torchtitan.models")._supported_models)
    # a module that imports is taken as the user's own registry (torchtitan's launcher does so)
    assume(importlib.util.find_spec(name) is None)
    with pytest.raises(OomkitError, match="torchtitan has no model module .*its modules: .*llama3"):
        load_job_config(TorchtitanJob(name, "debugmodel"))


@_QUICK
@given(_NAMES)
def test_an_unknown_config_is_refused_with_the_list(name):
    """A config the registry does not define (not even an imported name) lists its configs."""
    assume(name not in ("debugmodel", "8b", "70b", "405b") and not name.startswith("llama3_"))
    with pytest.raises(OomkitError, match="has no config .* its configs: .*llama3_8b"):
        load_job_config(TorchtitanJob("llama3", name))


def test_an_imported_name_is_not_a_config():
    """``cast`` is imported by the registry (typing.cast), not one of its configs."""
    with pytest.raises(OomkitError, match="has no config 'cast'"):
        load_job_config(TorchtitanJob("llama3", "cast"))


@_QUICK
@given(_NAMES, _NAMES)
def test_an_unknown_override_is_refused_in_torchtitans_words(section, field):
    """An override no config field has is refused with tyro's reason and the form."""
    assume(section not in ("training", "parallelism", "compile", "model", "debug"))
    with pytest.raises(OomkitError, match=r"torchtitan rejected the overrides .*--section\.field value"):
        load_job_config(TorchtitanJob("llama3", "debugmodel", (f"--{section}.{field}", "1")))


@pytest.mark.parametrize(
    "override",
    [
        ("--training.local_batch_size", "two"),
        ("--parallelism.spmd_backend", "nccl"),
        ("--parallelism.pipeline_parallel_microbatch_size", "0"),
    ],
)
def test_a_value_torchtitan_rejects_is_refused(override):
    """A value tyro or torchtitan's own config checks reject is an OomkitError, not an exit."""
    with pytest.raises(OomkitError, match="torchtitan re"):
        load_job_config(TorchtitanJob("llama3", "debugmodel", override))


@pytest.mark.parametrize(
    ("override", "words"),
    [
        (("--parallelism.expert_parallel_degree", "2"), "expert parallel"),
    ],
)
def test_parts_not_recorded_yet_are_refused_by_their_override(override, words):
    """EP is refused naming the override to drop (CP with PP: test_torchtitan_cp.py; compile:
    tests/interfaces/cli/test_torchtitan_compile_cli.py)."""
    with pytest.raises(OomkitError, match=f"{override[0]}: {words}"):
        record_torchtitan_job(_job(4, *override), target=Target.resolve("h100"))


def test_a_layout_that_does_not_fill_the_world_is_refused():
    """TP 3 on 4 ranks: torchtitan's ParallelDims refusal, said with the world size."""
    with pytest.raises(OomkitError, match="refused the parallel layout on 4 ranks"):
        record_torchtitan_job(
            _job(4, "--parallelism.tensor_parallel_degree", "3", "--parallelism.data_parallel_shard_degree", "1"),
            target=Target.resolve("h100"),
        )


def test_flex_attention_kept_is_refused():
    """attention="configured" with the config's FlexAttention: its kernels are not emulated."""
    with pytest.raises(OomkitError, match="FlexAttention, whose Triton/CUDA kernels"):
        record_torchtitan_job(_job(2, attention="configured"), target=Target.resolve("h100"))


def test_the_default_spmd_backend_is_refused_with_the_override_to_use():
    """torchtitan 0.3.0's default spmd_types backend fails in torch 2.13's fully_shard."""
    job = TorchtitanJob("llama3", "debugmodel", ("--training.seq_len", "256"), world_size=2)
    with pytest.raises(OomkitError, match="--parallelism.spmd_backend partial_dtensor"):
        record_torchtitan_job(job, target=Target.resolve("h100"))


def test_bad_world_or_rank_is_refused():
    """A rank outside the world is refused where the job is made."""
    with pytest.raises(OomkitError, match="rank in \\[0, world size\\)"):
        TorchtitanJob("llama3", "debugmodel", world_size=2, rank=2)


@pytest.fixture(scope="module")
def float8_recorded():
    """``llama3_debugmodel_float8`` (torchao Float8Linear, rowwise recipe) cut to its first 2
    blocks, on FSDP 2, an H100."""
    recording, run, _ = recorded_job(TorchtitanJob(*TWO_BLOCKS_FLOAT8, SMALL_STEP, world_size=2))
    return recording, run


def test_float8_linears_run_scaled_mm_on_the_targets_capability(float8_recorded):
    """The converter asks the target's compute capability (9.0 >= 8.9): every converted
    linear's forward and backward matmuls are torch._scaled_mm; the fp32 shards are unchanged."""
    recording, _ = float8_recorded
    ops = collections.Counter(
        dict(e.tags).get("op") for e in recording.events if e.action == "alloc"
    )
    # At least the block linears (wqkv, wo, w1, w2, w3 in each block) x 3 matmuls (forward,
    # grad input, grad weight) x 2 steps; SAC's recomputed forwards and the chunked loss's
    # LM head add more.
    assert ops["aten._scaled_mm.default"] >= 5 * _BLOCKS * 3 * 2
    before = _bytes_by_category(recording.events[: recording.step_starts[0]])
    assert before["parameter"] == _PARAMETERS * 4 // 2


def test_float8_on_a_gpu_without_fp8_is_refused_in_torchtitans_words():
    """An A100 (8.0) has no float8 matmuls: torchtitan's converter refuses, as on that GPU."""
    job = TorchtitanJob("llama3", "debugmodel_float8", SMALL_STEP, world_size=2)
    with pytest.raises(OomkitError, match="float8 is only supported on NVIDIA SM89 or later"):
        record_torchtitan_job(job, target=Target.resolve("A100 80GB SXM"))


@pytest.mark.parametrize("version", ["0.2.2", "0.1.0", "0.4.0.dev20260101"])
def test_other_torchtitan_releases_are_refused(monkeypatch, version):
    """Only the releases whose trainer is mirrored are run; another is refused, saying which."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: version if name == "torchtitan" else real(name)
    )
    with pytest.raises(OomkitError, match=f"torchtitan {version} is installed; oomkit mirrors the trainer of torchtitan 0.3.0"):
        load_job_config(TorchtitanJob("llama3", "debugmodel"))


def test_torchtitan_imports_after_has_triton_answered_true():
    """``has_triton()`` is cached: once a CUDA-emulated step made it True, torchao's MoE kernels
    (imported by torchtitan's quantization components) would define Triton kernels at import,
    which triton 3.9 rejects. import_torchtitan imports with it answering False, then restores.
    In a fresh interpreter: torchao registers its ops once per process."""
    import subprocess
    import sys

    code = (
        "import torch.utils._triton as t\n"
        "always = lambda: True\n"
        "t.has_triton = always\n"
        "from oomkit.prediction._torchtitan_env import import_torchtitan\n"
        "m = import_torchtitan('torchtitan.components.quantization')\n"
        "assert t.has_triton is always\n"
        "print(m.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("torchtitan.components.quantization")


def test_a_fully_qualified_registry_of_ones_own_is_taken_as_torchtitans_launcher_takes_it(
    tmp_path, monkeypatch
):
    """``--module my_pkg.configs`` (torchtitan/config/manager.py ``_load_config``: a module
    outside torchtitan, ``.config_registry`` tried first): its functions are the configs."""
    package = tmp_path / "my_titan_jobs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config_registry.py").write_text(
        "from torchtitan.models.llama3.config_registry import llama3_debugmodel\n\n\n"
        "def debug_three_sequences():\n"
        "    config = llama3_debugmodel()\n"
        "    config.training.local_batch_size = 3\n"
        "    return config\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_job_config(TorchtitanJob("my_titan_jobs", "debug_three_sequences"))
    assert config.training.local_batch_size == 3
    with pytest.raises(OomkitError, match="its configs: debug_three_sequences\\. Example"):
        load_job_config(TorchtitanJob("my_titan_jobs", "llama3_debugmodel"))


def test_a_fully_qualified_module_that_does_not_import_is_refused():
    with pytest.raises(OomkitError, match="neither no_such_pkg.jobs nor no_such_pkg.jobs.config_registry imports"):
        load_job_config(TorchtitanJob("no_such_pkg.jobs", "anything"))
