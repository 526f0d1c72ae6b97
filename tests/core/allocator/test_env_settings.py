"""settings_from_environ: which variable each release reads (ref §9.1), as a record."""

from __future__ import annotations

import pytest

from oomkit.core.allocator.env_settings import scan_backend, settings_from_environ

MiB = 2**20


def test_nothing_set_is_the_default_config():
    """An empty environment: no variable read, PyTorch's defaults."""
    env = settings_from_environ({}, "2.13")
    assert env.read_from is None and env.text == "" and env.backend == "native"
    assert env.config is not None and env.config.max_split_size_bytes is None
    assert [v.status for v in env.variables] == ["unset", "unset", "unset"]


def test_2_9_reads_the_unified_name_first_and_marks_the_cuda_name_deprecated():
    """CFG-2.9: PYTORCH_ALLOC_CONF wins; the CUDA name is shadowed (and deprecated)."""
    env = settings_from_environ(
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"},
        "2.9.1",
    )
    assert env.read_from == "PYTORCH_ALLOC_CONF"
    assert env.config is not None and env.config.max_split_size_bytes == 128 * MiB
    cuda = env.variable("PYTORCH_CUDA_ALLOC_CONF")
    assert (cuda.status, cuda.deprecated) == ("shadowed", True)
    assert [v.name for v in env.variables] == [
        "PYTORCH_ALLOC_CONF",
        "PYTORCH_CUDA_ALLOC_CONF",
        "PYTORCH_HIP_ALLOC_CONF",
    ]


def test_2_13_reads_the_cuda_name_first_again():
    """MAIN26 order (>= 2.12): PYTORCH_CUDA_ALLOC_CONF wins over PYTORCH_ALLOC_CONF."""
    env = settings_from_environ(
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"},
        "2.13",
    )
    assert env.read_from == "PYTORCH_CUDA_ALLOC_CONF"
    assert env.config is not None and env.config.max_split_size_bytes == 256 * MiB
    assert env.variable("PYTORCH_ALLOC_CONF").status == "shadowed"


def test_2_4_never_reads_the_unified_name():
    """<= 2.8 reads only PYTORCH_CUDA_ALLOC_CONF: the unified name is 'not_read'."""
    env = settings_from_environ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, "2.4")
    assert env.read_from is None
    assert env.config is not None and env.config.expandable_segments is False
    assert env.variable("PYTORCH_ALLOC_CONF").status == "not_read"


def test_a_rejected_string_is_an_error_not_an_exception():
    """A string PyTorch rejects gives config None and PyTorch's objection."""
    env = settings_from_environ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:5"}, "2.13")
    assert env.config is None
    assert env.error is not None and "max_split_size_mb" in env.error


def test_backend_is_scanned_before_parsing():
    """backend:cudaMallocAsync is found by the load-time scan; the native parser is not run."""
    env = settings_from_environ(
        {"PYTORCH_CUDA_ALLOC_CONF": " max_split_size_mb:128 , backend : cudaMallocAsync"}, "2.13"
    )
    assert (env.backend, env.config, env.error) == ("cudaMallocAsync", None, None)
    assert scan_backend("expandable_segments:True") == "native"


def test_no_caching_variable_is_reported():
    """PYTORCH_NO_CUDA_MEMORY_CACHING (any value) is named as disabling the cache."""
    env = settings_from_environ({"PYTORCH_NO_CUDA_MEMORY_CACHING": "0"}, "2.13")
    assert env.caching_disabled_by == "PYTORCH_NO_CUDA_MEMORY_CACHING"


def test_a_bad_version_is_a_config_error():
    """An unreadable torch version raises ConfigError (an OomkitError)."""
    from oomkit.errors import ConfigError

    with pytest.raises(ConfigError, match="version"):
        settings_from_environ({}, "two point nine")
