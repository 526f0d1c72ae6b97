"""``oomkit doctor``: the allocator settings actually in effect, and combinations that misfire.

Two sources: an environment (the live process, for a named or the installed torch) and a
snapshot (its recorded ``allocator_settings``, else what its trace implies). Each finding cites
the PyTorch rule or issue behind it (ref = ../shared/ref/cuda-caching-allocator.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from oomkit.core.allocator.config import AllocatorConfig
from oomkit.core.allocator.env_settings import (
    EnvSettings,
    scan_backend,
    settings_from_environ,
)
from oomkit.core.allocator.versions import behaviour_for
from oomkit.core.snapshot import Snapshot, infer_torch_version
from oomkit.errors import ConfigError, SnapshotFormatError

__all__ = [
    "LiveAllocator",
    "SettingsFinding",
    "SettingsReport",
    "Severity",
    "doctor_environment",
    "doctor_snapshot",
]

# "error": a setting the user gave is not applied, or the process would fail;
# "warning": it is applied but does not do what it is usually set for; "info": worth knowing.
Severity = Literal["error", "warning", "info"]

# §9.3 backend row: with cudaMallocAsync these native-only options are ignored with a warning.
_NATIVE_ONLY_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "expandable_segments",
)


@dataclass(frozen=True)
class SettingsFinding:
    """One thing the doctor found.

    Attributes:
        severity: see ``Severity``.
        what: what was found, in one sentence.
        advice: what to do about it.
        source: the PyTorch rule, source file or issue that shows it.
    """

    severity: Severity
    what: str
    advice: str
    source: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.what} {self.advice} [{self.source}]"


@dataclass(frozen=True)
class LiveAllocator:
    """What a running torch reports about its CUDA allocator (read by ``oomkit.runtime``).

    Attributes:
        torch_version: ``torch.__version__``.
        cuda_available: ``torch.cuda.is_available()``.
        backend: ``torch.cuda.get_allocator_backend()``, or None without CUDA.
        settings: ``torch.cuda.memory._snapshot()["allocator_settings"]`` where torch has it.
    """

    torch_version: str
    cuda_available: bool
    backend: str | None = None
    settings: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class SettingsReport:
    """The settings in effect and the findings about them.

    Attributes:
        source: "environment" or the snapshot file's name.
        torch_version: the release modelled, e.g. "2.9".
        torch_version_from: where that version came from ("installed torch", "--torch-version",
            "inferred from the snapshot's format", "newest release (no torch installed)").
        env: the environment's variables as that release reads them (environment only).
        settings_text: the settings string in effect ("" = PyTorch's defaults), or None when
            it is not known (a snapshot that recorded no settings).
        backend: "native", "cudaMallocAsync", ... or None when not known.
        config: the native allocator's settings in effect, or None when not known/rejected.
        implied: what the trace shows about the settings (snapshot only), e.g.
            ``{"expandable_segments": True}``.
        live: what the running allocator reports, when it could be read.
        findings: most severe first.
    """

    source: str
    torch_version: str
    torch_version_from: str
    env: EnvSettings | None
    settings_text: str | None
    backend: str | None
    config: AllocatorConfig | None
    implied: Mapping[str, Any] = field(default_factory=dict)
    live: LiveAllocator | None = None
    findings: tuple[SettingsFinding, ...] = ()

    @property
    def worst(self) -> Severity | None:
        """The most severe finding's severity, or None when there is none."""
        return self.findings[0].severity if self.findings else None


def doctor_environment(
    environ: Mapping[str, str],
    torch_version: str | None,
    *,
    torch_version_from: str,
    live: LiveAllocator | None = None,
) -> SettingsReport:
    """The settings ``torch_version`` reads from ``environ``, with findings.

    Args:
        environ: the environment to read (``os.environ`` from the CLI).
        torch_version: the release to model; None = the newest released.
        torch_version_from: where the version came from, for the report.
        live: what the running allocator reported, when it could be read.

    Raises:
        ConfigError: the version string cannot be read.
    """
    env = settings_from_environ(environ, torch_version)
    b = behaviour_for(torch_version)
    config = env.config
    findings: list[SettingsFinding] = []
    findings += _variable_findings(env)
    if env.error is not None:
        findings.append(
            SettingsFinding(
                "error",
                f"{env.read_from}={env.text!r} is rejected by torch {env.torch_version}: "
                f"{env.error}",
                "PyTorch raises this at the first CUDA allocation; fix the string.",
                "c10/cuda/CUDAAllocatorConfig.cpp parseArgs (the config parser of this release)",
            )
        )
    if config is not None and b.drops_expandable_segments(env.read_from, config.expandable_segments):
        # What runs is the string without expandable segments: show that as in effect.
        config = dataclasses.replace(config, expandable_segments=False)
        findings.append(
            SettingsFinding(
                "error",
                f"torch {env.torch_version} ignores expandable_segments set only through "
                "PYTORCH_ALLOC_CONF: the allocator runs without expandable segments.",
                "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead (or as well).",
                "pytorch/pytorch#183387",
            )
        )
    if env.caching_disabled_by is not None:
        findings.append(
            SettingsFinding(
                "warning",
                f"{env.caching_disabled_by} is set: the caching allocator is bypassed (every "
                "tensor is its own cudaMalloc), so every allocator setting is ignored and "
                "oomkit's simulation does not describe this process.",
                f"Unset {env.caching_disabled_by} unless you are debugging memory errors.",
                "c10/cuda/CUDACachingAllocator.cpp forceUncachedAllocator",
            )
        )
    findings += _setting_findings(env.text, env.backend, config, b.version)
    if live is not None:
        findings += _live_findings(live, env)
    return SettingsReport(
        source="environment",
        torch_version=env.torch_version,
        torch_version_from=torch_version_from,
        env=env,
        settings_text=env.text,
        backend=env.backend,
        config=config,
        live=live,
        findings=_ranked(findings),
    )


def doctor_snapshot(snapshot: Snapshot, torch_version: str | None = None) -> SettingsReport:
    """The settings a snapshot's process ran with: recorded ones, else what its trace implies.

    Args:
        snapshot: a loaded snapshot.
        torch_version: the release that recorded it; None = inferred from the file's format.

    Raises:
        SnapshotFormatError: the file records no settings and no trace events, so nothing can
            be said about the settings.
    """
    inferred = infer_torch_version(snapshot)
    version = torch_version or inferred
    version_from = (
        "--torch-version"
        if torch_version
        else ("inferred from the snapshot's format" if inferred else "newest release")
    )
    events = [ev for trace in snapshot.device_traces.values() for ev in trace]
    recorded = snapshot.allocator_settings
    if recorded is None and not any(ev.action != "snapshot" for ev in events):
        raise SnapshotFormatError(
            f"{snapshot.source or 'the snapshot'} records no allocator settings and no trace "
            "events, so nothing shows which settings were in effect. Record with torch >= 2.3 "
            "(snapshots then carry allocator_settings), and call "
            "torch.cuda.memory._record_memory_history() before the work you want to see."
        )
    implied: dict[str, Any] = {}
    if any(ev.action in ("segment_map", "segment_unmap") for ev in events) or any(
        seg.is_expandable for seg in snapshot.segments
    ):
        # §8.2: only expandable segments emit segment_map/segment_unmap.
        implied["expandable_segments"] = True
    elif any(ev.action == "segment_alloc" for ev in events) or snapshot.segments:
        # §8.2: expandable-only allocation never emits segment_alloc.
        implied["expandable_segments"] = False
    b = behaviour_for(version)
    findings: list[SettingsFinding] = []
    text: str | None = None
    config: AllocatorConfig | None = None
    backend: str | None = None
    if recorded is not None:
        # §11.2: "PYTORCH_CUDA_ALLOC_CONF" holds the last string parsed, whatever its variable.
        raw = recorded.get("PYTORCH_CUDA_ALLOC_CONF")
        text = raw if isinstance(raw, str) else None
        backend = scan_backend(text) if text is not None else None
        if text is not None and backend == "native":
            try:
                config = AllocatorConfig.parse(text, torch_version=version)
            except ConfigError as exc:
                findings.append(
                    SettingsFinding(
                        "warning",
                        f"the recorded settings string {text!r} does not parse under torch "
                        f"{b.version_text}'s rules: {exc}",
                        "Pass the recording's torch version with --torch-version.",
                        "c10/cuda/CUDAAllocatorConfig.cpp parseArgs",
                    )
                )
        recorded_expandable = recorded.get("expandable_segments")
        if (
            isinstance(recorded_expandable, bool)
            and "expandable_segments" in implied
            and implied["expandable_segments"] != recorded_expandable
        ):
            findings.append(
                SettingsFinding(
                    "warning",
                    f"the snapshot records expandable_segments={recorded_expandable} but its "
                    f"trace shows {'expandable' if implied['expandable_segments'] else 'classic'}"
                    " segments: the setting changed while the process ran (e.g. "
                    "torch.cuda.memory._set_allocator_settings).",
                    "Compare runs with one setting for the whole run.",
                    "torch/cuda/memory.py _set_allocator_settings (runtime changes)",
                )
            )
        if text is not None:
            findings += _setting_findings(text, backend or "native", config, b.version)
    else:
        findings.append(
            SettingsFinding(
                "info",
                "this snapshot records no allocator_settings (written before torch 2.3): the "
                "settings below are what its trace implies.",
                "Record with torch >= 2.3 to have the settings in the file.",
                "torch/cuda/memory.py _snapshot (allocator_settings since torch 2.3)",
            )
        )
    return SettingsReport(
        source=snapshot.source or "<snapshot>",
        torch_version=b.version_text,
        torch_version_from=version_from,
        env=None,
        settings_text=text,
        backend=backend,
        config=config,
        implied=implied,
        findings=_ranked(findings),
    )


def _variable_findings(env: EnvSettings) -> list[SettingsFinding]:
    out: list[SettingsFinding] = []
    for var in env.variables:
        if var.status == "shadowed":
            same = var.value == env.text
            out.append(
                SettingsFinding(
                    "info" if same else "warning",
                    f"{var.name} is set but not read: torch {env.torch_version} parses only "
                    f"{env.read_from}, the first set of "
                    f"{', '.join(v.name for v in env.variables if v.status != 'not_read')}"
                    + (" (both say the same)." if same else f", so {var.value!r} is ignored."),
                    "Put every setting in one variable (PYTORCH_CUDA_ALLOC_CONF is read by "
                    f"every release) and unset the other{'s' if env.read_from else ''}.",
                    "c10/core/AllocatorConfig.cpp: exactly one variable is parsed; variables are never merged",
                )
            )
        elif var.status == "not_read":
            out.append(
                SettingsFinding(
                    "error",
                    f"{var.name} is set but torch {env.torch_version} never reads it, so "
                    f"{var.value!r} is ignored.",
                    "Use PYTORCH_CUDA_ALLOC_CONF, which every release reads.",
                    "c10/cuda/CUDAAllocatorConfig.cpp, c10/core/AllocatorConfig.cpp (the variables each release reads)",
                )
            )
        elif var.status == "read" and var.deprecated:
            out.append(
                SettingsFinding(
                    "info",
                    f"torch {env.torch_version} reads {var.name} but prints '{var.name} is "
                    "deprecated, use PYTORCH_ALLOC_CONF instead'.",
                    "Harmless; PYTORCH_CUDA_ALLOC_CONF stays the most portable name.",
                    "pytorch/pytorch#167659",
                )
            )
    return out


def _setting_findings(
    text: str, backend: str, config: AllocatorConfig | None, version: tuple[int, int]
) -> list[SettingsFinding]:
    """Findings about the settings themselves, whatever variable or file they came from."""
    out: list[SettingsFinding] = []
    keys = {item.partition(":")[0].strip() for item in text.split(",") if item.strip()}
    if backend != "native":
        ignored = [k for k in _NATIVE_ONLY_KEYS if k in keys]
        out.append(
            SettingsFinding(
                "warning",
                f"backend:{backend} replaces PyTorch's caching allocator"
                + (f"; {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored" if ignored else "")
                + ". oomkit simulates the native allocator only, so its replays and "
                "predictions do not describe this process.",
                "Drop backend:cudaMallocAsync to use the native allocator's settings.",
                "c10/cuda/CUDAAllocatorConfig.cpp parseArgs (under cudaMallocAsync native-only options are ignored with a warning)",
            )
        )
        return out
    if config is None:
        return out
    if config.garbage_collection_threshold > 0.0:
        main26 = version >= (2, 12)
        fraction = config.per_process_memory_fraction
        if main26 and (fraction is None or fraction >= 1.0):
            out.append(
                SettingsFinding(
                    "warning",
                    "garbage_collection_threshold is set but does nothing unless the "
                    "per-process memory fraction is below 1.0.",
                    "Add per_process_memory_fraction:0.95 to the settings, or call "
                    "torch.cuda.set_per_process_memory_fraction(0.95) in the script.",
                    "c10/cuda/CUDACachingAllocator.cpp garbage_collect_cached_blocks (enabled only when the memory fraction is below 1.0)",
                )
            )
        elif not main26:
            out.append(
                SettingsFinding(
                    "warning",
                    "garbage_collection_threshold does nothing unless the script calls "
                    "torch.cuda.set_per_process_memory_fraction (any value, 1.0 included).",
                    "Call torch.cuda.set_per_process_memory_fraction(1.0) once at start-up.",
                    "c10/cuda/CUDACachingAllocator.cpp setMemoryFraction (2.4 and older: enabled after any set_per_process_memory_fraction)",
                )
            )
    if config.max_non_split_rounding_bytes is not None and config.max_split_size_bytes is None:
        out.append(
            SettingsFinding(
                "warning",
                "max_non_split_rounding_mb is set without max_split_size_mb: it has no effect.",
                "Set max_split_size_mb as well, or drop it.",
                "c10/cuda/CUDACachingAllocator.cpp get_free_block (max_non_split_rounding_mb has no effect unless max_split_size_mb is set)",
            )
        )
    if config.expandable_segments and config.max_split_size_bytes is not None:
        # The reason tune does not recommend the pair, said alike (imported here: the tuner's
        # replay machinery is not for every doctor run).
        from oomkit.plan.tuning import FLAG_REASONS

        out.append(
            SettingsFinding(
                "warning",
                "expandable_segments with max_split_size_mb: expandable blocks split whatever "
                "their size, but the oversize lookup rules of max_split_size_mb still apply: "
                + FLAG_REASONS["max-split-with-expandable"].split(": ", 1)[1],
                "Keep one of the two; oomkit tune SNAPSHOT measures each on your run (it never "
                "recommends the pair).",
                "c10/cuda/CUDACachingAllocator.cpp get_free_block and shouldSplit (expandable segments)",
            )
        )
    if config.expandable_segments:
        out.append(
            SettingsFinding(
                "info",
                "expandable_segments: tensors shared with other processes (torch.multiprocessing"
                ", CUDA IPC) need pidfd system calls or fabric handles; without driver-API "
                "support the option is ignored with a warning.",
                "If a worker process receives CUDA tensors, test that path under this setting.",
                "c10/cuda/CUDACachingAllocator.cpp ExpandableSegment (IPC handles)",
            )
        )
    return out


def _live_findings(live: LiveAllocator, env: EnvSettings) -> list[SettingsFinding]:
    out: list[SettingsFinding] = []
    if not live.cuda_available:
        out.append(
            SettingsFinding(
                "info",
                f"torch {live.torch_version} sees no CUDA device here, so the running "
                "allocator cannot be asked; the settings above are what it would parse.",
                "Run oomkit doctor on the GPU machine to read the live allocator.",
                "torch.cuda.is_available()",
            )
        )
        return out
    if live.backend is not None and live.backend != env.backend:
        out.append(
            SettingsFinding(
                "warning",
                f"the running allocator is {live.backend}, the environment names {env.backend}: "
                "the backend is chosen once, when torch loads.",
                "Set the variable before Python starts (not inside the script).",
                "c10/cuda/CUDAAllocatorConfig.cpp (the backend is read once, when torch loads)",
            )
        )
    if live.settings is not None and env.config is not None:
        live_expandable = live.settings.get("expandable_segments")
        if isinstance(live_expandable, bool) and live_expandable != env.config.expandable_segments:
            out.append(
                SettingsFinding(
                    "error",
                    f"the running allocator reports expandable_segments={live_expandable}, "
                    f"the environment asks for {env.config.expandable_segments}.",
                    "The script (or a library) changed it, or set the variable after CUDA "
                    "was initialised; set it before Python starts.",
                    "torch.cuda.memory._snapshot()['allocator_settings']",
                )
            )
    return out


_ORDER: dict[Severity, int] = {"error": 0, "warning": 1, "info": 2}


def _ranked(findings: list[SettingsFinding]) -> tuple[SettingsFinding, ...]:
    return tuple(sorted(findings, key=lambda f: _ORDER[f.severity]))
