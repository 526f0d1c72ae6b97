"""The NCCL environment as scenario fields: read into the Target, priced as NCCL's buffers."""

from __future__ import annotations

import pytest

from oomkit.core.gpus.nccl import COMMUNICATOR_FIXED_BYTES, PROCESS_FIXED_BYTES, NcclSettings
from oomkit.errors import ScenarioError
from oomkit.prediction.distributed_memory import nccl_of
from oomkit.scenario.files import scenario_from_data
from oomkit.scenario.target import nccl_settings_of, target_of

MIB = 1 << 20
# NCCL's measured fixed costs for one communicator in a process (core/gpus/nccl.py).
FIXED = PROCESS_FIXED_BYTES + COMMUNICATOR_FIXED_BYTES


def _scenario(parallel: dict[str, object]) -> object:
    return scenario_from_data({"model": {"preset": "llama3-8b"}, "parallel": parallel})


def test_nccl_fields_reach_the_target_and_its_nccl_bytes() -> None:
    """parallel.nccl_buffsize=1MiB and nccl_nvls_enable=false: 32 channels x 8 MiB on an H100,
    beside the fixed costs."""
    scenario = _scenario({"fsdp": 8, "nccl_buffsize": "1MiB", "nccl_nvls_enable": False})
    target = target_of(scenario.target, scenario.parallel)  # type: ignore[attr-defined]
    assert target.nccl == NcclSettings(buffsize_bytes=MIB, nvls_enable=False)
    memory, counted_bytes = nccl_of(target)
    assert memory is not None
    assert memory.total_bytes == counted_bytes == FIXED + 32 * (2 * MIB + 6 * MIB)


def test_no_nccl_field_means_nccls_defaults() -> None:
    """Without NCCL fields the target carries no settings; the defaults price FSDP 8's buffers
    at 640 MiB, beside the fixed costs."""
    scenario = _scenario({"fsdp": 8})
    assert nccl_settings_of(scenario.parallel) is None  # type: ignore[attr-defined]
    target = target_of(scenario.target, scenario.parallel)  # type: ignore[attr-defined]
    memory, _ = nccl_of(target)
    assert memory is not None and memory.total_bytes == FIXED + 640 * MIB


def test_context_overhead_given_includes_nccl() -> None:
    """--context-overhead states all memory outside PyTorch: NCCL is listed, not taken again."""
    scenario = scenario_from_data(
        {"model": {"preset": "llama3-8b"}, "parallel": {"fsdp": 8},
         "target": {"context_overhead_bytes": "1GiB"}}
    )
    target = target_of(scenario.target, scenario.parallel)
    memory, counted_bytes = nccl_of(target)
    assert memory is not None and memory.total_bytes == FIXED + 640 * MIB
    assert counted_bytes == 0


def test_bad_nccl_channels_name_the_field() -> None:
    """nccl_ring_channels outside NCCL's [1, 64] is refused where the scenario is read."""
    with pytest.raises(ScenarioError, match="nccl_ring_channels: must be at most 64"):
        _scenario({"fsdp": 8, "nccl_ring_channels": 65})
