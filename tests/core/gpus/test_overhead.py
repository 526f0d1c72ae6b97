"""The CUDA context model: a function of compute capability, CUDA version and loading mode."""

from __future__ import annotations

import pytest

from oomkit.core.gpus import CATALOG
from oomkit.core.gpus.cuda_versions import cuda_build_for, installed_cuda_build
from oomkit.core.gpus.overhead import (
    context_overhead_bytes,
    cuda_context,
    module_loading_for,
)
from oomkit.core.target import Target
from oomkit.errors import ConfigError
from oomkit.interfaces.cli import build_parser
from oomkit.interfaces.cli._scenario_flags import scenario_from_args
from oomkit.scenario.target import target_of

MiB = 2**20
GiB = 2**30


# Hopper's lazy figure: 718,077,952 bytes, measured on an H200 (validation/).
HOPPER_MEASURED = 718_077_952


@pytest.mark.parametrize(
    ("capability", "lazy_bytes"),
    [((6, 0), 300 * MiB), ((7, 0), 300 * MiB), ((7, 5), 300 * MiB), ((8, 0), 400 * MiB),
     ((8, 6), 400 * MiB), ((8, 9), 430 * MiB), ((9, 0), HOPPER_MEASURED), ((10, 0), 550 * MiB),
     ((12, 0), 550 * MiB), (None, 400 * MiB)],
)
def test_lazy_and_eager_figures_by_compute_capability(capability, lazy_bytes):
    """Each capability's lazy figure; eager adds 1 GiB; ranges hold the point figure."""
    lazy = cuda_context(capability, "12.8")
    eager = cuda_context(capability, "11.6")
    assert (lazy.module_loading, eager.module_loading) == ("lazy", "eager")
    assert lazy.expected_bytes == lazy_bytes
    assert eager.expected_bytes == lazy_bytes + GiB
    assert lazy.low_bytes == min(256 * MiB, lazy_bytes)
    assert lazy.high_bytes == lazy_bytes + 800 * MiB
    assert eager.low_bytes == lazy.low_bytes + 379_584_512
    assert eager.high_bytes == lazy.high_bytes + 1300 * MiB
    for context in (lazy, eager):
        assert context.low_bytes <= context.expected_bytes <= context.high_bytes
        assert context.source.startswith("lazy figure: ")  # every figure names its source
    assert "PR #86509" in eager.source


def test_loading_mode_follows_cuda_version_and_environment():
    """Lazy from CUDA 11.7 unless CUDA_MODULE_LOADING=EAGER; eager below 11.7 whatever is set."""
    assert module_loading_for("11.7")[0] == "lazy"
    assert module_loading_for("11.6")[0] == "eager"
    assert module_loading_for("10.2", {"CUDA_MODULE_LOADING": "LAZY"})[0] == "eager"
    assert module_loading_for("12.8", {"CUDA_MODULE_LOADING": "EAGER"}) == (
        "eager",
        "CUDA_MODULE_LOADING=EAGER",
    )
    assert module_loading_for(None)[0] == "lazy"


def test_every_catalog_gpu_is_covered_by_its_capability():
    """Every catalog entry (and any added later) gets its figure from its compute capability."""
    for spec in CATALOG:
        target = Target.resolve(spec, cuda_version="12.8")
        assert target.cuda_context is not None
        expected = cuda_context(spec.compute_capability, "12.8").expected_bytes
        assert target.context_overhead_bytes == expected
        eager = Target.resolve(spec, cuda_version="11.3")
        assert eager.context_overhead_bytes == expected + GiB
        assert spec.context_overhead_bytes == context_overhead_bytes(
            spec.architecture, spec.compute_capability
        )


def test_an_unknown_architecture_name_falls_back_to_its_capability():
    """A catalog entry of a family this module does not name still gets a figure."""
    assert context_overhead_bytes("Pascal") == 300 * MiB
    assert context_overhead_bytes("Rubin", (11, 0)) == 550 * MiB
    assert context_overhead_bytes("Unknown") == 400 * MiB


def test_default_cuda_version_of_a_torch_release():
    """+cuXYZ builds carry their CUDA; CPU builds and untagged wheels take the default wheel's."""
    assert cuda_build_for("2.6.0+cu118").cuda_version == "11.8"
    assert cuda_build_for("1.8.2+cu111").cuda_version == "11.1"
    assert cuda_build_for("2.13.0+cpu").cuda_version == "13.0"
    assert cuda_build_for("2.13.0").cuda_version == "13.0"
    assert cuda_build_for("2.9.1").cuda_version == "12.8"
    assert cuda_build_for("2.7").cuda_version == "12.6"
    assert cuda_build_for("2.4.1").cuda_version == "12.1"
    assert cuda_build_for("1.12.1").cuda_version == "10.2"
    assert cuda_build_for("2.3.0+rocm6.0").cuda_version is None
    assert installed_cuda_build(lambda: None).cuda_version == "13.0"


def test_target_states_the_context_and_warns_for_another_torch():
    """The target says which context it assumed; another torch version than installed warns."""
    target = Target.resolve("a100-80gb-sxm", torch_version="1.12", installed_torch=lambda: "2.13.0")
    assert target.cuda_version == "10.2"
    assert target.context_overhead_bytes == 400 * MiB + GiB
    assert "CUDA 10.2, eager module loading" in target.context_description
    (warning,) = target.warnings
    assert "torch 1.12 with torch 2.13.0 installed" in warning
    same = Target.resolve("h100", torch_version="2.13", installed_torch=lambda: "2.13.0+cpu")
    assert same.warnings == () and same.cuda_version == "13.0"
    overridden = Target.resolve("h100", context_overhead_bytes=GiB, cuda_version="11.0")
    assert overridden.cuda_context is None and overridden.context_overhead_bytes == GiB


def test_with_gpu_keeps_the_cuda_model_for_catalog_candidates():
    """fit --smallest-gpu candidates get the target's CUDA; a changed context is kept."""
    import dataclasses

    base = Target.resolve("h100", cuda_version="11.6")
    t4 = next(spec for spec in CATALOG if spec.compute_capability == (7, 5))
    assert base.with_gpu(t4).context_overhead_bytes == 300 * MiB + GiB
    margin = dataclasses.replace(t4, context_overhead_bytes=777 * MiB)
    assert base.with_gpu(margin).context_overhead_bytes == 777 * MiB


def test_cuda_version_flag_and_environment():
    """--cuda-version X.Y sets the CUDA; CUDA_MODULE_LOADING=EAGER makes the context eager."""
    parser = build_parser()
    args = parser.parse_args(["predict", "gpt2-124m", "--gpu", "h100", "--cuda-version", "12.4"])

    def target(args, environ):
        return target_of(scenario_from_args(args, "predict", environ=environ).target)

    assert target(args, {}).cuda_version == "12.4"
    eager = target(args, {"CUDA_MODULE_LOADING": "EAGER"})
    assert eager.context_overhead_bytes == HOPPER_MEASURED + GiB
    bad = parser.parse_args(["fit", "gpt2-124m", "--cuda-version", "twelve"])
    with pytest.raises(ConfigError, match="MAJOR.MINOR"):
        target(bad, {})
