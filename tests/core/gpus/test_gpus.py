"""Tests for oomkit.core.gpus: the device catalog, lookups, sizes and the unknown-name error."""

from __future__ import annotations

import dataclasses

import pytest

import oomkit.core.gpus as gpus
from oomkit.core.gpus import (
    CATALOG,
    DEFAULT_CONTEXT_OVERHEAD_BYTES,
    GpuSpec,
    GpuSpecError,
    UnknownGpuError,
    get_gpu,
    list_gpus,
    normalize_gpu_name,
)
from oomkit.errors import OomkitError
from oomkit.units import GiB, MiB

# --- exact figures -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "total_bytes"),
    [
        ("A100 80GB SXM", 85_051_572_224),
        ("A100 40GB", 42_298_834_944),
        ("A100 80GB PCIe", 84_974_239_744),
        ("H100 SXM 80GB", 85_028_896_768),
        ("T4", 15_843_524_608),
        ("V100 32GB", 34_089_926_656),
        ("RTX 4090", 25_756_696_576),
        ("RTX 3090", 25_447_170_048),
        ("L4", 23_612_293_120),
        ("RTX 6000 Ada", 50_865_307_648),
        ("H200", 143_156 * MiB),
    ],
)
def test_total_memory_is_what_cuda_reports(name, total_bytes):
    """Catalog totals are the exact bytes CUDA reports, not the marketing size."""
    assert get_gpu(name).total_memory_bytes == total_bytes


def test_a100_80gb_reports_79_21_gib_not_80():
    """An "80GB" A100 reports 79.21 GiB through cudaMemGetInfo."""
    assert round(get_gpu("a100-80gb").total_memory_bytes / GiB, 2) == 79.21


def test_h100_spec_fields():
    """The H100 SXM entry carries its compute capability, architecture and bandwidth."""
    h100 = get_gpu("h100")
    assert h100.name == "H100 SXM 80GB"
    assert h100.compute_capability == (9, 0)
    assert h100.architecture == "Hopper"
    assert h100.memory_bandwidth_gb_per_s == 3350.0
    assert h100.total_memory_source == "cudaDeviceProp"
    assert h100.context_overhead_bytes == 718_077_952  # measured on an H200 (validation/)


def test_usable_bytes_subtracts_context_overhead():
    """usable_bytes() is total minus the context overhead, or minus what the caller says."""
    t4 = get_gpu("t4")
    assert t4.usable_bytes() == 15_843_524_608 - 300 * MiB
    assert t4.usable_bytes(reserved_outside_bytes=1 * GiB) == 15_843_524_608 - GiB
    assert t4.usable_bytes(reserved_outside_bytes=0) == t4.total_memory_bytes
    assert t4.usable_bytes(reserved_outside_bytes=100 * GiB) == 0


def test_usable_bytes_rejects_negative_reservation():
    """A negative outside reservation is a usage error that says what to pass instead."""
    with pytest.raises(GpuSpecError, match="Pass None"):
        get_gpu("t4").usable_bytes(reserved_outside_bytes=-1)


# --- lookups -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("h100", "H100 SXM 80GB"),
        ("H100-SXM", "H100 SXM 80GB"),
        ("h100sxm", "H100 SXM 80GB"),
        ("  H100 SXM  ", "H100 SXM 80GB"),
        ("h100_sxm", "H100 SXM 80GB"),
        ("H100 SXM 80GB", "H100 SXM 80GB"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM 80GB"),
        ("h100-pcie", "H100 PCIe"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("rtx4090", "RTX 4090"),
        ("RTX-3090", "RTX 3090"),
        ("Tesla T4", "T4"),
        ("a10g", "A10G"),
        ("A10", "A10"),
        ("l4", "L4"),
        ("L40S", "L40S"),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM"),
        ("a100-80gb-pcie", "A100 80GB PCIe"),
        ("a6000", "RTX A6000"),
        ("rtx-6000-ada", "RTX 6000 Ada"),
        ("v100-32gb", "V100 32GB"),
        ("b200", "B200"),
    ],
)
def test_alias_lookup_ignores_case_spaces_dashes_and_vendor(text, name):
    """Aliases match ignoring case, spaces, dashes, underscores and NVIDIA/GeForce/Tesla."""
    assert get_gpu(text).name == name


def test_normalize_gpu_name():
    """The lookup key drops vendor words and every non-alphanumeric character."""
    assert normalize_gpu_name("NVIDIA GeForce RTX 4090") == "rtx4090"
    assert normalize_gpu_name("H100-SXM") == "h100sxm"


def test_context_overhead_override():
    """context_overhead_bytes= replaces the estimate and records that in the notes."""
    spec = get_gpu("h100", context_overhead_bytes=1 * GiB)
    assert spec.context_overhead_bytes == GiB
    assert spec.usable_bytes() == 85_028_896_768 - GiB
    assert "given by the caller" in spec.source_notes[-1]
    assert get_gpu("h100").context_overhead_bytes == 718_077_952


