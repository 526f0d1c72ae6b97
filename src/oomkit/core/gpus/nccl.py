"""NCCL's own device memory: the buffers of each communicator, outside PyTorch's allocator.

NCCL allocates its connection buffers with ``cudaMalloc`` / ``cuMem*`` itself, so they never show
in ``torch.cuda.memory_reserved()`` but do come off the device's free memory. Every figure here is
read from NCCL's source (NVIDIA/nccl 2.30.7, commit 5067397c; the same protocol buffer sizes since
NCCL 2.12); what depends on the topology NCCL finds at run time (how many channels) is an
estimate, stated as such in :attr:`NcclMemory.lines`.

Per communicator of more than one rank, on this rank:

- **Ring channels** (what all-gather, reduce-scatter and all-reduce run on): each channel
  connects this rank to the next (a send connection) and from the previous (a receive
  connection); src/transport/p2p.cc ``p2pSendSetup`` sizes a send connection as
  ``sizeof(ncclSendMem)`` plus the SIMPLE buffer when P2P read is used, ``p2pRecvSetup`` a
  receive connection as ``sizeof(ncclRecvMem)`` plus the LL and LL128 buffers (and SIMPLE when
  not read), each rounded up to ``CUDA_IPC_MIN`` (2 MiB, src/include/comm.h). With or without
  P2P read, a channel holds one 2 MiB-rounded send and one receive connection.
- **NVLS** (NVLink SHARP, NVSwitch systems from sm90): src/transport/nvls.cc
  ``ncclNvlsBufferSetup`` allocates ``nvlsChannels * 2 * (chunkSize * NCCL_STEPS) * nHeads``
  bytes of multicast-backed memory (16 channels on sm90, 24 on a single-node sm100:
  ``NVLS_NCHANNELS_SM90`` / ``NVLS_NCHANNELS_SM100_NVL``; chunk 128 KiB: ``NVLS_CHUNKSIZE``).
  ``NCCL_NVLS_ENABLE=0`` turns it off.

Point-to-point buffers (send/recv, pipeline parallel) are connected only when send/recv runs, and
NCCL 2.22+ connects each algorithm at its first use (``NCCL_RUNTIME_CONNECT=1``, src/init.cc), so
a layout of FSDP / TP / DP collectives holds the ring (and, where chosen, NVLS) buffers.

Beside the buffers, each communicator costs a fixed amount, and a process's first one more:
measured on an H200 (NCCL 2.28.9, torch 2.11.0+cu130, CUDA 13.0;
``scripts/validate_fidelity_on_gpu.py``, validation/fidelity-nvidia-h200-torch2.11.0.json probe
``nccl-one-rank``: device memory outside the caching allocator before and after each
communicator's first collective), a one-rank communicator, which connects no buffers, took
585,105,408 bytes as the process's first and 406,847,488 and 408,944,640 bytes as the second and
third. oomkit counts the mean of the further ones per communicator and the first one's excess
once per process. It is measured for one rank only: that a communicator of more ranks costs the
same beside its buffers is an assumption (NVIDIA/nccl#964 reports 544-688 MB per communicator of
2-4 A100s with an older NCCL, buffers included).
"""

from __future__ import annotations

from dataclasses import dataclass

from oomkit.core.gpus.spec import GpuSpec
from oomkit.errors import ConfigError

__all__ = [
    "COMMUNICATOR_FIXED_BYTES",
    "DEFAULT_GPUS_PER_NODE",
    "NCCL_SOURCE",
    "NCCL_VERSION",
    "PROCESS_FIXED_BYTES",
    "NcclCommunicator",
    "NcclMemory",
    "NcclSettings",
    "communicators_of",
    "nccl_memory",
]

# The NCCL release every figure here is read from, as ``torch.cuda.nccl.version()`` gives it: what
# a recording answers a script that asks (cuda_device.py), the NCCL whose memory it models.
NCCL_VERSION = (2, 30, 7)
NCCL_SOURCE = f"NVIDIA/nccl {'.'.join(map(str, NCCL_VERSION))} (commit 5067397c)"

# GPUs in one node (NVLink domain) unless stated: the 8-GPU HGX/DGX boards the catalog's
# data-centre parts ship on (NVIDIA DGX H100/H200 user guides: 8 GPUs over NVSwitch). Ranks of a
# communicator within a node share it; a job of more ranks spans nodes of this many.
DEFAULT_GPUS_PER_NODE = 8

