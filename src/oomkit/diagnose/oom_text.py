"""Reading the numbers out of a PyTorch CUDA out-of-memory error text.

A user pastes whatever the job printed: one line, a wrapped log, a traceback, several ranks'
errors. ``parse_oom_text`` finds each OOM message and returns its figures as bytes. Every
message variant PyTorch has printed is recognised (../shared/ref/cuda-caching-allocator.md §12):

- ``native``: 2.2+ ``GPU 0 has a total capacity of ... of which ... is free. ... Of the allocated
  memory ... is allocated by PyTorch, and ... is reserved by PyTorch but unallocated.``, with the
  optional NVML process sentences, the ``allowed`` (memory fraction) clause and the private-pool
  clause; 2.1 writes ``capacty``.
- ``classic``: <= 2.0 ``(GPU 0; ... total capacity; ... already allocated; ... free; [... allowed;]
  ... reserved in total by PyTorch)``; <= 1.4 said ``... cached``: reserved minus allocated up to
  1.3, the reserved total in 1.4 (``_classic`` tells them apart where the numbers can).
- ``exa``: a request of 2^60 bytes or more (NativeCachingAllocator / CudaMallocAsyncAllocator
  ``allocate``).
- ``cuda_malloc_async``: ``backend:cudaMallocAsync`` (CUDAMallocAsyncAllocator.cpp mallocAsync:
  ``Allocation on device N would exceed allowed memory. (out of memory)`` and five figures).
- ``fraction_rejected``: newer PyTorch's preemptive rejection under a memory fraction
  (``throw_on_cudamalloc_oom``; ref §12.4).
- ``driver``: a bare ``CUDA error: out of memory`` from a CUDA call outside the caching allocator
  (context creation, cuBLAS/cuDNN handles, NCCL), which carries no figures; NCCL's ``Cuda
  failure 'out of memory'`` and the libraries' ``CUBLAS_STATUS_ALLOC_FAILED`` (cuDNN, cuSOLVER,
  cuSPARSE, cuFFT alike) are the same failure.

Sizes in these texts come from ``format_size`` (§12.1): two decimals of bytes, KiB, MiB or GiB,
so a parsed figure is within half a unit of the last digit of the truth;
``OomText.tolerance_bytes`` says how far.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from oomkit._lazy import LazyPattern
from oomkit.errors import OomTextError

__all__ = [
    "OomText",
    "OomTextVariant",
    "ProcessMemory",
    "decode_log",
    "failed_library",
    "find_oom_texts",
    "parse_oom_text",
]

OomTextVariant = Literal[
    "native", "classic", "exa", "cuda_malloc_async", "fraction_rejected", "driver"
]

# format_size (CUDACachingAllocator.cpp, ref §12.1) units.
_UNIT_BYTES = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|KiB|MiB|GiB)"
_ANY_SIZE = r"\d+(?:\.\d+)? ?(?:bytes|KiB|MiB|GiB)"


# No device memory figure exceeds 2**64 bytes (CUDA sizes are size_t; cudaMallocAsync prints its
# unset limit, SIZE_MAX, as 17179869184.00 GiB); a longer figure is a
# corrupted or hand-made text. The digit bound is checked first: Python refuses to convert
# integers of more than 4300 digits and turns long decimals into inf.
_MAX_FIGURE_BYTES = 2**64
_MAX_FIGURE_DIGITS = 24


def _size(number: str, unit: str) -> tuple[int, int]:
    """A ``format_size`` figure as (bytes, tolerance in bytes).

    Raises:
        OomTextError: the figure is 2**64 bytes or more.
    """
    scale = _UNIT_BYTES[unit]
    digits = len(number.partition(".")[0].lstrip("0"))
    value = 0 if digits > _MAX_FIGURE_DIGITS else round(float(number) * scale)
    if digits > _MAX_FIGURE_DIGITS or value > _MAX_FIGURE_BYTES:
        shown = number if len(number) <= 24 else f"{number[:12]}...{number[-6:]}"
        raise OomTextError(
            f"the out-of-memory message holds a figure of {shown} {unit} ({digits} digits), "
            "more than 2**64 bytes, which no device has: the text is corrupted or was not "
            "printed by PyTorch. Paste the message as PyTorch printed it"
        )
    if unit == "bytes":
        return int(number.partition(".")[0]), 0
    # Two decimals: the truth is within half of 0.01 of the unit.
    return value, scale // 200


@dataclass(frozen=True)
class ProcessMemory:
    """One NVML sentence of the message: a process and the device memory it uses.

    ``pid`` is None for the sentence about the process that raised the error ("Including
    non-PyTorch memory, this process has ...").
    """

    pid: int | None
    used_bytes: int


@dataclass(frozen=True)
class OomText:
    """The figures of one out-of-memory message, in bytes; None where the variant lacks one.

    Attributes:
        variant: which message family it is (see the module docstring).
        text: the message as found, whitespace collapsed.
        device: the device index.
        requested_bytes: "Tried to allocate": for the native allocator the size of the segment it
            could not get (a 5 MiB request reports 20 MiB, ref §12.2), for cudaMallocAsync the
            request itself.
        total_bytes: the device's total memory (cudaMemGetInfo).
        free_bytes: device memory free at the time (cudaMemGetInfo), all processes included.
        allocated_bytes: bytes in tensors the caching allocator handed out (``memory_allocated``);
            private-pool figures are subtracted where the message gives them.
        reserved_bytes: bytes the caching allocator holds from the driver (``memory_reserved``).
        private_pool_bytes: free cached bytes in private pools (CUDA graphs), 0 if not stated.
        allowed_bytes: the per-process limit from ``set_per_process_memory_fraction``, if set.
        processes: the NVML per-process sentences (2.2+ with NVML available).
        torch_versions: the PyTorch releases that print this wording.
        tolerance_bytes: for each figure above, how far the parsed value may be from the truth.
    """

    variant: OomTextVariant
    text: str
    device: int | None = None
    requested_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    private_pool_bytes: int = 0
    allowed_bytes: int | None = None
    processes: tuple[ProcessMemory, ...] = ()
    torch_versions: str = ""
    tolerance_bytes: Mapping[str, int] = field(default_factory=dict)

    @property
    def reserved_unallocated_bytes(self) -> int | None:
        """Reserved by PyTorch but not in tensors: the cache, where fragmentation lives."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes - self.private_pool_bytes

    @property
    def outside_allocator_bytes(self) -> int | None:
        """Device memory used by anything but this process's caching allocator.

        total - free - reserved: the CUDA context and kernels, cuBLAS/NCCL buffers, other
        processes. 0 at least.
        """
        if None in (self.total_bytes, self.free_bytes, self.reserved_bytes):
            return None
        assert self.total_bytes is not None and self.free_bytes is not None
        assert self.reserved_bytes is not None
        return max(0, self.total_bytes - self.free_bytes - self.reserved_bytes)


# --- one pattern per variant, over whitespace-collapsed text -----------------------------------
# Each compiled when first matched: `oomkit explain SNAPSHOT` builds an OomText, never parses one
# (issue 41 item 4: start-up).

# ROCm builds print the same text with "HIP" for "CUDA" (hipify of CUDACachingAllocator.cpp).
_NATIVE = LazyPattern(
    r"(?:CUDA|HIP) out of memory\. Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total "
    r"(capacity|capacty) of " + _SIZE + r" of which " + _SIZE + r" is free\. "
    r"(?P<procs>(?:(?:Including non-PyTorch memory, this process|Process \d+) has "
    + _ANY_SIZE
    + r" memory in use\. )*)"
    r"(?:" + _SIZE + r" allowed; )?"
    r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, "
    r"(?:with " + _SIZE + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?"
    r"and " + _SIZE + r" is reserved by PyTorch but unallocated\."
)
_PROCESS = LazyPattern(
    r"(?:Including non-PyTorch memory, this process|Process (\d+)) has "
    + _SIZE
    + r" memory in use\."
)
_CLASSIC = LazyPattern(
    r"(?:CUDA|HIP) out of memory\. Tried to allocate "
    + _SIZE
    + r" \(GPU (\d+); "
    + _SIZE
    + r" total capacity; "
    + _SIZE
    + r" already allocated; "
    + _SIZE
    + r" free; "
    # A copy-paste often loses the closing parenthesis.
    r"(?:" + _SIZE + r" allowed; )?" + _SIZE + r" (reserved in total by PyTorch|cached)\)?"
)
_EXA = LazyPattern(r"CUDA out of memory\. Tried to allocate more than 1EB memory\.")
_ASYNC = LazyPattern(
    r"Allocation on device (\d+) would exceed allowed memory\. \(out of memory\) "
    r"Currently allocated ?: "
    + _SIZE
    + r" Requested ?: "
    + _SIZE
    + r" Device limit ?: "
    + _SIZE
    + r" Free \(according to CUDA\) ?: "
    + _SIZE
    + r" PyTorch limit \(set by user-supplied memory fraction\) ?: "
    + _SIZE
)
_REJECTED = LazyPattern(
    r"CUDA out of memory\. Allocation was preemptively rejected because it would exceed "
    r"per_process_memory_fraction limit\. Requested size: " + _SIZE
)
# The CUDA runtime's and driver's own error (torch's C10_CUDA_CHECK / C10_CUDA_DRIVER_CHECK),
# NCCL's (its CUDACHECK: "Cuda failure 'out of memory'", with the error number from NCCL 2.19)
# and the CUDA libraries' allocation failures (torch's TORCH_CUDABLAS_CHECK, cuDNN's, cuSOLVER's,
# cuSPARSE's and cuFFT's status names).
_DRIVER = LazyPattern(
    r"CUDA (?:driver )?error: out of memory|Cuda failure (?:\d+ )?'out of memory'"
    r"|(?:CUBLAS|CUDNN|CUSOLVER|CUSPARSE)_STATUS_ALLOC_FAILED|CUFFT_ALLOC_FAILED"
)
# Who failed, by a driver-variant message: a library's status name, or NCCL's CUDACHECK.
_WHO_FAILED = (
    ("CUBLAS_", "here cuBLAS, creating its handle or workspace"),
    ("CUDNN_", "here cuDNN"),
    ("CUSOLVER_", "here cuSOLVER"),
    ("CUSPARSE_", "here cuSPARSE"),
    ("CUFFT_", "here cuFFT, planning a transform"),
    ("Cuda failure", "here NCCL, allocating its buffers"),
)


def failed_library(text: str) -> str | None:
    """Who ran out of memory in a ``driver`` message's text (``"here cuBLAS, ..."``), where it
    names one; ``None`` for the runtime's or driver's own error."""
    return next((said for mark, said in _WHO_FAILED if mark in text), None)


# The first sentences of a native message (2.1+), which a paste of its first line keeps: without
# the rest, how the device's memory splits between PyTorch's tensors, its cache and everything
# else is not known, and that split is the diagnosis (parse_oom_text says so).
_NATIVE_HEAD = LazyPattern(
    r"(?:CUDA|HIP) out of memory\. Tried to allocate " + _SIZE + r"\."
    r"(?: GPU (\d+) has a total (?:capacity|capacty) of " + _SIZE + r" of which " + _SIZE
    + r" is free\.)?"
)

# Log decorations at the start of a line that a copy-paste keeps: comment marks and quotes.
_LINE_PREFIX = LazyPattern(r"^[ \t]*(?:#+|//|>+)[ \t]?", re.MULTILINE)


# Terminal escapes a coloured log keeps (ECMA-48 CSI and OSC sequences, and two-byte escapes).
_ANSI = LazyPattern(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_SPACES = LazyPattern(r"\s+")


def _normalise(text: str) -> str:
    # Regex passes, not str.split(): a 50 MB log must not become millions of word objects.
    return _SPACES.sub(" ", _LINE_PREFIX.sub("", _ANSI.sub("", text))).strip()


class _Figures:
    """Collects parsed sizes with their tolerances."""

    def __init__(self) -> None:
        self.tolerance: dict[str, int] = {}

    def take(self, name: str, number: str | None, unit: str | None) -> int | None:
        if number is None or unit is None:
            return None
        value, tolerance = _size(number, unit)
        self.tolerance[name] = tolerance
        return value


def _native(m: re.Match[str]) -> OomText:
    g = m.groups()
    f = _Figures()
    requested = f.take("requested_bytes", g[0], g[1])
    total = f.take("total_bytes", g[4], g[5])
    free = f.take("free_bytes", g[6], g[7])
    processes = tuple(
        ProcessMemory(int(p.group(1)) if p.group(1) else None, _size(p.group(2), p.group(3))[0])
        for p in _PROCESS.finditer(m.group("procs"))
    )
    allowed = f.take("allowed_bytes", g[9], g[10])
    by_pytorch = f.take("allocated_bytes", g[11], g[12])
    private = f.take("private_pool_bytes", g[13], g[14]) or 0
    unallocated = f.take("reserved_bytes", g[15], g[16])
    assert by_pytorch is not None and unallocated is not None
    # "Of the allocated memory AL+P is allocated by PyTorch, [with P in private pools,] and
    # R-AL-P is reserved by PyTorch but unallocated" (ref §12.3): R = (AL+P) + (R-AL-P).
    tolerance = f.tolerance
    tolerance["reserved_bytes"] = tolerance["reserved_bytes"] + tolerance["allocated_bytes"]
    tolerance["allocated_bytes"] += tolerance.get("private_pool_bytes", 0)
    return OomText(
        variant="native",
        text=m.group(0),
        device=int(g[2]),
        requested_bytes=requested,
        total_bytes=total,
        free_bytes=free,
        allocated_bytes=by_pytorch - private,
        reserved_bytes=by_pytorch + unallocated,
        private_pool_bytes=private,
        allowed_bytes=allowed,
        processes=processes,
        # 2.1 misspells "capacity" (ref §12.3).
        torch_versions="2.1" if g[3] == "capacty" else ">=2.2",
        tolerance_bytes=tolerance,
    )


def _classic(m: re.Match[str]) -> OomText:
    g = m.groups()
    f = _Figures()
    cached = g[13] == "cached"
    allocated = f.take("allocated_bytes", g[5], g[6])
    last = f.take("reserved_bytes", g[11], g[12])
    assert allocated is not None and last is not None
    total = f.take("total_bytes", g[3], g[4])
    assert total is not None
    if cached and allocated + last <= total + f.tolerance["total_bytes"]:
        # "N cached" meant two things. THCCachingAllocator (1.0-1.3) printed the memory the
        # allocator holds but the program does not use (pytorch/pytorch PR #13751, which wrote
        # the message: '"cached": memory held by the allocator but not used by the program'),
        # i.e. reserved - allocated: real messages read "6.64 GiB already allocated; 21.00 MiB
        # free; 150.86 MiB cached". 1.4's rewritten allocator printed its reserved total under
        # the same word. Reserved - allocated is read unless allocated + cached would exceed the
        # device (then only the 1.4 reading fits).
        last += allocated
        f.tolerance["reserved_bytes"] += f.tolerance["allocated_bytes"]
    return OomText(
        variant="classic",
        text=m.group(0),
        device=int(g[2]),
        requested_bytes=f.take("requested_bytes", g[0], g[1]),
        total_bytes=total,
        allocated_bytes=allocated,
        free_bytes=f.take("free_bytes", g[7], g[8]),
        allowed_bytes=f.take("allowed_bytes", g[9], g[10]),
        reserved_bytes=last,
        torch_versions="<=1.4" if cached else "1.5-2.0",
        tolerance_bytes=f.tolerance,
    )


def _cuda_malloc_async(m: re.Match[str]) -> OomText:
    g = m.groups()
    f = _Figures()
    return OomText(
        variant="cuda_malloc_async",
        text=m.group(0),
        device=int(g[0]),
        # pytorch_used_bytes: bytes in live allocations; cudaMallocAsync keeps no cache PyTorch
        # can see, so allocated is all PyTorch holds.
        allocated_bytes=f.take("allocated_bytes", g[1], g[2]),
        requested_bytes=f.take("requested_bytes", g[3], g[4]),
        total_bytes=f.take("total_bytes", g[5], g[6]),
        free_bytes=f.take("free_bytes", g[7], g[8]),
        allowed_bytes=f.take("allowed_bytes", g[9], g[10]),
        torch_versions=">=1.13 (backend:cudaMallocAsync)",
        tolerance_bytes=f.tolerance,
    )


def _rejected(m: re.Match[str]) -> OomText:
    f = _Figures()
    return OomText(
        variant="fraction_rejected",
        text=m.group(0),
        requested_bytes=f.take("requested_bytes", m.group(1), m.group(2)),
        torch_versions="newer than 2.13 (throw_on_cudamalloc_oom)",
        tolerance_bytes=f.tolerance,
    )


_PARSERS = (
    (_NATIVE, _native),
    (_CLASSIC, _classic),
    (_ASYNC, _cuda_malloc_async),
    (_REJECTED, _rejected),
    (_EXA, lambda m: OomText("exa", m.group(0), requested_bytes=2**60, torch_versions="all")),
    (_DRIVER, lambda m: OomText("driver", m.group(0), torch_versions="all")),
)


# Every message holds one of these; only the text around them is normalised and matched, so a
# 50 MB log costs one fast scan (the pattern starts with a literal) instead of six full ones.
_ANCHOR = LazyPattern(r"(?:out|exceed)\s+(?:of|allowed)\s+memory|_ALLOC_FAILED")
_BEFORE_CHARS = 400  # "Allocation on device N would " precedes its anchor; escapes and prefixes too
_AFTER_CHARS = 8000  # the figures, NVML's process sentences and the async message's lines


def _windows(text: str) -> list[tuple[int, int]]:
    """The stretches of ``text`` around each anchor, overlapping ones merged, in order."""
    spans: list[tuple[int, int]] = []
    for m in _ANCHOR.finditer(text):
        start, end = max(0, m.start() - _BEFORE_CHARS), m.end() + _AFTER_CHARS
        if spans and start <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], end))
        else:
            spans.append((start, end))
    return spans


