"""The PyTorch version table (ref §0, §3.6, §6, §7, §9, §12, Appendix A)."""

from __future__ import annotations

import dataclasses

import pytest

from oomkit.core.allocator.versions import (
    NEWEST_RELEASED_TORCH,
    TorchBehaviour,
    behaviour_for,
    config_key_since,
    parse_torch_version,
)
from oomkit.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.4", (2, 4)),
        ("2.4.1", (2, 4)),
        ("2.4.0+cu121", (2, 4)),
        ("2.6.0a0+git123", (2, 6)),
        ("2.5.0rc1", (2, 5)),
        ("2.6.0.dev20240101", (2, 6)),
        ("2.10.0+cpu", (2, 10)),
        ("1.13.1", (1, 13)),
        (" 2.9.1 ", (2, 9)),
        ("main", (2, 15)),
        ("nightly", (2, 15)),
        ("Nightly", (2, 15)),
        (None, (2, 14)),
    ],
)
def test_parse_torch_version(text, expected):
    """Release, local, pre-release and dev suffixes are dropped; main/nightly is newest."""
    assert parse_torch_version(text) == expected
    assert behaviour_for(text).version == expected


@pytest.mark.parametrize("text", ["", "2", "two.four", "2.x", "latest", "2.4-cu121!", "v"])
def test_unreadable_version_is_config_error(text):
    """A version string that is not major.minor[...] names the text and shows an example."""
    with pytest.raises(ConfigError, match=r"cannot read PyTorch version .*Example: torch_version="):
        behaviour_for(text)


def test_non_string_version_is_config_error():
    """A number is not a version string."""
    with pytest.raises(ConfigError, match="must be a string"):
        behaviour_for(2.4)  # type: ignore[arg-type]


def test_newest_released_is_none():
    """None models NEWEST_RELEASED_TORCH (2.14)."""
    assert NEWEST_RELEASED_TORCH == "2.14"
    assert behaviour_for(None) == behaviour_for("2.14.1")


def test_behaviour_is_frozen():
    """TorchBehaviour is a frozen record."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        behaviour_for("2.4").version = (2, 5)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "last_without", "first_with"),
    [
        ("tie_break_by_creation_order", "2.11", "2.12"),  # §3.6, PR #183591 (assumed 2.12)
        ("configurable_large_segment_size", "2.11", "2.12"),  # PR #172056 (assumed 2.12)
        ("runtime_resets_non_split_rounding", "2.11", "2.12"),  # §9.1 MAIN26 only
        ("fraction_limit_only_below_one", "2.11", "2.12"),  # §7 / §9.5 MAIN26
        ("configurable_non_split_rounding", "2.5", "2.6"),  # PR #136174
        ("max_split_size_min_inclusive", "2.7", "2.8"),  # §9.3: <= 2.7 "> 20"
        ("roundup_fill_after_last", "2.8", "2.9"),  # §9.3 `>` fill
        ("roundup_bracket_form", "1.13", "2.0"),  # Appendix A
        ("gc_skips_expandable", "2.4", "2.5"),  # PR #134338
        ("has_alloc_conf_env", "2.8", "2.9"),  # §9.1
        ("has_per_process_memory_fraction_key", "2.8", "2.9"),  # §9.3
        ("pool_scopes_newest_first", "2.11", "2.12"),  # §3.5 MAIN26 get_pool
        ("release_skips_only_real_capture", "2.11", "2.12"),  # §4 step 9 / §5.3 MAIN26
        ("mempool_use_on_oom", "2.7", "2.8"),  # §3.5 / Appendix A (≈2.8)
        ("mempool_no_split", "2.11", "2.12"),  # §3.5 / §4 step 11 MAIN26
        ("oom_rejection", "2.11", "2.12"),  # §4 step 6.3 / §12.4 MAIN26
        ("empty_cache_per_pool", "2.11", "2.12"),  # MAIN26 emptyCache(mempool_id)
    ],
)
def test_boolean_fields_switch_at_their_release(field, last_without, first_with):
    """Each version-dependent flag turns on at the release the ref names."""
    assert getattr(behaviour_for(last_without), field) is False
    assert getattr(behaviour_for(first_with), field) is True
    assert getattr(behaviour_for("main"), field) is True


def test_alloc_conf_expandable_bug_only_in_2_9():
    """Issue #183387 is modelled for 2.9 only."""
    assert behaviour_for("2.9.1").alloc_conf_ignores_expandable_segments is True
    assert behaviour_for("2.8").alloc_conf_ignores_expandable_segments is False
    assert behaviour_for("2.10").alloc_conf_ignores_expandable_segments is False