_MIB = 1 << 20
# src/include/device.h: NCCL_STEPS, the LL / LL128 thread and line counts.
_NCCL_STEPS = 8
# src/init.cc DEFAULT_LL_BUFFSIZE: NCCL_LL_LINES_PER_THREAD (8) * NCCL_LL_MAX_NTHREADS (512)
# * NCCL_STEPS * sizeof(union ncclLLFifoLine) (16).
LL_BUFFSIZE_BYTES = 8 * 512 * _NCCL_STEPS * 16
# src/init.cc DEFAULT_LL128_BUFFSIZE: NCCL_LL128_ELEMS_PER_THREAD (120)
# * NCCL_LL128_MAX_NTHREADS (640) * NCCL_STEPS * sizeof(uint64_t).
LL128_BUFFSIZE_BYTES = 120 * 640 * _NCCL_STEPS * 8
# src/init.cc DEFAULT_BUFFSIZE (1 << 22, "4MiB"); NCCL_BUFFSIZE overrides it (computeBuffSizes).
SIMPLE_BUFFSIZE_BYTES = 1 << 22
# validation/fidelity-nvidia-h200-torch2.11.0.json nccl-one-rank (NCCL 2.28.9): device memory the
# second and third one-rank communicators added (406,847,488 and 408,944,640 bytes), averaged, and
# what the process's first added beyond that (585,105,408 bytes in all).
COMMUNICATOR_FIXED_BYTES = (406_847_488 + 408_944_640) // 2
PROCESS_FIXED_BYTES = 585_105_408 - COMMUNICATOR_FIXED_BYTES
_FIXED_SOURCE = (
    "measured on an H200 with NCCL 2.28.9, one-rank communicators "
    "(validation/fidelity-nvidia-h200-torch2.11.0.json nccl-one-rank)"
)
# src/include/comm.h: struct ncclSendMem / ncclRecvMem are padded to MEM_ALIGN (4096) bytes.
_CONNECTION_HEADER_BYTES = 4096
# src/include/comm.h CUDA_IPC_MIN: p2p.cc rounds each connection's buffer up to it.
_IPC_ALIGN_BYTES = 2 * _MIB
# src/transport/nvls.cc NCCL_PARAM(NvlsChunkSize, "NVLS_CHUNKSIZE", 128 * 1024).
_NVLS_CHUNK_BYTES = 128 * 1024
# src/transport/nvls.cc NVLS_MEM_ALIGN_SIZE (1 << 21): NVLS buffers are rounded to 2 MiB at least.
_NVLS_ALIGN_BYTES = 2 * _MIB

# Ring channels NCCL's topology search settles on (src/graph/search.cc ncclTopoCompute, then
# src/graph/connect.cc ncclTopoPostset duplicates them). Not a constant of NCCL's: figures from
# its ``NCCL_DEBUG=INFO`` lines ("32 coll channels") on 8-GPU NVSwitch nodes; ``NCCL_MIN_NCHANNELS``
# / ``NCCL_MAX_NCHANNELS`` bound it (MAXCHANNELS 64, src/include/device.h).
_RING_CHANNELS_NVSWITCH_SM90 = 32
_RING_CHANNELS_NVSWITCH_SM80 = 24
# PCIe GPUs without NVLink: an estimate with no measured figure behind it yet (a ring over PCIe
# gets few channels); ``parallel.nccl_ring_channels`` replaces it.
_RING_CHANNELS_PCIE = 4