def _find_in(flat: str) -> list[tuple[int, int, OomText]]:
    found: list[tuple[int, int, OomText]] = []
    for pattern, build in _PARSERS:
        for m in pattern.finditer(flat):
            if any(start <= m.start() < end for start, end, _ in found):
                continue
            found.append((m.start(), m.end(), build(m)))
    return sorted(found, key=lambda item: item[0])


def find_oom_texts(text: str) -> list[OomText]:
    """Every out-of-memory message in ``text``, in order of appearance.

    A log of several ranks holds several messages. A bare ``CUDA error: out of memory`` counts
    only where no richer message covers the same place.
    """
    out: list[OomText] = []
    for start, end in _windows(text):
        out.extend(parsed for _, _, parsed in _find_in(_normalise(text[start:end])))
    return out


def parse_oom_text(text: str) -> OomText:
    """The first out-of-memory message in ``text`` (an error line, a traceback or a whole log).

    Raises:
        OomTextError: no message PyTorch prints for an out-of-memory error is in the text.
    """
    found = find_oom_texts(text)
    if not found and "MPS backend out of memory" in text[:_MPS_SCAN_CHARS]:
        raise OomTextError(
            "this is the out-of-memory message of Apple's MPS backend; oomkit explains CUDA's "
            "(and ROCm's) caching allocator, whose rules MPS does not follow. On a Mac, "
            "PYTORCH_MPS_HIGH_WATERMARK_RATIO sets the limit the message names"
        )
    if not found:
        cut = _cut_message(text)
        if cut is not None:
            raise OomTextError(cut)
        snippet = " ".join(text[:4000].split())[:80]  # repr() below shows escapes as written
        raise OomTextError(
            "no CUDA out-of-memory message found in the text"
            + (f" (it begins {snippet!r})" if snippet else " (it is empty)")
            + ". Paste the whole error, from 'torch.OutOfMemoryError: CUDA out of memory.' to the "
            "end of that message, or explain a snapshot file instead"
        )
    return found[0]


