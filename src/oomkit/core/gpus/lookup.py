"""Finding a device: ``get_gpu("h100")``, ``get_gpu("24GiB")`` and ``list_gpus()``."""

from __future__ import annotations

import dataclasses
import difflib
import re

from oomkit.core.gpus import overhead
from oomkit.core.gpus.catalog import CATALOG
from oomkit.core.gpus.spec import GpuSpec, GpuSpecError
from oomkit.errors import UnknownGpuError
from oomkit.units import SizeError, SizeTooLargeError, format_bytes, parse_bytes

__all__ = ["NOT_MODELLED", "UnknownGpuError", "get_gpu", "list_gpus", "normalize_gpu_name"]

# Words that name the vendor or brand rather than the device: "NVIDIA GeForce RTX 4090" as
# torch.cuda.get_device_name() prints it must find "rtx4090".
_NOISE_WORDS = frozenset({"nvidia", "geforce", "tesla"})
# A size needs a unit: a bare "4090" is a GPU name, not 4090 bytes.
_SIZE_WITH_UNIT_RE = re.compile(r"^\s*(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*[A-Za-z]+\s*$")
# A size written another way (a sign, an exponent) with a byte unit: meant as a size, not a name.
_SIZE_LIKE_RE = re.compile(r"^\s*[-+]?\.?[0-9][0-9.eE+-]*\s*(?:[kKmMgGtT]i?[bB]|[bB])\s*$")
_MAX_SUGGESTIONS = 3

_ROCM_REASON = (
    "is an AMD GPU, which oomkit does not model. PyTorch's ROCm build runs the same caching "
    "allocator (c10/cuda/CUDACachingAllocator.cpp, hipified into HIPCachingAllocator), with "
    "ROCm-specific branches (`USE_ROCM`: its CUDA driver-API paths are compiled out), and the "
    "recorder emulates what CUDA libraries allocate "
    "(cuBLAS/cuBLASLt workspaces, flash/cuDNN attention, the CUDA context), where ROCm runs "
    "hipBLASLt, AOTriton and Composable Kernel with workspaces of their own: a prediction would "
    "not be faithful. Replaying a snapshot recorded on it (`oomkit replay/simulate/tune "
    "--gpu SIZE`) uses the allocator alone: give its memory size, e.g. --gpu 192GB."
)
# Names users give that the catalog deliberately leaves out, with why (normalized name -> reason).
NOT_MODELLED: dict[str, str] = {
    key: f"{name} {_ROCM_REASON}"
    for name, keys in (
        ("MI300X", ("mi300x", "amdinstinctmi300x", "instinctmi300x")),
        ("MI250X", ("mi250x", "amdinstinctmi250x")),
        ("MI325X", ("mi325x", "amdinstinctmi325x")),
    )
    for key in keys
}


def normalize_gpu_name(text: str) -> str:
    """The lookup key of a name: lowercase, without vendor words, spaces, dashes or dots.

    ``normalize_gpu_name("NVIDIA H100-SXM") == "h100sxm"``.
    """
    words = re.split(r"[^0-9a-z]+", text.lower())
    return "".join(word for word in words if word and word not in _NOISE_WORDS)


def _build_index() -> dict[str, GpuSpec]:
    index: dict[str, GpuSpec] = {}
    for spec in CATALOG:
        for key in {normalize_gpu_name(spec.name), *map(normalize_gpu_name, spec.aliases)}:
            assert index.get(key, spec) is spec, f"alias {key!r} names two GPUs"
            index[key] = spec
    return index


_INDEX = _build_index()


def list_gpus() -> tuple[GpuSpec, ...]:
    """Every GPU in the built-in catalog, oldest architecture first."""
    return CATALOG


