"""NCCL's device memory per communicator: exact bytes from NCCL's buffer rules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oomkit.core.gpus import get_gpu
from oomkit.core.gpus.nccl import (
    COMMUNICATOR_FIXED_BYTES,
    LL128_BUFFSIZE_BYTES,
    LL_BUFFSIZE_BYTES,
    PROCESS_FIXED_BYTES,
    SIMPLE_BUFFSIZE_BYTES,
    NcclCommunicator,
    NcclSettings,
    communicators_of,
    nccl_memory,
)
from oomkit.errors import ConfigError

MIB = 1 << 20
HEADER = 4096  # comm.h: ncclSendMem / ncclRecvMem padded to MEM_ALIGN
# The H200's one-rank communicators (NCCL 2.28.9): the first 585,105,408 bytes, then
# 406,847,488 and 408,944,640.
FIXED_ONE = PROCESS_FIXED_BYTES + COMMUNICATOR_FIXED_BYTES


def buffers(memory) -> list[int]:
    """The buffer lines' bytes (the fixed costs left out)."""
    return [n for what, n, _ in memory.lines if "fixed cost" not in what and "process" not in what]


def align2(n: int) -> int:
    return -(-n // (2 * MIB)) * (2 * MIB)


def test_protocol_buffers_are_nccls_defaults() -> None:
    """LL 8*512*8*16, LL128 120*640*8*8 and SIMPLE 4 MiB (init.cc DEFAULT_*_BUFFSIZE)."""
    assert LL_BUFFSIZE_BYTES == 524_288
    assert LL128_BUFFSIZE_BYTES == 4_915_200
    assert SIMPLE_BUFFSIZE_BYTES == 4_194_304


def test_h100_fsdp8_ring_and_nvls_bytes() -> None:
    """H100 (NVSwitch, P2P read): 32 channels x (6 MiB send + 6 MiB receive) + NVLS 16*2*1 MiB*8."""
    memory = nccl_memory((NcclCommunicator("fsdp", 8, 8),), get_gpu("h100"))
    send = align2(HEADER + SIMPLE_BUFFSIZE_BYTES)  # 6 MiB: SIMPLE on the send side (read)
    recv = align2(HEADER + LL_BUFFSIZE_BYTES + LL128_BUFFSIZE_BYTES)  # 6 MiB
    assert (send, recv) == (6 * MIB, 6 * MIB)
    ring = 32 * (send + recv)
    nvls = 16 * 2 * (128 * 1024 * 8) * 8
    assert [line[1] for line in memory.lines] == [PROCESS_FIXED_BYTES, COMMUNICATOR_FIXED_BYTES,
                                                  ring, nvls]
    assert memory.total_bytes == FIXED_ONE + 384 * MIB + 256 * MIB
    assert all("nccl" in line[2].lower() for line in memory.lines)


def test_buffsize_and_nvls_enable_from_the_environment() -> None:
    """NCCL_BUFFSIZE=1 MiB shrinks the send side to 2 MiB; NCCL_NVLS_ENABLE=0 drops NVLS."""
    settings = NcclSettings(buffsize_bytes=MIB, nvls_enable=False)
    memory = nccl_memory((NcclCommunicator("fsdp", 8, 8),), get_gpu("h100"), settings)
    assert memory.total_bytes == FIXED_ONE + 32 * (2 * MIB + 6 * MIB)
    assert buffers(memory) == [32 * (2 * MIB + 6 * MIB)]


def test_pcie_gpu_keeps_simple_on_the_receive_side() -> None:
    """A PCIe GPU: no P2P read, 4 channels, receive = LL + LL128 + SIMPLE rounded to 10 MiB."""
    memory = nccl_memory((NcclCommunicator("dp", 2, 2),), get_gpu("l40s"))
    recv = align2(HEADER + LL_BUFFSIZE_BYTES + LL128_BUFFSIZE_BYTES + SIMPLE_BUFFSIZE_BYTES)
    assert recv == 10 * MIB
    assert memory.total_bytes == FIXED_ONE + 4 * (2 * MIB + recv)


def test_ring_channels_setting_scales_the_ring() -> None:
    """NCCL_MIN/MAX_NCHANNELS=8: 8 channels of 12 MiB."""
    settings = NcclSettings(ring_channels=8, nvls_enable=False)
    memory = nccl_memory((NcclCommunicator("tp", 8, 8),), get_gpu("h100"), settings)
    assert memory.total_bytes == FIXED_ONE + 8 * 12 * MIB


def test_fixed_costs_are_the_h200_measurement() -> None:
    """Per communicator the mean of the second and third one-rank communicators; once per
    process what the first took beyond that: the three measured figures add up."""
    assert COMMUNICATOR_FIXED_BYTES == 407_896_064
    assert PROCESS_FIXED_BYTES + COMMUNICATOR_FIXED_BYTES == 585_105_408
    two = nccl_memory((NcclCommunicator("fsdp", 8, 8), NcclCommunicator("tp", 8, 8)),
                      get_gpu("h100"), NcclSettings(nvls_enable=False))
    fixed = [n for what, n, _ in two.lines if n in (PROCESS_FIXED_BYTES, COMMUNICATOR_FIXED_BYTES)]
    assert fixed == [PROCESS_FIXED_BYTES, COMMUNICATOR_FIXED_BYTES, COMMUNICATOR_FIXED_BYTES]
    assert two.total_bytes == PROCESS_FIXED_BYTES + 2 * COMMUNICATOR_FIXED_BYTES + 2 * 384 * MIB
    assert all("nccl-one-rank" in source for what, _, source in two.lines if "fixed" in what)
    assert any("2.28.9" in note for note in two.notes)


def test_one_rank_holds_no_nccl_memory() -> None:
    """A communicator of one rank is not created by the mesh's collectives: nothing counted."""
    assert nccl_memory((NcclCommunicator("fsdp", 1, 1),), get_gpu("h100")).total_bytes == 0


def test_communicators_of_a_mesh() -> None:
    """One per dimension above 1; tp innermost is local, dp across nodes has 1 local rank."""
    comms = communicators_of((("dp", 4), ("fsdp", 2), ("tp", 4)), gpus_per_node=8)
    assert comms == (
        NcclCommunicator("dp", 4, 1),
        NcclCommunicator("fsdp", 2, 2),
        NcclCommunicator("tp", 4, 4),
    )
    assert communicators_of((("fsdp", 16),)) == (NcclCommunicator("fsdp", 16, 8),)


def test_bare_size_assumes_an_nvswitch_node_and_says_so() -> None:
    """--gpu 96GiB: the H100 figures, with a note that the GPU kind was assumed."""
    memory = nccl_memory((NcclCommunicator("fsdp", 8, 8),), get_gpu("96GiB"))
    assert memory.total_bytes == FIXED_ONE + 640 * MIB
    assert any("assumes an NVSwitch node" in note for note in memory.notes)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"buffsize_bytes": 4}, "NCCL_BUFFSIZE"), ({"ring_channels": 65}, "MAXCHANNELS"),
     ({"gpus_per_node": 0}, "gpus_per_node")],
)
def test_bad_settings_are_refused(kwargs: dict[str, int], match: str) -> None:
    """Settings NCCL would not run with raise ConfigError naming the setting."""
    with pytest.raises(ConfigError, match=match):
        NcclSettings(**kwargs)  # type: ignore[arg-type]


@given(
    buffsize=st.integers(min_value=8, max_value=64 * MIB),
    channels=st.integers(min_value=1, max_value=64),
    ranks=st.integers(min_value=2, max_value=64),
)
def test_ring_bytes_are_whole_ipc_pages_and_grow_with_the_buffer(
    buffsize: int, channels: int, ranks: int
) -> None:
    """Buffer lines are whole 2 MiB pages (CUDA_IPC_MIN); a bigger NCCL_BUFFSIZE never shrinks
    them; the fixed costs do not depend on the buffers."""
    comm = (NcclCommunicator("fsdp", ranks, min(ranks, 8)),)
    small = nccl_memory(comm, get_gpu("h100"), NcclSettings(buffsize, False, channels))
    big = nccl_memory(comm, get_gpu("h100"), NcclSettings(buffsize + MIB, False, channels))
    assert [n % (2 * MIB) for n in buffers(small)] == [0]
    assert channels * 4 * MIB <= sum(buffers(small)) <= sum(buffers(big))
    assert small.total_bytes - sum(buffers(small)) == FIXED_ONE