_MPS_SCAN_CHARS = 1 << 20  # an MPS message is looked for in a log's first MiB only


def _cut_message(text: str) -> str | None:
    """What to say of a native message cut after its first sentences; None where there is none."""
    for start, end in _windows(text):
        m = _NATIVE_HEAD.search(_normalise(text[start:end]))
        if m is None:
            continue
        said = f"a request of {m.group(1)} {m.group(2)} failed"
        if m.group(3) is not None:
            said += (
                f" on GPU {m.group(3)} with {m.group(6)} {m.group(7)} free of "
                f"{m.group(4)} {m.group(5)}"
            )
            requested, _ = _size(m.group(1), m.group(2))
            total, _ = _size(m.group(4), m.group(5))
            if requested > total:
                return (
                    f"the out-of-memory message is cut short, but what it keeps shows the cause: "
                    f"{said}, a request larger than the whole device, which no setting or cache "
                    "behaviour can serve. Check the shape of the tensor being created (a batch "
                    "dimension multiplied twice, an attention matrix over a whole document, a "
                    "wrong view); paste the whole message for the full report"
                )
        return (
            f"the out-of-memory message is cut short: it says {said}, but not how much of the "
            "device PyTorch had allocated and reserved, which is what tells a real shortage from "
            "fragmentation or memory held outside PyTorch. Paste the whole message, up to '... "
            "is reserved by PyTorch but unallocated.', or explain a snapshot file instead"
        )
    return None