def get_gpu(
    name_or_size: str | GpuSpec, *, context_overhead_bytes: int | None = None
) -> GpuSpec:
    """Look up a GPU by name or alias, or make a generic one from a memory size.

    Names match ignoring case, spaces, dashes, underscores and the words NVIDIA/GeForce/Tesla,
    so ``"h100"``, ``"H100-SXM"`` and ``"NVIDIA H100 80GB HBM3"`` are the same device. A size
    with a unit (``"24GiB"``, ``"80GB"``) is taken as the ``total_memory`` PyTorch would
    report and gets the default context overhead (~400 MiB).

    Args:
        name_or_size: a catalog name or alias, a size such as ``24GiB``, or a ``GpuSpec``
            (returned as is, with the override applied).
        context_overhead_bytes: replaces the spec's estimated CUDA context size, in bytes
            (e.g. a measurement: ``nvidia-smi`` used minus ``torch.cuda.memory_reserved()``).

    Returns:
        The matching ``GpuSpec``, with the override applied.

    Raises:
        UnknownGpuError: the text is neither a known GPU nor a size with a unit, or names a GPU
            oomkit does not model (``NOT_MODELLED``: AMD GPUs; the message says why).
        GpuSpecError: the override is not a whole number of bytes, is negative or is not
            below the total memory.
    """
    if context_overhead_bytes is not None and (
        isinstance(context_overhead_bytes, bool) or not isinstance(context_overhead_bytes, int)
    ):
        raise GpuSpecError(
            f"context_overhead_bytes must be a whole number of bytes; got "
            f"{context_overhead_bytes!r}. Example: context_overhead_bytes=512 * 2**20"
        )
    if isinstance(name_or_size, GpuSpec):
        spec = name_or_size
    elif not isinstance(name_or_size, str):
        raise UnknownGpuError(
            f"a GPU is a catalog name (e.g. 'h100'), a memory size ('24GiB') or a GpuSpec; got "
            f"{name_or_size!r}. `oomkit gpus` lists the catalog"
        )
    else:
        key = normalize_gpu_name(name_or_size)
        if key in NOT_MODELLED:
            raise UnknownGpuError(NOT_MODELLED[key])
        known = _INDEX.get(key)
        spec = known if known is not None else _custom_spec(name_or_size, context_overhead_bytes)
    if context_overhead_bytes is not None:
        spec = dataclasses.replace(
            spec,
            context_overhead_bytes=context_overhead_bytes,
            source_notes=(
                *spec.source_notes,
                f"context overhead: {format_bytes(context_overhead_bytes)} given by the caller",
            ),
        )
    return spec


def _custom_spec(text: str, context_overhead_bytes: int | None = None) -> GpuSpec:
    if not _SIZE_WITH_UNIT_RE.match(text):
        if _SIZE_LIKE_RE.match(text):
            raise UnknownGpuError(
                f"{text.strip()!r} is not a GPU memory size oomkit reads: give a positive number "
                "and a unit, without a sign or an exponent, e.g. 24GiB or 80GB."
            )
        raise UnknownGpuError(_unknown_message(text))
    try:
        total_bytes = parse_bytes(text)
    except SizeTooLargeError as exc:
        raise UnknownGpuError(str(exc)) from None
    except SizeError:
        raise UnknownGpuError(_unknown_message(text)) from None
    return GpuSpec(
        name=f"custom {format_bytes(total_bytes)}",
        total_memory_bytes=total_bytes,
        # The override, where given, is checked against the size here (a small custom size may
        # be below the default estimate); get_gpu records its note.
        context_overhead_bytes=(
            overhead.context_overhead_bytes(None)
            if context_overhead_bytes is None
            else context_overhead_bytes
        ),
        source_notes=(
            f"total memory: {text.strip()!r} given by the caller, taken as what "
            "torch.cuda.get_device_properties().total_memory reports",
            overhead.context_overhead_note(None),
        ),
    )


def _unknown_message(text: str) -> str:
    key = normalize_gpu_name(text)
    # Family prefixes such as "a100" or "v100" are deliberately not aliases (the variants differ
    # by up to 40 GiB), so entries whose name starts with the text come first, then near misses.
    prefixed = [
        spec.name for spec in CATALOG if key and normalize_gpu_name(spec.name).startswith(key)
    ]
    close = [_INDEX[k].name for k in difflib.get_close_matches(key, list(_INDEX), n=10, cutoff=0.6)]
    names = list(dict.fromkeys([*prefixed, *close]))[: max(_MAX_SUGGESTIONS, len(prefixed))]
    if names:
        suggestion = "Did you mean " + ", ".join(repr(name) for name in names) + "?"
    elif re.fullmatch(r"\s*[0-9.]+\s*", text):
        suggestion = "A memory size needs a unit."
    else:
        suggestion = "No catalog GPU has a similar name."
    return (
        f"unknown GPU {text!r}. {suggestion} "
        "`oomkit gpus` lists the catalog (Python: oomkit.core.gpus.list_gpus()); or give the "
        "device's memory size instead: `--gpu 24GiB` also works."
    )
