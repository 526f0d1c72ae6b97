"""The two PyTorch settings parsers behind AllocatorConfig.parse: lexArgs (<= 2.8), ConfigTokenizer (>= 2.9)."""

from __future__ import annotations

import pytest

from oomkit.core.allocator._c_numbers import NumberError
from oomkit.core.allocator._legacy_parser import LegacyParser
from oomkit.core.allocator._tokenizer_parser import TokenizerParser
from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.versions import behaviour_for
from oomkit.errors import ConfigError

MiB = 2**20
ENV = "PYTORCH_CUDA_ALLOC_CONF"


def legacy(text, version="2.8"):
    return LegacyParser(text, behaviour_for(version), AllocatorConfig(), ENV).run()


def tokenizer(text, version="2.14"):
    return TokenizerParser(text, behaviour_for(version), AllocatorConfig(), ENV).run()


def test_each_version_names_its_parser():
    """§9.2: AllocatorConfig.parse gives the same record as the parser its version names."""
    text = "max_split_size_mb:128,roundup_power2_divisions:[256:1,>:4]"
    assert AllocatorConfig.parse(text, "2.8") == legacy(text)
    assert AllocatorConfig.parse(text, "2.14") == tokenizer(text)
    # The fill rule differs: <= 2.8 overwrites the last listed slot (8), >= 2.9 starts after it.
    assert legacy(text).roundup_power2_divisions == (1,) * 8 + (4,) * 8
    assert tokenizer(text).roundup_power2_divisions == (1,) * 9 + (4,) * 7


def test_only_the_legacy_parser_checks_separators():
    """lexArgs consumeToken checks ':' and ','; ConfigTokenizer ignores checkToken's result."""
    assert tokenizer("max_split_size_mb,128").max_split_size_bytes == 128 * MiB
    with pytest.raises(ConfigError, match=r"expected ':' after 'max_split_size_mb' but found ','"):
        legacy("max_split_size_mb,128")


def test_whitespace_each_lexer_drops():
    """lexArgs drops only ' '; ConfigTokenizer drops every C isspace character."""
    assert tokenizer("max_split_size_mb:\t1\n28").max_split_size_bytes == 128 * MiB
    # stoi skips the tab before the digits but stops at the newline: 1 MiB is below 20.
    with pytest.raises(ConfigError, match=r"max_split_size_mb must be >= 20 \(MB\); got 1"):
        legacy("max_split_size_mb:\t1\n28")


def test_integer_conversion_each_parser_uses():
    """§9.2: stoi before 2.9 (C int range), stoull from 2.9."""
    assert tokenizer("max_split_size_mb:3000000000").max_split_size_bytes == 3_000_000_000 * MiB
    with pytest.raises(ConfigError, match=r"out of the range of a C int \(stoi\)"):
        legacy("max_split_size_mb:3000000000")


def test_float_overflow_is_config_error():
    """A hex float that overflows a double is rejected like a decimal one, not an OverflowError."""
    with pytest.raises(ConfigError, match=r"'0x1p1024' is out of the range of a double \(stod\)"):
        AllocatorConfig.parse("garbage_collection_threshold:0x1p1024")


def test_number_errors_do_not_escape():
    """The parsers turn every NumberError into a ConfigError that names the key."""
    with pytest.raises(
        ConfigError, match="pinned_num_register_threads value 'x' is not an integer"
    ):
        tokenizer("pinned_num_register_threads:x")
    assert issubclass(NumberError, Exception) and not issubclass(NumberError, ConfigError)
