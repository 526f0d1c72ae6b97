"""PYTORCH_CUDA_ALLOC_CONF parsing, printing, env precedence and runtime updates (ref §9)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.rounding import divisions_slot
from oomkit.core.allocator.versions import behaviour_for
from oomkit.errors import ConfigError

MiB = 2**20
GiB = 2**30
DOC_EXAMPLE = "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"


def parse_quiet(text, version=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AllocatorConfig.parse(text, version, native_only=False)  # the grammar PyTorch reads


# ---------------------------------------------------------------------- defaults and values


def test_default_config():
    """The default config is PyTorch's defaults and prints as the empty string."""
    c = AllocatorConfig()
    assert c.max_split_size_bytes is None
    assert c.max_non_split_rounding_bytes is None
    assert c.roundup_power2_divisions == (0,) * 16
    assert c.garbage_collection_threshold == 0.0
    assert c.expandable_segments is False
    assert c.large_segment_size_bytes == 20 * MiB
    assert c.per_process_memory_fraction is None
    assert c.release_lock_on_cudamalloc is False
    assert c.backend == "native"
    assert str(c) == ""
    assert c.effective_max_non_split_rounding_bytes == 20 * MiB
    assert c.roundup_enabled is False


@pytest.mark.parametrize("text", ["", " ", "\t \n"])
def test_empty_settings_are_default(text):
    """An empty or blank string gives the default config."""
    assert AllocatorConfig.parse(text) == AllocatorConfig()


