"""`--dp --compile` with a bucket cap under 1 MiB: refused as torch's DDPOptimizer refuses it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.errors import ConfigError
from oomkit.interfaces.cli import main

torch = pytest.importorskip("torch")

# torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (torch/csrc/distributed/c10d/reducer.hpp
# kDefaultFirstBucketBytes): the DDPOptimizer's first bucket, 1 MiB.
FIRST_BUCKET_MB = 1.0


def test_a_cap_under_the_first_bucket_exits_2_with_one_line(tiny_llama, capsys):
    """--bucket-cap-mb 0.05 --compile: exit 2, one line naming the flag, the field and the
    torch rule (the DDPOptimizer's assertion), where it was a traceback from torch."""
    code = main(["predict", "llama3-8b", "--dp", "2", "--compile", "--bucket-cap-mb", "0.05",
                 "--batch", "1", "--seq", "16", "--steps", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("oomkit: error:")]
    assert len(lines) == 1
    assert "--bucket-cap-mb 0.05 (parallel.bucket_cap_mb) with --compile" in lines[0]
    assert "DDPOptimizer.__init__: First bucket should be smaller/equal" in lines[0]
    assert "Use --bucket-cap-mb 1 or more, or drop --compile" in lines[0]


@settings(max_examples=40, deadline=None)
@given(cap_mb=st.floats(min_value=1e-6, max_value=64.0, allow_nan=False))
def test_refused_exactly_where_the_ddp_optimizer_asserts(cap_mb):
    """Any cap: refused when DDP's bytes for it (int(cap * 2**20)) are under 1 MiB, accepted
    from 1 MiB on, as torch's own DDPOptimizer constructor decides."""
    from oomkit.prediction.models.data_parallel import _check_ddp_optimizer_accepts

    assert torch.distributed._DEFAULT_FIRST_BUCKET_BYTES == FIRST_BUCKET_MB * 2**20
    if int(cap_mb * 2**20) < 2**20:
        with pytest.raises(ConfigError, match=r"refuses a smaller bucket cap"):
            _check_ddp_optimizer_accepts(cap_mb)
    else:
        _check_ddp_optimizer_accepts(cap_mb)


def test_eager_ddp_keeps_any_cap(tiny_llama, capsys):
    """Without --compile no DDPOptimizer is made: the same small cap records."""
    code = main(["predict", "llama3-8b", "--dp", "2", "--bucket-cap-mb", "0.05",
                 "--batch", "1", "--seq", "16", "--steps", "2"])
    assert code == 0
    assert "oomkit: error:" not in capsys.readouterr().err