@pytest.mark.parametrize(
    ("version", "env_vars", "deprecated"),
    [
        ("2.4", ("PYTORCH_CUDA_ALLOC_CONF",), ()),
        ("2.8", ("PYTORCH_CUDA_ALLOC_CONF",), ()),
        (
            "2.9",
            ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"),
            ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"),
        ),
        (
            "2.11",
            ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"),
            ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"),
        ),
        ("2.12", ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"), ()),
        (None, ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"), ()),
    ],
)
def test_env_var_order(version, env_vars, deprecated):
    """§9.1: the order flips at 2.9 (CFG-2.9) and back in MAIN26."""
    b = behaviour_for(version)
    assert b.env_vars == env_vars
    assert b.deprecated_env_vars == deprecated


@pytest.mark.parametrize(
    ("version", "variant"),
    [("1.13", "classic"), ("2.0", "classic"), ("2.1", "v2_1"), ("2.2", "v2_2"), ("2.14", "v2_2")],
)
def test_oom_message_variant(version, variant):
    """§12.3: classic <= 2.0, the 'capacty' text in 2.1, the current text from 2.2."""
    assert behaviour_for(version).oom_message_variant == variant
    assert behaviour_for(version).oom_message_variant == variant


@pytest.mark.parametrize(
    ("version", "parser", "message"),
    [
        ("2.4", "legacy", "Unrecognized CachingAllocator option: foo"),
        ("2.8", "legacy", "Unrecognized CachingAllocator option: foo"),
        ("2.9", "tokenizer", "Unrecognized key 'foo' in CUDA allocator config."),
        ("2.14", "tokenizer", "Unrecognized key 'foo' in Accelerator allocator config."),
    ],
)
def test_parser_kind_and_unknown_key_wording(version, parser, message):
    """§9.2: lexArgs before 2.9, ConfigTokenizer after; the unknown-key text by version."""
    b = behaviour_for(version)
    assert b.config_parser == parser
    assert b.unknown_key_message.format(key="foo") == message


@pytest.mark.parametrize(
    ("key", "absent_in", "present_in"),
    [
        ("max_split_size_mb", "1.9", "1.10"),
        ("roundup_power2_divisions", "1.11", "1.12"),
        ("garbage_collection_threshold", "1.11", "1.12"),
        ("backend", "1.13", "2.0"),
        ("expandable_segments", "2.0", "2.1"),
        ("max_non_split_rounding_mb", "2.5", "2.6"),
        ("per_process_memory_fraction", "2.8", "2.9"),
        ("graph_capture_record_stream_reuse", "2.8", "2.9"),
        ("large_segment_size_mb", "2.11", "2.12"),
        ("throw_on_cudamalloc_oom", "2.11", "2.12"),
    ],
)
def test_config_keys_by_version(key, absent_in, present_in):
    """§9.3 / Appendix A: each key is accepted from its release on."""
    assert key not in behaviour_for(absent_in).config_keys
    assert key in behaviour_for(present_in).config_keys
    assert config_key_since(key) == parse_torch_version(present_in)


def test_unknown_key_has_no_since():
    """A key no release accepts has no first release."""
    assert config_key_since("expandable_segments_reserve") is None


def test_one_record_per_release_is_cached():
    """behaviour_for builds each release's record once: the simulator and parser share it."""
    for version in ("2.4", "2.10", "2.14", "main", None):
        assert behaviour_for(version) is behaviour_for(version)
    assert behaviour_for("2.4.0+cu121") is behaviour_for("2.4")


def test_every_field_is_explicit():
    """No field has a default: every release states every fact (no getattr fallbacks)."""
    fields = dataclasses.fields(TorchBehaviour)
    assert all(f.default is dataclasses.MISSING for f in fields)
    assert all(f.default_factory is dataclasses.MISSING for f in fields)
    assert len(fields) == 24
    # The fields the simulator reads as rules.* (caching_allocator, settings, stats, oom_message).
    simulator = {
        "version",
        "tie_break_by_creation_order",
        "configurable_non_split_rounding",
        "configurable_large_segment_size",
        "fraction_limit_only_below_one",
        "oom_message_variant",
        "oom_docs_url",
        "pool_scopes_newest_first",
        "release_skips_only_real_capture",
        "mempool_use_on_oom",
        "mempool_no_split",
        "oom_rejection",
        "empty_cache_per_pool",
    }
    assert simulator <= {f.name for f in fields}


@pytest.mark.parametrize(
    ("version", "url"),
    [
        ("2.7", "https://pytorch.org/docs/stable/notes/cuda.html#environment-variables"),
        (
            "2.8",
            "https://docs.pytorch.org/docs/stable/notes/cuda.html"
            "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf",
        ),
    ],
)
def test_oom_docs_url(version, url):
    """§12.3: the docs.pytorch.org link from 2.8 (real 2.8+ OOM logs show it)."""
    assert behaviour_for(version).oom_docs_url == url


def test_version_text():
    """Messages name a release as major.minor."""
    assert behaviour_for("2.4.0+cu121").version_text == "2.4"
    assert behaviour_for("main").version_text == "2.15"
