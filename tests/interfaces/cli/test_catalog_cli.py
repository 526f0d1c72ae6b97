"""`oomkit gpus` and `oomkit presets`, the GPUs added to the catalog, and --help's lists."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from oomkit.core.gpus import CATALOG, get_gpu
from oomkit.errors import UnknownGpuError
from oomkit.interfaces.cli import build_parser, main
from oomkit.interfaces.cli._scenario_flags import PRESET_NAMES
from oomkit.scenario.workloads import VISION_PRESETS

GiB = 2**30
MiB = 2**20


@pytest.mark.parametrize(
    ("name", "canonical", "total_bytes", "cc", "architecture", "source"),
    [
        ("rtx5090", "RTX 5090", 33_660_534_784, (12, 0), "Blackwell", "cudaDeviceProp"),
        ("NVIDIA GeForce RTX 3060", "RTX 3060 12GB", 12_884_377_600, (8, 6), "Ampere",
         "cudaDeviceProp"),
        ("a40", "A40", 47_608_692_736, (8, 6), "Ampere", "cudaDeviceProp"),
        ("l40", "L40", 47_576_711_168, (8, 9), "Ada Lovelace", "derived"),
        ("H100 NVL", "H100 NVL", 99_960_750_080, (9, 0), "Hopper", "cudaDeviceProp"),
        ("h200-nvl", "H200 NVL", 143_156 * MiB, (9, 0), "Hopper", "derived"),
        ("Tesla P100-PCIE-16GB", "P100 16GB", 17_071_734_784, (6, 0), "Pascal",
         "cudaDeviceProp"),
        ("NVIDIA GH200 480GB", "GH200 96GB", 102_005_473_280, (9, 0), "Hopper",
         "cudaDeviceProp"),
    ],
)
def test_added_gpus(name, canonical, total_bytes, cc, architecture, source):
    """Each GPU added for issue 16 item 14 has its cited total, compute capability and source."""
    spec = get_gpu(name)
    assert (spec.name, spec.total_memory_bytes, spec.compute_capability) == (
        canonical, total_bytes, cc
    )
    assert (spec.architecture, spec.total_memory_source) == (architecture, source)
    assert spec.source_notes[0].startswith(f"total memory ({source}): ")
    assert spec.memory_bandwidth_gb_per_s is not None


def test_l40_and_l40s_stay_distinct():
    """`l40` is not `l40s`; `h200` is the SXM part and `h200nvl` the NVL one."""
    assert get_gpu("l40").name == "L40" and get_gpu("l40s").name == "L40S"
    assert get_gpu("h200").name == "H200" and get_gpu("h200nvl").name == "H200 NVL"


@pytest.mark.parametrize("name", ["mi300x", "AMD Instinct MI300X"])
def test_mi300x_is_refused_with_the_reason(name):
    """An AMD GPU is refused, saying the allocator is shared but the kernels' memory is not."""
    with pytest.raises(UnknownGpuError, match=r"MI300X is an AMD GPU, which oomkit does not model"):
        get_gpu(name)


def test_mi300x_on_the_cli_exits_2(capsys):
    """`predict --gpu mi300x` exits 2 before torch is needed, with the reason on stderr."""
    assert main(["demo", "--gpu", "mi300x"]) == 2
    err = capsys.readouterr().err
    assert "hipified into HIPCachingAllocator" in err
    assert "--gpu 192GB" in err


