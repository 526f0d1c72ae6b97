"""Input a new user gets wrong: sizes without a unit, flags that change nothing, API wording,
the torch version an alloc-conf error cites, and the presets' defaults (issue 16 item 15)."""

from __future__ import annotations

import importlib.util

import pytest

from oomkit.errors import ConfigError
from oomkit.interfaces.cli import build_parser, main
from oomkit.interfaces.cli._common import capacity_bytes
from oomkit.scenario.options import field_wording

MiB = 2**20


@pytest.mark.parametrize("text", ["24", "24.5", "1048575"])
def test_bare_number_below_a_mib_is_refused(text):
    """`--capacity 24` would be 24 bytes: refused, asking for the unit."""
    with pytest.raises(ConfigError, match=rf"'{text}' has no unit, so it would mean \d+ bytes"):
        capacity_bytes(text)


def test_bare_number_of_bytes_and_zero_keep_working():
    """From 1 MiB on a bare number is bytes; units always work."""
    assert capacity_bytes("1048576") == MiB
    assert capacity_bytes("24GiB") == 24 * 2**30
    assert capacity_bytes("24 MiB") == 24 * MiB


def test_capacity_24_on_the_cli_exits_2(capsys):
    """`oomkit demo --capacity 24` exits 2 and suggests 24GiB."""
    assert main(["demo", "--capacity", "24"]) == 2
    assert "give the unit, e.g. 24GiB or 24MiB" in capsys.readouterr().err


def test_size_flags_refuse_a_bare_small_number_but_take_zero(capsys):
    """--budget 24 is refused by the scenario (exit 2); --margin 0 stays valid."""
    from oomkit.interfaces.cli._scenario_flags import scenario_from_args

    assert main(["predict", "gpt2-124m", "--budget", "24"]) == 2
    assert "--budget (run.budget_bytes): '24' has no unit" in capsys.readouterr().err
    args = build_parser().parse_args(["fit", "gpt2-124m", "--margin", "0"])
    assert scenario_from_args(args, "fit", environ={}).search.margin_bytes == 0


def test_field_wording_names_flags():
    """StepOptions(field=value) in a library message becomes the flag that sets it."""
    assert field_wording("use StepOptions(seq_len=...) of at most 1024 in total") == (
        "use --seq N of at most 1024 in total"
    )
    assert field_wording("Example: StepOptions(image_size=240)") == "Example: --image-size 240"
    assert field_wording("StepOptions(precision='bf16')") == "--precision bf16"
    assert field_wording("StepOptions(max_grad_norm=1.0)") == "StepOptions(max_grad_norm=1.0)"
    # Several fields: each its flag; a switch alone; any field without a flag or a Python
    # value keeps the whole call as written.
    assert field_wording("Example: StepOptions(optimizer='adamw', optimizer_impl='fused')") == (
        "Example: --optimizer adamw --optimizer-impl fused"
    )
    assert field_wording("StepOptions(mode='inference', seq_len=1152, compile=True)") == (
        "--mode inference --seq 1152 --compile"
    )
    for kept in (
        "StepOptions(optimizer='adamw', max_grad_norm=1.0)",
        "StepOptions(lora=LoraOptions(r=16))",
        "StepOptions(lora=LoraOptions(targets=('q_proj', 'v_proj'))) (CLI: --lora-targets)",
        "StepOptions(**fields)",
    ):
        assert field_wording(kept) == kept


def test_an_optimizer_implementation_it_does_not_take_names_the_flags(capsys):
    """--optimizer-impl fused with adamw8bit: exit 2, the example in flags (it had read
    "--optimizer adamw', optimizer_impl='fused")."""
    pytest.importorskip("torch")
    assert main(["predict", "gpt2-124m", "--optimizer", "adamw8bit", "--optimizer-impl",
                 "fused"]) == 2
    err = capsys.readouterr().err
    assert "not 'adamw8bit'. Example: --optimizer adamw --optimizer-impl fused" in err


needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="predict needs torch"
)