@pytest.mark.parametrize(
    ("text", "version", "expected"),
    [
        ("max_split_size_mb:128", None, {"max_split_size_bytes": 128 * MiB}),
        ("max_split_size_mb:20", None, {"max_split_size_bytes": 20 * MiB}),
        ("max_split_size_mb:21", "2.4", {"max_split_size_bytes": 21 * MiB}),
        ("max_split_size_mb:512.7", None, {"max_split_size_bytes": 512 * MiB}),  # stoull
        ("max_split_size_mb:512.7", "2.4", {"max_split_size_bytes": 512 * MiB}),  # stoi
        # stoull negates modulo 2^64, then the value is capped at SIZE_MAX / MiB.
        ("max_split_size_mb:-1", None, {"max_split_size_bytes": ((2**64 - 1) // MiB) * MiB}),
        ("max_split_size_mb:3000000000", None, {"max_split_size_bytes": 3000000000 * MiB}),
        ("max_non_split_rounding_mb:64", None, {"max_non_split_rounding_bytes": 64 * MiB}),
        ("max_non_split_rounding_mb:21", "2.6", {"max_non_split_rounding_bytes": 21 * MiB}),
        ("large_segment_size_mb:11", None, {"large_segment_size_bytes": 11 * MiB}),
        (
            "large_segment_size_mb:40,max_split_size_mb:40",
            None,
            {"large_segment_size_bytes": 40 * MiB, "max_split_size_bytes": 40 * MiB},
        ),
        # large_segment_size_mb is read first wherever it is (CFG-main).
        (
            "max_split_size_mb:40,large_segment_size_mb:40",
            None,
            {"large_segment_size_bytes": 40 * MiB, "max_split_size_bytes": 40 * MiB},
        ),
        ("garbage_collection_threshold:0.6", None, {"garbage_collection_threshold": 0.6}),
        ("garbage_collection_threshold:0x1p-1", None, {"garbage_collection_threshold": 0.5}),
        ("garbage_collection_threshold:.25abc", None, {"garbage_collection_threshold": 0.25}),
        ("expandable_segments:True", None, {"expandable_segments": True}),
        ("expandable_segments:False", "2.1", {"expandable_segments": False}),
        ("release_lock_on_cudamalloc:True", None, {"release_lock_on_cudamalloc": True}),
        ("release_lock_on_hipmalloc:True", None, {"release_lock_on_cudamalloc": True}),
        ("backend:native", "2.0", {}),
        ("per_process_memory_fraction:0", None, {"per_process_memory_fraction": 0.0}),
        ("per_process_memory_fraction:1", "2.9", {"per_process_memory_fraction": 1.0}),
        ("pinned_use_cuda_host_register:True", None, {"pinned_use_cuda_host_register": True}),
        ("pinned_num_register_threads:128", None, {"pinned_num_register_threads": 128}),
        ("pinned_use_background_threads:True", None, {"pinned_use_background_threads": True}),
        (
            "graph_capture_record_stream_reuse:True",
            None,
            {"graph_capture_record_stream_reuse": True},
        ),
        ("throw_on_cudamalloc_oom:True", None, {"throw_on_cudamalloc_oom": True}),
        ("pinned_free_catch_all:True", None, {"pinned_free_catch_all": True}),
        (
            "pinned_reserve_segment_size_mb:64",
            None,
            {"pinned_reserve_segment_size_bytes": 64 * MiB},
        ),
        ("pinned_max_cached_size_mb:0", None, {"pinned_max_cached_size_bytes": 0}),
        ("pinned_max_round_threshold_mb:8", None, {"pinned_max_round_threshold_bytes": 8 * MiB}),
        # >= 2.9 ConfigTokenizer: all whitespace is dropped; checkToken's result is ignored.
        (
            " max_split_size_mb : 128 ,\texpandable_segments:True\n",
            None,
            {"max_split_size_bytes": 128 * MiB, "expandable_segments": True},
        ),
        ("max_split_size_mb,128", None, {"max_split_size_bytes": 128 * MiB}),
        ("max_split_size_mb:128,", None, {"max_split_size_bytes": 128 * MiB}),
        # <= 2.8 lexArgs drops spaces; stoi skips a leading tab in the value.
        ("max_split_size_mb : 128", "2.4", {"max_split_size_bytes": 128 * MiB}),
        ("max_split_size_mb:\t128", "2.4", {"max_split_size_bytes": 128 * MiB}),
        ("max_split_size_mb:128,", "2.4", {"max_split_size_bytes": 128 * MiB}),
        # A later value wins.
        ("max_split_size_mb:128,max_split_size_mb:256", None, {"max_split_size_bytes": 256 * MiB}),
    ],
)
def test_parse_values(text, version, expected):
    """Each option sets its field with PyTorch's number rules; the rest stay default."""
    assert parse_quiet(text, version) == dataclasses.replace(AllocatorConfig(), **expected)


# ---------------------------------------------------------------------- roundup divisions


@pytest.mark.parametrize(
    ("text", "version", "expected"),
    [
        ("roundup_power2_divisions:4", None, (4,) * 16),
        ("roundup_power2_divisions:1", "1.12", (1,) * 16),
        # §9.3 example: new rule <512 MiB→1, [512,1G)→2, [1,2)G→4, >=2G→8.
        (DOC_EXAMPLE, None, (1,) * 9 + (2, 4) + (8,) * 5),
        (DOC_EXAMPLE, "2.9", (1,) * 9 + (2, 4) + (8,) * 5),
        # <= 2.8: `>` fills from the last listed slot inclusive, overwriting [1,2) GiB.
        (DOC_EXAMPLE, "2.8", (1,) * 9 + (2,) + (8,) * 6),
        (DOC_EXAMPLE, "2.0", (1,) * 9 + (2,) + (8,) * 6),
        # `>` first: last_index is 0, so new fills 1..15 and old fills 0..15.
        ("roundup_power2_divisions:[>:8]", None, (0,) + (8,) * 15),
        ("roundup_power2_divisions:[>:8]", "2.4", (8,) * 16),
        # Boundaries clamp to slot 15; 1 MB is slot 0; 0 disables a slot.
        ("roundup_power2_divisions:[65536:2]", None, (2,) * 16),
        ("roundup_power2_divisions:[1:4,2:0]", None, (4, 0) + (0,) * 14),
        (
            "roundup_power2_divisions:[64:8,256:4,1024:4,>:1]",
            None,
            (8,) * 7 + (0, 4, 0, 4) + (1,) * 5,
        ),
        ("roundup_power2_divisions:[]", None, (0,) * 16),
        # >= 2.9 does not check the separator between boundary and value.
        ("roundup_power2_divisions:[256,1]", None, (1,) * 9 + (0,) * 7),
        # A later roundup setting replaces the whole table.
        ("roundup_power2_divisions:4,roundup_power2_divisions:[2:8]", None, (8, 8) + (0,) * 14),
    ],
)
def test_roundup_slots(text, version, expected):
    """§2.2 / §9.3: scalar and bracket forms fill the 16 slots, `>` by version."""
    assert AllocatorConfig.parse(text, version).roundup_power2_divisions == expected


@pytest.mark.parametrize(
    ("size", "slot"),
    [
        (1, 0),
        (512, 0),
        (2 * MiB - 1, 0),
        (2 * MiB, 1),
        (256 * MiB, 8),
        (512 * MiB - 1, 8),
        (512 * MiB, 9),
        (GiB, 10),
        (2 * GiB, 11),
        (32 * GiB, 15),
        (64 * GiB, 15),
        (2**50, 15),
    ],
)
def test_divisions_for(size, slot):
    """§2.2: slot floor(log2(n)) - 20 clamped to [0, 15]."""
    slots = tuple(range(16))
    c = AllocatorConfig(roundup_power2_divisions=tuple(1 << s for s in slots))
    assert c.divisions_for(size) == 1 << slot
    assert divisions_slot(size) == slot


def test_divisions_for_doc_example():
    """§9.3 example under the newest parser."""
    c = AllocatorConfig.parse(DOC_EXAMPLE)
    assert [
        c.divisions_for(n * MiB) for n in (1, 300, 511, 512, 1023, 1024, 2047, 2048, 10**6)
    ] == [
        1,
        1,
        1,
        2,
        2,
        4,
        4,
        8,
        8,
    ]
    assert c.roundup_enabled is True


# ---------------------------------------------------------------------- rejections


@pytest.mark.parametrize(
    ("text", "version", "match"),
    [
        ("max_split_size_mb:19", None, r"max_split_size_mb must be >= 20 \(MB\); got 19"),
        ("max_split_size_mb:20", "2.7", r"max_split_size_mb must be > 20 \(MB\); got 20"),
        ("max_split_size_mb:20", "2.4", r"must be > 20"),
        ("max_split_size_mb:-1", "2.4", None),  # accepted: stoi -1 wraps to SIZE_MAX
        ("large_segment_size_mb:40,max_split_size_mb:30", None, r"must be >= 40 \(MB\); got 30"),
        (
            "large_segment_size_mb:40,max_non_split_rounding_mb:30",
            None,
            r"max_non_split_rounding_mb must be >= 40",
        ),
        ("max_non_split_rounding_mb:19", None, r"max_non_split_rounding_mb must be >= 20"),
        ("max_non_split_rounding_mb:20", "2.6", r"max_non_split_rounding_mb must be > 20"),
        ("large_segment_size_mb:10", None, r"large_segment_size_mb must be > 10 \(MB\); got 10"),
        ("max_split_size_mb:abc", None, r"'abc' is not an integer"),
        ("max_split_size_mb:3000000000", "2.4", r"out of the range of a C int \(stoi\)"),
        ("max_split_size_mb:99999999999999999999", None, r"64-bit unsigned integer"),
        ("max_split_size_mb", None, r"'max_split_size_mb' has no value"),
        ("max_split_size_mb:", None, r"'max_split_size_mb' has no value"),
        ("max_split_size_mb:", "2.4", r"'max_split_size_mb' has no value"),
        ("max_split_size_mb,128", "2.8", r"expected ':' after 'max_split_size_mb' but found ','"),
        ("max_split_size_mb:128;expandable_segments:True", None, r"is not an integer|unknown key"),
        ("max_split_size_mb:128 expandable_segments:True", "2.4", r"expected ','"),
        ("max_split_size_mb=128", None, r"unknown key"),
        ("garbage_collection_threshold:0", None, r"must be in \(0.0, 1.0\); got '0'"),
        ("garbage_collection_threshold:1.0", None, r"must be in \(0.0, 1.0\); got '1.0'"),
        ("garbage_collection_threshold:-0.5", "2.4", r"must be in \(0.0, 1.0\)"),
        ("garbage_collection_threshold:nan", None, r"must be in \(0.0, 1.0\); got 'nan'"),
        ("garbage_collection_threshold:1e999", None, r"out of the range of a double"),
        ("garbage_collection_threshold:1e-310", None, r"too small for a double"),
        ("garbage_collection_threshold:x", None, r"'x' is not a number"),
        ("expandable_segments:true", None, r"must be exactly True or False; got 'true'"),
        ("expandable_segments:1", "2.4", r"must be exactly True or False; got '1'"),
        ("expandable_segments", None, r"has no value"),
        ("release_lock_on_cudamalloc:yes", None, r"exactly True or False"),
        ("backend:hipMallocAsync", None, r"unknown allocator backend 'hipMallocAsync'"),
        ("backend:async", "2.4", r"options are native and cudaMallocAsync"),
        ("roundup_power2_divisions:0", None, r"must be a power of two; got 0"),
        ("roundup_power2_divisions:3", None, r"must be a power of two; got 3"),
        ("roundup_power2_divisions:[256:3]", None, r"power of two or 0; got 3"),
        ("roundup_power2_divisions:[0:1]", None, r"interval '0' must be a power of two"),
        ("roundup_power2_divisions:[300:1]", None, r"interval '300' must be a power of two"),
        ("roundup_power2_divisions:[256:1", None, r"has no closing '\]'"),
        ("roundup_power2_divisions:[256:1,", None, r"has no closing '\]'"),
        ("roundup_power2_divisions:[256:", None, r"has no value"),
        ("roundup_power2_divisions:[256,1]", "2.8", r"expected ':' after '256'"),
        ("roundup_power2_divisions:[256:1;512:2]", "2.4", r"is not an integer|expected ','"),
        ("roundup_power2_divisions:[256:1]", "1.13", r"needs torch >= 2.0"),
        ("per_process_memory_fraction:1.5", None, r"must be in \[0.0, 1.0\]; got '1.5'"),
        ("per_process_memory_fraction:-0.1", None, r"must be in \[0.0, 1.0\]"),
        ("pinned_num_register_threads:3", None, r"must be a power of two; got 3"),
        ("pinned_num_register_threads:256", None, r"must be <= 128; got 256"),
        ("pinned_reserve_segment_size_mb:0", None, r"must be > 0; got 0"),
        ("foo:1", None, r"Unrecognized key 'foo' in Accelerator allocator config"),
        ("foo:1", "2.10", r"Unrecognized key 'foo' in CUDA allocator config"),
        ("foo:1", "2.4", r"Unrecognized CachingAllocator option: foo"),
        ("max_split_size_mb:128,foo:[1,2]", None, r"Unrecognized key 'foo'"),
        (",max_split_size_mb:128", None, r"Unrecognized key ','"),
        ("max_split_size_mb:128,,", None, r"Unrecognized key ','"),
        ("max_splitsize_mb:128", None, r"did you mean max_split_size_mb\?"),
        ("max_non_split_rounding_mb:64", "2.5", r"needs torch >= 2\.6"),
        ("large_segment_size_mb:32", "2.11", r"needs torch >= 2\.12"),
        ("per_process_memory_fraction:0.5", "2.8", r"needs torch >= 2\.9"),
        ("expandable_segments:True", "2.0", r"needs torch >= 2\.1"),
        ("backend:native", "1.13", r"needs torch >= 2\.0"),
        ("garbage_collection_threshold:0.5", "1.11", r"needs torch >= 1\.12"),
        # CFG-2.9: the CUDA pass sees the unknown key even after an earlier valid one.
        ("expandable_segments:True,bogus:1", "2.9", r"in CUDA allocator config"),
    ],
)
def test_rejections(text, version, match):
    """Every string PyTorch rejects raises ConfigError that says why and shows an example."""
    if match is None:
        parse_quiet(text, version)
        return
    with pytest.raises(ConfigError, match=match):
        parse_quiet(text, version)


def test_rejection_message_shape():
    """A rejection names the text, the version's rule and a correct example."""
    with pytest.raises(ConfigError) as info:
        AllocatorConfig.parse("max_split_size_mb:2", "2.4")
    message = str(info.value)
    assert message == (
        "invalid allocator setting 'max_split_size_mb:2' (torch 2.4 rules): max_split_size_mb "
        "must be > 20 (MB); got 2. Example: PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:128"
    )
    assert isinstance(info.value, ValueError)
    AllocatorConfig.parse("max_split_size_mb:128")  # the example parses


def test_every_example_in_messages_parses():
    """The examples shown in error messages are themselves valid settings."""
    from oomkit.core.allocator._config_parser import EXAMPLES

    for example in EXAMPLES.values():
        parse_quiet(example)


def test_not_a_string_is_config_error():
    """parse takes text."""
    with pytest.raises(ConfigError, match="must be a string"):
        AllocatorConfig.parse(128)  # type: ignore[arg-type]


def test_bad_version_is_config_error():
    """An unreadable torch_version is a ConfigError too."""
    with pytest.raises(ConfigError, match="cannot read PyTorch version 'x.y'"):
        AllocatorConfig.parse("", "x.y")


# ---------------------------------------------------------------------- cudaMallocAsync warning


@pytest.mark.parametrize(
    ("text", "version", "warns"),
    [
        ("backend:cudaMallocAsync", None, False),
        ("backend:cudaMallocAsync,max_split_size_mb:128", "2.4", True),  # lexArgs: any option
        ("backend:cudaMallocAsync,max_split_size_mb:128", None, False),  # Accelerator pass key
        ("backend:cudaMallocAsync,release_lock_on_cudamalloc:True", None, True),
        ("backend:native,max_split_size_mb:128", "2.4", False),
    ],
)
def test_cudamallocasync_warning(text, version, warns):
    """parseArgs warns when cudaMallocAsync meets an option its parser counts as native-only."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = AllocatorConfig.parse(text, version, native_only=False)
    hits = [w for w in caught if "cudaMallocAsync ignores" in str(w.message)]
    assert len(hits) == (1 if warns else 0)
    assert c.backend in ("native", "cudaMallocAsync")


# ---------------------------------------------------------------------- printing


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("", ""),
        ("expandable_segments:False", ""),
        ("max_split_size_mb : 128", "max_split_size_mb:128"),
        (
            "expandable_segments:True,max_split_size_mb:128",
            "max_split_size_mb:128,expandable_segments:True",
        ),
        ("roundup_power2_divisions:[1:4]", "roundup_power2_divisions:[1:4,2:0,>:0]"),
        (DOC_EXAMPLE, "roundup_power2_divisions:[256:1,512:2,1024:4,2048:8,>:8]"),
        ("roundup_power2_divisions:[32768:4]", "roundup_power2_divisions:4"),
        ("large_segment_size_mb:20", ""),
        ("garbage_collection_threshold:0.60", "garbage_collection_threshold:0.6"),
        ("per_process_memory_fraction:1", "per_process_memory_fraction:1.0"),
    ],
)
def test_canonical_string(text, canonical):
    """str() prints non-default options only, in a fixed order."""
    assert str(AllocatorConfig.parse(text)) == canonical


@pytest.mark.parametrize("version", ["2.0", "2.4", "2.8", "2.9", "2.14"])
def test_canonical_roundup_reads_the_same_in_every_version(version):
    """The printed roundup list does not depend on the `>` fill rule."""
    c = AllocatorConfig.parse(DOC_EXAMPLE)
    assert AllocatorConfig.parse(str(c), version).roundup_power2_divisions == (
        c.roundup_power2_divisions
    )


_pow2_or_zero = st.sampled_from([0, 1, 2, 4, 8, 16, 64, 1024, 2**40])


@st.composite
def valid_configs(draw, version="2.14"):
    """Configs reachable from a settings string in ``version``."""
    b = behaviour_for(version)
    keys = b.config_keys
    kwargs: dict[str, object] = {}
    lseg_mb = 20
    if "large_segment_size_mb" in keys and draw(st.booleans()):
        lseg_mb = draw(st.integers(11, 4096))
        kwargs["large_segment_size_bytes"] = lseg_mb * MiB
    min_mb = lseg_mb if b.max_split_size_min_inclusive else lseg_mb + 1
    # <= 2.8 reads integers with stoi: larger values cannot be written.
    max_mb = 2**31 - 1 if b.config_parser == "legacy" else (2**64 - 1) // MiB
    if draw(st.booleans()):
        kwargs["max_split_size_bytes"] = draw(st.integers(min_mb, max_mb)) * MiB
    if "max_non_split_rounding_mb" in keys and draw(st.booleans()):
        kwargs["max_non_split_rounding_bytes"] = draw(st.integers(min_mb, 10**6)) * MiB
    if "roundup_power2_divisions" in keys and draw(st.booleans()):
        if b.roundup_bracket_form and draw(st.booleans()):
            values = _pow2_or_zero.filter(lambda d: d <= max_mb)
            kwargs["roundup_power2_divisions"] = tuple(
                draw(st.lists(values, min_size=16, max_size=16))
            )
        else:
            kwargs["roundup_power2_divisions"] = (draw(st.sampled_from([1, 2, 4, 8, 16])),) * 16
    if "garbage_collection_threshold" in keys and draw(st.booleans()):
        kwargs["garbage_collection_threshold"] = draw(
            st.floats(0.0, 1.0, exclude_min=True, exclude_max=True, allow_subnormal=False)
        )
    if "per_process_memory_fraction" in keys and draw(st.booleans()):
        kwargs["per_process_memory_fraction"] = draw(st.floats(0.0, 1.0, allow_subnormal=False))
    for name, key in (
        ("expandable_segments", "expandable_segments"),
        ("release_lock_on_cudamalloc", "release_lock_on_cudamalloc"),
        ("graph_capture_record_stream_reuse", "graph_capture_record_stream_reuse"),
        ("throw_on_cudamalloc_oom", "throw_on_cudamalloc_oom"),
        ("pinned_use_cuda_host_register", "pinned_use_cuda_host_register"),
        ("pinned_use_background_threads", "pinned_use_background_threads"),
        ("pinned_free_catch_all", "pinned_free_catch_all"),
    ):
        if key in keys:
            kwargs[name] = draw(st.booleans())
    if "pinned_num_register_threads" in keys:
        kwargs["pinned_num_register_threads"] = draw(st.sampled_from([1, 2, 8, 128]))
    for name, key in (
        ("pinned_reserve_segment_size_bytes", "pinned_reserve_segment_size_mb"),
        ("pinned_max_round_threshold_bytes", "pinned_max_round_threshold_mb"),
        ("pinned_max_cached_size_bytes", "pinned_max_cached_size_mb"),
    ):
        if key in keys and draw(st.booleans()):
            low = 1 if key == "pinned_reserve_segment_size_mb" else 0
            kwargs[name] = draw(st.integers(low, 10**6)) * MiB
    if "backend" in keys:
        kwargs["backend"] = draw(st.sampled_from(["native", "cudaMallocAsync"]))
    return AllocatorConfig(**kwargs)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(valid_configs())
def test_round_trip_newest(c):
    """parse(str(c)) == c for every config the newest release can express."""
    assert parse_quiet(str(c)) == c


@pytest.mark.parametrize("version", ["1.12", "2.0", "2.4", "2.7", "2.8", "2.9", "2.11"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip_per_version(version, data):
    """parse(str(c), v) == c for configs that release v can express."""
    c = data.draw(valid_configs(version))
    assert parse_quiet(str(c), version) == c


@settings(max_examples=200, deadline=None)
@given(valid_configs())
def test_round_trip_is_a_fixed_point(c):
    """Printing a parsed config again gives the same string."""
    assert str(parse_quiet(str(c))) == str(c)


# ---------------------------------------------------------------------- direct construction


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_split_size_bytes": 100}, "max_split_size_bytes must be None or a whole number"),
        ({"max_split_size_bytes": 19 * MiB}, ">= large_segment_size_bytes"),
        ({"max_non_split_rounding_bytes": 10 * MiB}, "max_non_split_rounding_bytes"),
        ({"large_segment_size_bytes": 10 * MiB}, "above 10 MiB"),
        ({"roundup_power2_divisions": (4,) * 15}, "16 ints"),
        ({"roundup_power2_divisions": (3,) * 16}, "power of two"),
        ({"garbage_collection_threshold": 1.0}, r"0.0 \(off\) or in \(0, 1\)"),
        ({"per_process_memory_fraction": 2.0}, r"in \[0, 1\]"),
        ({"garbage_collection_threshold": 5e-324}, "subnormal"),
        ({"per_process_memory_fraction": 5e-324}, "subnormal"),
        ({"backend": "hip"}, "backend must be"),
        ({"pinned_num_register_threads": 3}, "power of two <= 128"),
        ({"pinned_reserve_segment_size_bytes": 0}, "MiB > 0"),
    ],
)
def test_direct_construction_is_validated(kwargs, match):
    """An AllocatorConfig no settings string could produce is rejected."""
    with pytest.raises(ConfigError, match=match):
        AllocatorConfig(**kwargs)


def test_direct_construction_normalises():
    """A list of divisions becomes a tuple; an int threshold becomes a float."""
    c = AllocatorConfig(roundup_power2_divisions=[2] * 16, garbage_collection_threshold=0)  # type: ignore[arg-type]
    assert c.roundup_power2_divisions == (2,) * 16
    assert isinstance(c.garbage_collection_threshold, float)
    assert hash(c) == hash(AllocatorConfig.parse("roundup_power2_divisions:2"))


def test_effective_non_split_rounding():
    """The §6 slack is the setting, else the large segment size."""
    assert (
        AllocatorConfig.parse("max_non_split_rounding_mb:64").effective_max_non_split_rounding_bytes
        == 64 * MiB
    )
    assert (
        AllocatorConfig.parse("large_segment_size_mb:32").effective_max_non_split_rounding_bytes
        == 32 * MiB
    )


# ---------------------------------------------------------------------- environment


def _from_env(environ, version):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = AllocatorConfig.from_env(environ, version)
    return c, [str(w.message) for w in caught]


CUDA = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC = "PYTORCH_ALLOC_CONF"
HIP = "PYTORCH_HIP_ALLOC_CONF"
BOTH = {CUDA: "max_split_size_mb:128", ALLOC: "max_split_size_mb:256"}


@pytest.mark.parametrize(
    ("environ", "version", "split_mb", "warning"),
    [
        ({}, None, None, None),
        ({CUDA: "max_split_size_mb:128"}, "2.4", 128, None),
        (
            {ALLOC: "max_split_size_mb:256"},
            "2.4",
            None,
            "PYTORCH_ALLOC_CONF is set but torch 2.4 does not read it",
        ),
        ({ALLOC: "max_split_size_mb:256"}, "2.8", None, "does not read it"),
        (BOTH, "2.8", 128, "PYTORCH_ALLOC_CONF is ignored"),
        (BOTH, "2.9", 256, "PYTORCH_CUDA_ALLOC_CONF is ignored"),
        (BOTH, "2.11", 256, "PYTORCH_CUDA_ALLOC_CONF is ignored"),
        (BOTH, "2.12", 128, "PYTORCH_ALLOC_CONF is ignored"),
        (BOTH, None, 128, "PYTORCH_ALLOC_CONF is ignored"),
        ({CUDA: "max_split_size_mb:128"}, "2.10", 128, "PYTORCH_CUDA_ALLOC_CONF is deprecated"),
        ({HIP: "max_split_size_mb:64"}, "2.10", 64, "PYTORCH_HIP_ALLOC_CONF is deprecated"),
        ({HIP: "max_split_size_mb:64"}, None, 64, None),
        (
            {HIP: "max_split_size_mb:64", ALLOC: "max_split_size_mb:32"},
            None,
            64,
            "PYTORCH_ALLOC_CONF is ignored",
        ),
        ({ALLOC: "max_split_size_mb:256"}, None, 256, None),
        ({CUDA: "", ALLOC: "max_split_size_mb:256"}, None, None, "PYTORCH_ALLOC_CONF is ignored"),
        ({CUDA: "max_split_size_mb:128", ALLOC: "max_split_size_mb:128"}, None, 128, None),
    ],
)
def test_env_precedence(environ, version, split_mb, warning):
    """§9.1: only the first variable set is read; the order depends on the version."""
    c, messages = _from_env(environ, version)
    assert c.max_split_size_bytes == (None if split_mb is None else split_mb * MiB)
    if warning is None:
        assert messages == []
    else:
        assert any(warning in m for m in messages), messages


def test_env_2_9_ignores_expandable_from_alloc_conf():
    """Issue #183387: torch 2.9 drops expandable_segments given only via PYTORCH_ALLOC_CONF."""
    c, messages = _from_env({ALLOC: "expandable_segments:True"}, "2.9.1")
    assert c.expandable_segments is False
    assert any("#183387" in m for m in messages)
    c, _ = _from_env({ALLOC: "expandable_segments:True"}, "2.10")
    assert c.expandable_segments is True


def test_env_error_names_the_variable():
    """A bad value in the environment shows an example for the variable that was read."""
    with pytest.raises(ConfigError, match="Example: PYTORCH_ALLOC_CONF=max_split_size_mb:128"):
        AllocatorConfig.from_env({ALLOC: "max_split_size_mb:1"})


def test_env_defaults_to_os_environ(monkeypatch):
    """environ=None reads os.environ."""
    monkeypatch.delenv(ALLOC, raising=False)
    monkeypatch.delenv(HIP, raising=False)
    monkeypatch.setenv(CUDA, "expandable_segments:True")
    assert AllocatorConfig.from_env().expandable_segments is True


# ---------------------------------------------------------------------- runtime updates


FULL = (
    "large_segment_size_mb:32,max_split_size_mb:256,max_non_split_rounding_mb:64,"
    "roundup_power2_divisions:4,garbage_collection_threshold:0.6,expandable_segments:True,"
    "release_lock_on_cudamalloc:True,per_process_memory_fraction:0.5"
)


def test_runtime_update_resets_unmentioned_newest():
    """§13.21 (MAIN26): max_split, roundup, GC and non-split rounding reset; the rest stay."""
    c = AllocatorConfig.parse(FULL).runtime_update("pinned_num_register_threads:2")
    assert c == dataclasses.replace(
        AllocatorConfig(),
        large_segment_size_bytes=32 * MiB,
        expandable_segments=True,
        release_lock_on_cudamalloc=True,
        per_process_memory_fraction=0.5,
        pinned_num_register_threads=2,
    )


def test_runtime_update_keeps_non_split_rounding_before_main26():
    """§9.1: before MAIN26, max_non_split_rounding survives a runtime update."""
    text = "max_split_size_mb:256,max_non_split_rounding_mb:64,expandable_segments:True"
    c = AllocatorConfig.parse(text, "2.10").runtime_update("", "2.10")
    assert c.max_split_size_bytes is None
    assert c.max_non_split_rounding_bytes == 64 * MiB
    assert c.expandable_segments is True


@pytest.mark.parametrize(
    ("update", "expected"),
    [
        ("max_split_size_mb:128", {"max_split_size_bytes": 128 * MiB}),
        ("garbage_collection_threshold:0.8", {"garbage_collection_threshold": 0.8}),
        ("roundup_power2_divisions:[512:2]", {"roundup_power2_divisions": (2,) * 10 + (0,) * 6}),
        ("expandable_segments:False", {"expandable_segments": False}),
    ],
)
def test_runtime_update_sets_what_it_names(update, expected):
    """An update sets what it names; resettable options it does not name go to defaults."""
    base = AllocatorConfig.parse(
        "max_split_size_mb:256,garbage_collection_threshold:0.5,expandable_segments:True"
    )
    c = base.runtime_update(update)
    defaults = {
        "max_split_size_bytes": None,
        "garbage_collection_threshold": 0.0,
        "roundup_power2_divisions": (0,) * 16,
        "expandable_segments": True,
    }
    defaults.update(expected)
    assert {k: getattr(c, k) for k in defaults} == defaults


def test_runtime_update_large_segment_size_is_sticky():
    """CFG-main: large_segment_size survives updates and sets the max_split minimum."""
    c = AllocatorConfig.parse("large_segment_size_mb:40")
    with pytest.raises(ConfigError, match="max_split_size_mb must be >= 40"):
        c.runtime_update("max_split_size_mb:30")
    assert c.runtime_update("max_split_size_mb:40").large_segment_size_bytes == 40 * MiB


@pytest.mark.parametrize("version", ["2.4", "2.14"])
def test_runtime_update_backend_cannot_change(version):
    """parseAllocatorConfig asserts the runtime backend equals the load-time one."""
    native = AllocatorConfig.parse("", version)
    with pytest.raises(ConfigError, match="backend cannot change at runtime"):
        native.runtime_update("backend:cudaMallocAsync", version)
    assert native.runtime_update("backend:native", version).backend == "native"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        asynch = AllocatorConfig.parse("backend:cudaMallocAsync", version, native_only=False)
        assert asynch.runtime_update("", version).backend == "cudaMallocAsync"


def test_runtime_update_validates_like_parse():
    """A bad runtime string is rejected with the same rules."""
    with pytest.raises(ConfigError, match="must be > 20"):
        AllocatorConfig().runtime_update("max_split_size_mb:20", "2.4")


# ---------------------------------------------------------------------- real PyTorch parser


def _torch_parser():
    try:
        import torch
    except ImportError:
        return None
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    version = torch.__version__.split("+")[0]
    if setter is None or tuple(int(x) for x in version.split(".")[:2]) < (2, 12):
        return None
    return setter


_ACCEL_KEYS = st.sampled_from(
    [
        "max_split_size_mb",
        "max_non_split_rounding_mb",
        "large_segment_size_mb",
        "garbage_collection_threshold",
        "roundup_power2_divisions",
        "expandable_segments",
        "pinned_use_background_threads",
        "pinned_max_cached_size_mb",
    ]
)
_VALUES = st.sampled_from(
    [
        "0",
        "1",
        "4",
        "10",
        "11",
        "19",
        "20",
        "21",
        "40",
        "256",
        "0.5",
        "1.0",
        "-1",
        "1e-310",
        "True",
        "true",
        "False",
        "3",
        "x",
        "",
        ">",
        "[",
        "]",
    ]
)
_BRACKET = st.lists(
    st.tuples(
        st.sampled_from(["1", "2", "256", "512", "3", ">", "0", "x"]),
        st.sampled_from([":", ",", ""]),
        _VALUES,
    ),
    max_size=4,
).map(lambda entries: "[" + ",".join(b + sep + v for b, sep, v in entries))
_ENTRY = st.tuples(
    _ACCEL_KEYS,
    st.sampled_from([":", ":", ":", ",", ""]),
    st.one_of(_VALUES, _BRACKET, _BRACKET.map(lambda t: t + "]")),
).map("".join)
_ACCEL_STRINGS = st.lists(_ENTRY, max_size=4).flatmap(
    lambda entries: st.sampled_from([",", ",", ":", ",,"]).map(lambda sep: sep.join(entries))
)


@pytest.mark.skipif(
    _torch_parser() is None, reason="needs torch >= 2.12 with the accelerator parser"
)
@settings(max_examples=400, deadline=None)
@given(_ACCEL_STRINGS)
def test_accepts_exactly_what_installed_torch_accepts(text):
    """Differential: torch's own AcceleratorAllocatorConfig accepts the same strings."""
    setter = _torch_parser()
    try:
        try:
            setter(text)
            torch_ok = True
        except (RuntimeError, ValueError, IndexError):
            torch_ok = False
    finally:
        setter("large_segment_size_mb:20")  # large_segment_size is sticky; put it back
        setter("")
    try:
        parse_quiet(text)
        ours_ok = True
    except ConfigError as exc:
        ours_ok = False
        # A CPU build registers no CUDA config hook, so torch skips unknown keys there.
        assume("Unrecognized key" not in str(exc))
    assert ours_ok == torch_ok, text


def test_coerce_reads_none_strings_and_configs():
    """coerce: None is the default config, a string is parsed, a config passes through."""
    config = AllocatorConfig.parse("expandable_segments:True")
    assert AllocatorConfig.coerce(None) == AllocatorConfig()
    assert AllocatorConfig.coerce(config) is config
    assert AllocatorConfig.coerce("max_split_size_mb:128").max_split_size_bytes == 128 * 2**20
    with pytest.raises(ConfigError, match="max_split_size_mb"):
        AllocatorConfig.coerce("max_split_size_mb:2")


# ---------------------------------------------------------------------- backends (issue 16 item 6)


@pytest.mark.parametrize("version", [None, "2.0", "2.4", "2.8", "2.9", "2.13"])
@pytest.mark.parametrize(
    "text",
    [
        "backend:cudaMallocAsync",
        "max_split_size_mb:128,backend:cudaMallocAsync",
        " backend : cudaMallocAsync ",
    ],
)
def test_cudamallocasync_is_refused_for_simulation(text, version):
    """backend:cudaMallocAsync is refused by name: oomkit would simulate the native allocator."""
    with pytest.raises(ConfigError, match=r"backend:cudaMallocAsync, which oomkit does not simulate.*Remove backend:cudaMallocAsync"):
        AllocatorConfig.parse(text, version)


def test_cudamallocasync_is_refused_from_the_environment():
    """from_env reads the variable for a simulation, so it refuses cudaMallocAsync too."""
    with pytest.raises(ConfigError, match="does not simulate"):
        AllocatorConfig.from_env({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})


@pytest.mark.parametrize("version", [None, "2.4", "2.9"])
def test_backend_native_is_accepted_and_the_default(version):
    """backend:native is what PyTorch runs without the key: it parses to the default config."""
    assert AllocatorConfig.parse("backend:native", version) == AllocatorConfig()
    assert AllocatorConfig().backend == "native"
    assert AllocatorConfig.parse("backend:native,expandable_segments:True", version) == (
        AllocatorConfig(expandable_segments=True)
    )


def test_native_only_false_accepts_what_pytorch_accepts():
    """native_only=False (a real process will run it) keeps cudaMallocAsync as PyTorch reads it."""
    assert AllocatorConfig.parse("backend:cudaMallocAsync", native_only=False).backend == (
        "cudaMallocAsync"
    )


def test_the_simulator_refuses_a_cudamallocasync_record():
    """A record built with backend='cudaMallocAsync' is refused by the simulator, not run as native."""
    from oomkit.core.allocator import CachingAllocator

    config = AllocatorConfig(backend="cudaMallocAsync")
    with pytest.raises(ConfigError, match="does not simulate"):
        CachingAllocator(config)