def test_gpus_json_lists_the_whole_catalog(capsys):
    """`oomkit gpus --json`: every catalog entry, bytes as ints, usable = total - context."""
    assert main(["gpus", "--json"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert [g["name"] for g in gpus] == [spec.name for spec in CATALOG]
    assert len(gpus) == 28
    h100 = next(g for g in gpus if g["name"] == "H100 SXM 80GB")
    assert h100["total_memory_bytes"] == 85_028_896_768
    assert h100["usable_bytes"] == h100["total_memory_bytes"] - h100["context_overhead_bytes"]
    assert h100["compute_capability"] == [9, 0] and "h100" in h100["aliases"]
    # every GpuSpec field is in the JSON (gpu_to_json's promise), the SM count among them
    from dataclasses import fields

    from oomkit.core.gpus import GpuSpec

    assert {f.name for f in fields(GpuSpec)} <= set(h100)
    assert h100["multiprocessor_count"] == 132


def test_gpus_table_piped_has_one_row_per_gpu(capsys):
    """The table shows each GPU's --gpu name and figures on one line, unwrapped in a pipe."""
    from oomkit.units import format_bytes

    assert main(["gpus"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "│ rtx5090 " in line)
    spec = get_gpu("rtx5090")  # the context estimate is the overhead module's (may change)
    assert [cell.strip() for cell in row.strip("│").split("│")] == [
        "rtx5090", "RTX 5090", "31.35 GiB", format_bytes(spec.context_overhead_bytes),
        format_bytes(spec.usable_bytes()), "12.0", "Blackwell", "cudaDeviceProp",
    ]
    assert sum("│" in line for line in out.splitlines()) == len(CATALOG)


def test_gpus_runs_without_torch():
    """`oomkit gpus` needs no torch."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from oomkit.interfaces.cli import main\n"
        "sys.exit(main(['gpus', '--json']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["gpus"]) == len(CATALOG)


def test_presets_json_and_defaults(capsys):
    """`oomkit presets --json`: the 12 presets, their parameters and the defaults predict uses."""
    pytest.importorskip("torch")
    assert main(["presets", "--json"]) == 0
    presets = {p["name"]: p for p in json.loads(capsys.readouterr().out)["presets"]}
    assert tuple(presets) == PRESET_NAMES
    assert presets["llama-1b"] == {
        "name": "llama-1b",
        "title": "Llama 3.2 1B",
        "task": "causal_lm",
        "parameters": 1_235_814_400,
        "input_flag": "--seq",
        "default_seq_len": 2048,
        "default_image_size": None,
        "default_precision": "bf16-mixed",
        "default_batch_size": 4,
        "source": "meta-llama/Llama-3.2-1B config.json on the Hugging Face hub",
    }
    assert presets["gpt2-124m"]["default_precision"] == "bf16-mixed"
    assert presets["gpt2-124m"]["default_batch_size"] == 8
    assert presets["resnet50"]["input_flag"] == "--image-size"
    assert presets["resnet50"]["default_image_size"] == 224
    assert presets["resnet50"]["default_precision"] == "fp32"
    vision = tuple(name for name, p in presets.items() if p["input_flag"] == "--image-size")
    assert vision == VISION_PRESETS


def test_presets_table(capsys):
    """The table names each preset's input flag, precision and batch defaults."""
    pytest.importorskip("torch")
    assert main(["presets"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "│ llama-8b " in line)
    assert [cell.strip() for cell in row.strip("│").split("│")] == [
        "llama-8b", "Llama 3.1 8B", "causal_lm", "8,030.3M", "--seq 2048", "bf16-mixed", "4"
    ]


def test_presets_without_torch_exit_3():
    """Without torch, `oomkit presets` says what to install, exit 3."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from oomkit.interfaces.cli import main\n"
        "sys.exit(main(['presets']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3
    assert proc.stderr.startswith(
        "oomkit: oomkit presets builds the presets, which are PyTorch modules, and needs torch; "
        "install it with `pip install oomkit[torch]`"
    )


@pytest.mark.parametrize("command", ["predict", "fit"])
def test_help_lists_presets_gpus_and_defaults(command):
    """predict/fit --help name every preset, count the catalog's GPUs (naming `oomkit gpus`,
    which lists them: the help stays under 100 lines) and state the defaults."""
    action = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(action.choices[command].format_help().split())
    for name in PRESET_NAMES:
        assert name in text
    assert f"GPUs: {len(CATALOG)} in the catalog (`oomkit gpus`: h100," in text
    assert "fp32, fp16-mixed, bf16-mixed, bf16 or fp16" in text
    assert "a catalog GPU (`oomkit gpus`)" in text
    assert "adamw (default)" in text and "train (default)" in text
    assert "(default: installed)" in text


def test_help_never_breaks_a_hyphenated_name():
    """Every help line ends at a space: no preset, flag or setting is split at its hyphen."""
    action = next(a for a in build_parser()._actions if a.dest == "command")
    for command, parser in action.choices.items():
        for line in parser.format_help().splitlines():
            assert not line.rstrip().endswith("-") or line.strip() in ("-", "--"), (command, line)