def _align(size_bytes: int, alignment_bytes: int) -> int:
    return -(-size_bytes // alignment_bytes) * alignment_bytes


@dataclass(frozen=True)
class NcclSettings:
    """The NCCL environment of a job, where it changes memory.

    Attributes:
        buffsize_bytes: ``NCCL_BUFFSIZE`` (the SIMPLE protocol's buffer per connection);
            ``None``: NCCL's 4 MiB.
        nvls_enable: ``NCCL_NVLS_ENABLE`` (``False``: 0; ``True``: 1); ``None``: NCCL's default
            (2: on where the system supports it).
        ring_channels: ring channels per communicator (``NCCL_MIN_NCHANNELS`` =
            ``NCCL_MAX_NCHANNELS``); ``None``: the estimate for the GPU.
        avoid_record_streams: ``TORCH_NCCL_AVOID_RECORD_STREAMS`` (torch before 2.8:
            ProcessGroupNCCL stashes tensors instead of ``record_stream``); ``None``: unset.
        gpus_per_node: GPUs in one node (NVLink domain), for which ranks of a communicator share
            a node.
    """

    buffsize_bytes: int | None = None
    nvls_enable: bool | None = None
    ring_channels: int | None = None
    avoid_record_streams: bool | None = None
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE

    def __post_init__(self) -> None:
        if self.buffsize_bytes is not None and self.buffsize_bytes < _NCCL_STEPS:
            raise ConfigError(
                f"NCCL_BUFFSIZE must be at least {_NCCL_STEPS} bytes (NCCL splits it into "
                f"{_NCCL_STEPS} steps); got {self.buffsize_bytes}. Example: 4194304"
            )
        if self.ring_channels is not None and not 1 <= self.ring_channels <= 64:
            raise ConfigError(
                f"ring channels must be in [1, 64] (NCCL's MAXCHANNELS); got {self.ring_channels}"
            )
        if self.gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node must be at least 1; got {self.gpus_per_node}")


@dataclass(frozen=True)
class NcclCommunicator:
    """One NCCL communicator this rank belongs to.

    Attributes:
        name: the mesh dimension it serves (``"fsdp"``, ``"tp"``, ``"dp"``).
        ranks: ranks in the communicator.
        local_ranks: of those, ranks on this rank's node (NVLink domain).
    """

    name: str
    ranks: int
    local_ranks: int


@dataclass(frozen=True)
class NcclMemory:
    """NCCL's device memory on one rank.

    Attributes:
        total_bytes: the sum of ``lines``.
        lines: ``(what, bytes, source)`` per communicator and buffer kind.
        notes: where the figure may differ from a real run, and by how much.
    """

    total_bytes: int
    lines: tuple[tuple[str, int, str], ...]
    notes: tuple[str, ...]


def communicators_of(
    degrees: tuple[tuple[str, int], ...], gpus_per_node: int = DEFAULT_GPUS_PER_NODE
) -> tuple[NcclCommunicator, ...]:
    """The communicators a device mesh makes: one per dimension of more than one rank.

    Args:
        degrees: ``(name, size)`` per mesh dimension, outermost first (``ParallelLayout``'s
            ``mesh_shape`` order: dp, fsdp, tp); the innermost varies fastest over ranks.
        gpus_per_node: GPUs in a node.

    Returns:
        The communicators, in mesh order (torch/distributed/device_mesh.py
        ``_init_process_groups``: a process group per dimension; a 1-D mesh over the world
        uses the default group, one communicator as well).
    """
    out: list[NcclCommunicator] = []
    stride = 1
    for name, size in reversed(degrees):
        if size > 1:
            local = max(1, min(size, gpus_per_node // stride)) if stride <= gpus_per_node else 1
            out.append(NcclCommunicator(name, size, local))
        stride *= size
    return tuple(reversed(out))


def _nvswitch_node(gpu: GpuSpec) -> bool | None:
    """Whether ``gpu`` is an SXM part on an NVSwitch node; ``None``: not known (a bare size)."""
    if gpu.compute_capability is None:
        return None
    name = " ".join((gpu.name, *gpu.aliases)).lower()
    if "pcie" in name or "nvl" in name.replace("nvlink", ""):
        return False
    datacenter = ("a100", "h100", "h200", "h800", "a800", "gh200", "b200", "b100", "gb200")
    return any(part in name for part in datacenter)


def nccl_memory(
    communicators: tuple[NcclCommunicator, ...],
    gpu: GpuSpec,
    settings: NcclSettings | None = None,
) -> NcclMemory:
    """NCCL's device memory on one rank for ``communicators`` on ``gpu``.

    Args:
        communicators: what :func:`communicators_of` returns.
        gpu: the device (its compute capability and kind choose channels and NVLS).
        settings: the NCCL environment; ``None``: NCCL's defaults.

    Returns:
        The total and a line per communicator and buffer kind, with their sources.
    """
    settings = settings or NcclSettings()
    simple = SIMPLE_BUFFSIZE_BYTES if settings.buffsize_bytes is None else settings.buffsize_bytes
    nvswitch = _nvswitch_node(gpu)
    assumed = nvswitch is None
    if assumed:
        nvswitch = True  # a bare size: the published multi-GPU runs are on NVSwitch nodes
    cc = gpu.compute_capability or (9, 0)
    if settings.ring_channels is not None:
        channels, channel_source = settings.ring_channels, "NCCL_MIN/MAX_NCHANNELS as given"
    elif nvswitch and cc >= (9, 0):
        channels, channel_source = _RING_CHANNELS_NVSWITCH_SM90, "estimate (NVSwitch, sm90+)"
    elif nvswitch:
        channels, channel_source = _RING_CHANNELS_NVSWITCH_SM80, "estimate (NVSwitch, sm80)"
    else:
        channels, channel_source = _RING_CHANNELS_PCIE, "estimate (PCIe)"
    # p2p.cc p2pSendSetup / p2pRecvSetup, P2P read (NVLink, sm80+): SIMPLE on the send side.
    read = nvswitch and cc >= (8, 0)
    send = _align(_CONNECTION_HEADER_BYTES + (simple if read else 0), _IPC_ALIGN_BYTES)
    low_latency = LL_BUFFSIZE_BYTES + LL128_BUFFSIZE_BYTES
    recv = _align(_CONNECTION_HEADER_BYTES + low_latency + (0 if read else simple), _IPC_ALIGN_BYTES)
    lines: list[tuple[str, int, str]] = []
    connected = [comm for comm in communicators if comm.ranks >= 2]
    if connected:
        lines.append(("NCCL in this process (its first communicator's extra: device code, "
                      "process-wide state)", PROCESS_FIXED_BYTES, _FIXED_SOURCE))
    for comm in connected:
        lines.append((f"NCCL {comm.name} communicator ({comm.ranks} ranks): fixed cost beside "
                      "its buffers", COMMUNICATOR_FIXED_BYTES, _FIXED_SOURCE))
        ring = channels * (send + recv)
        lines.append((
            f"NCCL {comm.name} communicator ({comm.ranks} ranks): {channels} ring channels x "
            f"({send // _MIB} MiB send + {recv // _MIB} MiB receive)",
            ring,
            f"{NCCL_SOURCE} src/transport/p2p.cc p2pSendSetup/p2pRecvSetup, src/init.cc "
            f"computeBuffSizes; channels: {channel_source}",
        ))
        nvls_on = settings.nvls_enable is not False and nvswitch and cc >= (9, 0)
        if nvls_on and comm.local_ranks >= 2:
            nvls_channels = 16 if cc < (10, 0) else 24  # nvls.cc ncclNvlsTuning
            heads = comm.local_ranks  # nvls.cc ncclNvlsBufferSetup: nHeads (single node)
            nvls = _align(
                nvls_channels * 2 * _NVLS_CHUNK_BYTES * _NCCL_STEPS * heads, _NVLS_ALIGN_BYTES
            )
            lines.append((
                f"NCCL {comm.name} communicator: NVLS buffers ({nvls_channels} channels x 2 x "
                f"{_NVLS_CHUNK_BYTES * _NCCL_STEPS // _MIB} MiB x {heads} heads)",
                nvls,
                f"{NCCL_SOURCE} src/transport/nvls.cc ncclNvlsBufferSetup, ncclNvlsTuning "
                "(NCCL_NVLS_ENABLE=0 removes it)",
            ))
    notes = [
        "NCCL's ring channel count comes from its topology search at run time (here "
        f"{channels}: {channel_source}); each channel is {(send + recv) // _MIB} MiB, so the "
        "ring figure scales with it (NCCL_DEBUG=INFO prints 'N coll channels')",
    ]
    if any("NVLS" in line[0] for line in lines):
        notes.append(
            "NVLS buffers are set up when NCCL first picks an NVLS algorithm (may be never: then "
            "0); the multicast allocation may round up further (cuMulticastGetGranularity)"
        )
    if assumed:
        notes.append(
            f"{gpu.name} is a size without a GPU kind: NCCL memory assumes an NVSwitch node of "
            "sm90 GPUs (give a catalog GPU to refine it)"
        )
    notes.append(
        "NCCL before 2.22 (NCCL_RUNTIME_CONNECT absent: torch 2.6 and older bundle 2.21) connects "
        "its tree channels at init as well: up to about the ring figure again per communicator"
    )
    if connected:
        notes.append(
            "NCCL's fixed cost per communicator was measured with NCCL 2.28.9 on one-rank "
            "communicators (an H200); other NCCL versions and communicators of more ranks may "
            "differ; NCCL_RUNTIME_CONNECT=0 adds NET shared buffers (512 MiB on one rank with "
            "2.28.9, NVIDIA/nccl#2363)"
        )
    notes.append(
        "not counted: communicators the job makes beyond its mesh (the default process group's, "
        "once a collective or barrier runs on it), and split communicators that share buffers "
        "(NCCL_COMM_SPLIT_SHARE_RESOURCES)"
    )
    return NcclMemory(sum(line[1] for line in lines), tuple(lines), tuple(notes))