def test_override_not_below_total_is_rejected():
    """An override that leaves nothing for PyTorch is refused with an example."""
    with pytest.raises(GpuSpecError, match="context_overhead_bytes=400"):
        get_gpu("t4", context_overhead_bytes=20 * GiB)


def test_spec_is_frozen():
    """GpuSpec is immutable."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_gpu("t4").total_memory_bytes = 1  # type: ignore[misc]


# --- sizes ---------------------------------------------------------------------------------------


def test_size_string_makes_a_custom_spec():
    """A size with a binary unit becomes a generic spec with the default overhead."""
    spec = get_gpu("24GiB")
    assert spec.name == "custom 24.00 GiB"
    assert spec.total_memory_bytes == 24 * GiB
    assert spec.context_overhead_bytes == DEFAULT_CONTEXT_OVERHEAD_BYTES == 400 * MiB
    assert spec.usable_bytes() == 24 * GiB - 400 * MiB
    assert spec.architecture is None
    assert spec.compute_capability is None
    assert spec.source_notes


def test_decimal_size_string():
    """The size 80GB is 80 * 10**9 bytes, named in GiB."""
    spec = get_gpu("80GB")
    assert spec.total_memory_bytes == 80_000_000_000
    assert spec.name == "custom 74.51 GiB"


def test_size_with_override():
    """A custom size takes a context overhead override too."""
    assert get_gpu("16 GiB", context_overhead_bytes=0).usable_bytes() == 16 * GiB


def test_bare_number_is_not_a_size():
    """A number without a unit is refused with a hint, not read as bytes."""
    with pytest.raises(UnknownGpuError, match="needs a unit"):
        get_gpu("24")


@pytest.mark.parametrize("text", ["-5GiB", "+24GiB", "1e12GiB", "1e400 GiB", "2.4e1GB"])
def test_a_size_with_a_sign_or_an_exponent_is_named_a_size(text):
    """A size written with a sign or an exponent is refused as a size (it had been an unknown
    GPU name, with "give the device's memory size instead" and names like V100's)."""
    with pytest.raises(UnknownGpuError) as raised:
        get_gpu(text)
    message = str(raised.value)
    assert message.startswith(f"{text!r} is not a GPU memory size oomkit reads: give a positive")
    assert "Did you mean" not in message


def test_size_below_default_overhead_is_rejected():
    """A size too small to hold a CUDA context is refused."""
    with pytest.raises(GpuSpecError, match="below the total"):
        get_gpu("100MiB")


# --- unknown names -------------------------------------------------------------------------------


def test_unknown_name_suggests_closest_match():
    """A typo lists the closest catalog names and mentions the size form."""
    with pytest.raises(UnknownGpuError, match=r"Did you mean 'H100 SXM 80GB'"):
        get_gpu("H100 SMX")


def test_unknown_name_mentions_size_form():
    """The error says a size such as --gpu 24GiB also works."""
    with pytest.raises(UnknownGpuError, match=r"`--gpu 24GiB` also works"):
        get_gpu("rtx 9090")


def test_family_prefix_lists_every_variant():
    """The family name a100 is ambiguous, so the error lists each A100 variant first."""
    with pytest.raises(
        UnknownGpuError, match=r"Did you mean 'A100 40GB', 'A100 80GB PCIe', 'A100 80GB SXM'\?"
    ):
        get_gpu("a100")


def test_unknown_gpu_error_is_oomkit_and_value_error():
    """UnknownGpuError can be caught as OomkitError or ValueError."""
    assert issubclass(UnknownGpuError, OomkitError)
    assert issubclass(UnknownGpuError, ValueError)


def test_no_similar_name():
    """A name like nothing in the catalog still says what to do."""
    with pytest.raises(UnknownGpuError, match="No catalog GPU has a similar name.*24GiB"):
        get_gpu("potato")


# --- catalog invariants --------------------------------------------------------------------------


def test_catalog_has_at_least_15_gpus():
    """The catalog covers at least 15 devices and list_gpus returns it."""
    assert len(list_gpus()) >= 15
    assert list_gpus() == CATALOG


def test_required_gpus_are_present():
    """Every GPU the predict feature needs is in the catalog."""
    for alias in [
        "t4", "v100-16gb", "v100-32gb", "a10g", "a10", "l4", "rtx3090", "rtx4090", "a100-40gb",
        "a100-80gb", "a100-80gb-pcie", "l40s", "rtx6000ada", "h100-pcie", "h100-sxm", "h200",
        "b200",
    ]:  # fmt: skip
        assert isinstance(get_gpu(alias), GpuSpec)


@pytest.mark.parametrize("spec", CATALOG, ids=lambda spec: spec.name)
def test_every_entry_is_sourced_and_consistent(spec):
    """Each entry has sources, a positive overhead below the total, and full device fields."""
    assert spec.source_notes
    assert any(note.startswith("total memory") for note in spec.source_notes)
    assert any(note.startswith("context overhead") for note in spec.source_notes)
    assert spec.total_memory_source in ("cudaDeviceProp", "cudaMemGetInfo", "derived")
    if spec.total_memory_source == "derived":
        assert any("derived:" in note for note in spec.source_notes)
        # A MiB-rounded print, or a sibling device's figure (L40, H200 NVL), said so.
        sibling = any("sibling's figure" in note for note in spec.source_notes)
        assert spec.total_memory_bytes % MiB == 0 or sibling
    assert 0 < spec.context_overhead_bytes < spec.total_memory_bytes
    assert spec.compute_capability is not None
    assert spec.architecture is not None
    assert spec.memory_bandwidth_gb_per_s is not None and spec.memory_bandwidth_gb_per_s > 0
    assert spec.aliases
    assert all(alias == alias.lower() for alias in spec.aliases)


def test_names_are_unique():
    """No two catalog entries share a canonical name."""
    names = [spec.name for spec in CATALOG]
    assert len(names) == len(set(names))


def test_aliases_are_unique_across_gpus():
    """No lookup key (normalized name or alias) names two different GPUs."""
    owner: dict[str, str] = {}
    for spec in CATALOG:
        for key in {normalize_gpu_name(spec.name), *map(normalize_gpu_name, spec.aliases)}:
            assert owner.setdefault(key, spec.name) == spec.name, key


def test_every_alias_finds_its_own_gpu():
    """Looking up any alias or canonical name returns that entry."""
    for spec in CATALOG:
        for text in (spec.name, *spec.aliases):
            assert get_gpu(text) is spec


def test_compute_capability_matches_architecture():
    """Compute capability majors agree with the architecture family."""
    majors = {"Pascal": {6}, "Volta": {7}, "Turing": {7}, "Ampere": {8}, "Ada Lovelace": {8},
              "Hopper": {9}, "Blackwell": {10, 12}}  # fmt: skip
    for spec in CATALOG:
        assert spec.compute_capability[0] in majors[spec.architecture]


def test_every_public_name_imports():
    """Every name in oomkit.core.gpus.__all__ exists."""
    for name in gpus.__all__:
        assert hasattr(gpus, name), name


def test_small_custom_size_takes_a_context_override():
    """`--gpu 32MiB --context-overhead 0`: the override applies before the size is checked."""
    spec = get_gpu("32MiB", context_overhead_bytes=0)
    assert spec.total_memory_bytes == 32 * 2**20
    assert spec.context_overhead_bytes == 0
    assert spec.usable_bytes() == 32 * 2**20


def test_get_gpu_takes_a_spec_and_applies_the_override():
    """A GpuSpec passes through get_gpu; an override replaces its context overhead only."""
    spec = get_gpu("rtx4090")
    assert get_gpu(spec) is spec
    tuned = get_gpu(spec, context_overhead_bytes=123 * 2**20)
    assert tuned.context_overhead_bytes == 123 * 2**20
    assert tuned.total_memory_bytes == spec.total_memory_bytes


def test_kernel_compute_capability_is_the_gpus_own_or_an_h100s_for_a_custom_size():
    """T4 chooses kernels as 7.5; a plain size has no architecture and chooses them as 9.0."""
    from oomkit.core.gpus import DEFAULT_KERNEL_COMPUTE_CAPABILITY

    assert get_gpu("t4").kernel_compute_capability == (7, 5)
    assert get_gpu("24GiB").compute_capability is None
    assert get_gpu("24GiB").kernel_compute_capability == DEFAULT_KERNEL_COMPUTE_CAPABILITY == (9, 0)


def test_sm_counts_and_resident_threads_size_the_grids():
    """Every catalog entry states its SMs with a source; the resident threads per SM follow the
    compute capability (CUDA C++ Programming Guide); a plain size is sized as an H100 SXM."""
    for spec in gpus.CATALOG:
        assert spec.multiprocessor_count and spec.multiprocessor_count > 0
        assert any(note.startswith("SMs: ") for note in spec.source_notes)
    assert (get_gpu("h200").kernel_multiprocessor_count, get_gpu("h200").kernel_max_threads_per_multiprocessor) == (132, 2048)
    assert (get_gpu("rtx4090").kernel_multiprocessor_count, get_gpu("rtx4090").kernel_max_threads_per_multiprocessor) == (128, 1536)
    assert get_gpu("t4").kernel_max_threads_per_multiprocessor == 1024
    custom = get_gpu("24GiB")
    assert custom.multiprocessor_count is None
    assert (custom.kernel_multiprocessor_count, custom.kernel_max_threads_per_multiprocessor) == (132, 2048)
    with pytest.raises(GpuSpecError, match="multiprocessor_count must be positive"):
        GpuSpec("bad", 24 * GiB, 512 * MiB, multiprocessor_count=0)