_UTF16_BOMS = {b"\xff\xfe": "utf-16-le", b"\xfe\xff": "utf-16-be"}
# Bytes sampled to tell UTF-16 without a byte-order mark: ASCII text in UTF-16 has a NUL in
# every other byte, which UTF-8 text (and a UTF-8 log with stray bytes) never has.
_SNIFF_BYTES = 4096


def _utf16_encoding(data: bytes) -> str | None:
    """``utf-16-le`` / ``utf-16-be`` where ``data`` looks like UTF-16 text, else None."""
    bom = _UTF16_BOMS.get(data[:2])
    if bom is not None:
        return bom
    head = data[: _SNIFF_BYTES - _SNIFF_BYTES % 2]
    if len(head) < 4:
        return None
    even, odd = head[0::2].count(0), head[1::2].count(0)
    half = len(head) // 2
    # ASCII-range text: the high byte of each unit is NUL (odd bytes little-endian).
    if odd >= 0.9 * half and even < 0.1 * half:
        return "utf-16-le"
    if even >= 0.9 * half and odd < 0.1 * half:
        return "utf-16-be"
    return None


def decode_log(data: bytes) -> str:
    """A log's bytes as text: UTF-8 read leniently, or UTF-16 where the bytes are UTF-16.

    PowerShell's ``>`` redirect (Windows PowerShell 5.1's ``Out-File`` default) writes
    UTF-16 LE with a byte-order mark; a log without one is recognised by its NUL bytes. UTF-16
    is used only where the UTF-8 reading holds no OOM message and the UTF-16 reading does
    (a UTF-8 log may begin with the bytes of a mark by chance).
    """
    text = data.decode("utf-8", errors="replace")
    encoding = _utf16_encoding(data)
    if encoding is None or _ANCHOR.search(text) is not None:
        return text
    wide = data[2:] if data[:2] in _UTF16_BOMS else data
    decoded = wide[: len(wide) - len(wide) % 2].decode(encoding, errors="replace")
    return decoded if _ANCHOR.search(decoded) is not None else text