@needs_torch
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["resnet50", "--seq", "128"], "--seq does not apply to resnet50: ResNet-50 is a vision "
         "model, so --seq 128 would change nothing. Use --image-size instead, or drop --seq."),
        (["vit-b16", "--seq", "128"], "--seq does not apply to vit-b16: ViT-B/16 is a vision "
         "model"),
        (["gpt2-124m", "--image-size", "224"], "--image-size does not apply to gpt2-124m: "
         "GPT-2 124M is a text model, so --image-size 224 would change nothing. Use --seq "
         "instead, or drop --image-size."),
        (["llama-1b", "--image-size", "224"], "--image-size does not apply to llama-1b"),
        (["bert-base", "--image-size", "224"], "--image-size does not apply to bert-base"),
    ],
)
def test_shape_flag_of_the_other_kind_is_an_error(argv, message, capsys):
    """A shape flag the preset ignores exits 2, naming the flag (it was silently ignored)."""
    assert main(["predict", *argv, "--batch", "1"]) == 2
    assert message in capsys.readouterr().err


@needs_torch
def test_too_long_seq_names_the_flag(capsys):
    """The too-long --seq error names --seq, not StepOptions(seq_len=...)."""
    assert main(["predict", "gpt2-124m", "--seq", "5000", "--batch", "1"]) == 2
    err = capsys.readouterr().err
    assert "GPT-2 124M has 1024 positions but the step needs 5000 tokens" in err
    assert "use --seq N of at most 1024 in total" in err
    assert "StepOptions" not in err


@needs_torch
def test_alloc_conf_error_cites_the_installed_torch(capsys):
    """Without --torch-version, predict models the installed torch's allocator and says so."""
    import torch

    installed = ".".join(torch.__version__.split(".")[:2])
    assert main(["predict", "gpt2-124m", "--alloc-conf", "foo:1"]) == 2
    assert f"invalid allocator setting 'foo:1' (torch {installed} rules)" in capsys.readouterr().err
    assert main(["predict", "gpt2-124m", "--alloc-conf", "foo:1", "--torch-version", "2.6"]) == 2
    assert "(torch 2.6 rules)" in capsys.readouterr().err


@needs_torch
@pytest.mark.parametrize(
    ("target", "description"),
    [
        ("llama-1b", "Llama 3.2 1B, batch 4, seq 2048, bf16-mixed, adamw, train"),
        ("gpt2-124m", "GPT-2 124M, batch 8, seq 1024, bf16-mixed, adamw, train"),
        ("bert-base", "BERT base, batch 8, seq 512, fp32, adamw, train"),
    ],
)
def test_preset_defaults(target, description):
    """Without flags, the LLM presets run bf16-mixed (Llama at batch 4), the others fp32."""
    from oomkit.core.gpus import get_gpu
    from oomkit.scenario import Scenario
    from oomkit.scenario.workloads import build_workload

    h100 = get_gpu("h100")
    default = Scenario(model={"preset": target})
    assert build_workload(default, None, h100).description == description
    explicit = Scenario(model={"preset": target}, step={"precision": "fp32", "batch": 2})
    assert ", batch 2, " in build_workload(explicit, None, h100).description
    assert ", fp32, " in build_workload(explicit, None, h100).description


@needs_torch
def test_preset_names_match_the_presets():
    """The torch-free copy of the preset names --help shows is the presets' own, in order."""
    from oomkit.interfaces.cli._scenario_flags import PRESET_NAMES
    from oomkit.prediction.models import PRESETS
    from oomkit.scenario.workloads import VISION_PRESETS

    assert PRESET_NAMES == tuple(PRESETS)
    assert VISION_PRESETS == tuple(
        name for name, p in PRESETS.items() if p.task == "image_classification"
    )


@needs_torch
def test_hf_keeps_step_options_defaults():
    """--hf has no preset: StepOptions' defaults apply (batch 8; precision None = the config's
    torch_dtype, decided when the model is built)."""
    from oomkit.core.gpus import get_gpu
    from oomkit.scenario import Scenario
    from oomkit.scenario.options import step_options

    options = step_options(Scenario(model={"hf": "gpt2"}), None, None, get_gpu("h100")).options
    assert (options.precision, options.batch_size) == (None, 8)
