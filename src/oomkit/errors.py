"""The one error family of oomkit.

Every message says what was wrong and what to do next. Errors caused by bad user input also
subclass ``ValueError`` so that callers who do not know oomkit can still catch them.
"""

from __future__ import annotations

import re

__all__ = [
    "OomkitError",
    "ConfigError",
    "SnapshotFormatError",
    "TraceFormatError",
    "AllocatorUsageError",
    "TorchRequiredError",
    "UnsupportedOpError",
    "DataDependentValueError",
    "EmptyRecordingError",
    "NoFeasibleBatchSizeError",
    "UnknownDeviceError",
    "UnknownGpuError",
    "OomTextError",
    "UnknownPresetError",
    "UserCodeError",
    "PredictionFormatError",
    "BatchSplitError",
    "OomRecoveryError",
    "SimulatedDeviceError",
    "MonitorLogError",
    "MemoryHealthError",
    "DiffInputError",
    "ScenarioError",
    "OutputPathError",
    "InputFileError",
]


# C0 and C1 control characters other than tab and newline.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _escaped(match: re.Match[str]) -> str:
    return f"\\x{ord(match.group()):02x}"


class OomkitError(Exception):
    """Base class of every error oomkit raises on purpose.

    Its text is safe to print to a terminal: messages quote file names, frame names and values
    from files, so control characters (an ESC sequence would retitle the window or clear the
    screen) are shown as ``\\xNN`` instead of reaching the terminal.
    """

    def __str__(self) -> str:
        return _CONTROL.sub(_escaped, super().__str__())


class ConfigError(OomkitError, ValueError):
    """A ``PYTORCH_CUDA_ALLOC_CONF``-style setting that PyTorch would reject."""


class SnapshotFormatError(OomkitError, ValueError):
    """A memory snapshot file that is corrupt, truncated, hostile or not a snapshot at all."""


class TraceFormatError(OomkitError, ValueError):
    """An oomkit trace file that cannot be read."""


class AllocatorUsageError(OomkitError, ValueError):
    """A call on the simulated allocator that PyTorch would refuse (unknown pointer, bad size)."""


class TorchRequiredError(OomkitError, ImportError):
    """A feature that needs torch was used where torch is not installed."""


class UnsupportedOpError(OomkitError, ValueError):
    """An operation that oomkit cannot model."""


class DataDependentValueError(UnsupportedOpError):
    """A tensor value oomkit cannot know without a GPU decides a size, a loop or a branch."""


class EmptyRecordingError(OomkitError, ValueError):
    """A traced step allocated nothing on the device oomkit watches (it ran elsewhere, for real)."""


class NoFeasibleBatchSizeError(OomkitError, ValueError):
    """Not even the smallest batch size fits.

    Attributes (``None`` where the search did not get that far, or measured on a real GPU):
        needed_reserved_bytes: what the smallest batch tried needs reserved at its worst step.
        usable_bytes: what the GPU lets the allocator reserve (its memory less the context).
        margin_bytes: what of that had to stay free.
        reason: the message's first sentence, why it does not fit (the whole message when it
            has no list of what to try).
        advice: the changes the message says to try, unmeasured ("activation checkpointing
            (--checkpointing full)"), without the margin and a larger GPU, which always apply.
        batch_size: the smallest batch tried (the one that does not fit).
    """

    def __init__(
        self,
        message: str,
        *,
        needed_reserved_bytes: int | None = None,
        usable_bytes: int | None = None,
        margin_bytes: int | None = None,
        reason: str | None = None,
        advice: tuple[str, ...] = (),
        batch_size: int | None = None,
    ) -> None:
        super().__init__(message)
        self.batch_size = batch_size
        self.needed_reserved_bytes = needed_reserved_bytes
        self.usable_bytes = usable_bytes
        self.margin_bytes = margin_bytes
        self.reason = message if reason is None else reason
        self.advice = advice


class UnknownDeviceError(OomkitError, ValueError):
    """A snapshot holds no state or trace for the device asked for."""


class UnknownGpuError(OomkitError, ValueError):
    """A ``--gpu`` value that is neither a catalog name nor a memory size."""


class OomTextError(OomkitError, ValueError):
    """A text given as an out-of-memory error holds no message PyTorch prints for one."""


class UnknownPresetError(OomkitError, ValueError):
    """A model preset name that is not in ``oomkit.prediction.models.PRESETS``."""


class UserCodeError(OomkitError, ValueError):
    """The user's ``file.py:function`` could not be loaded, called, or traced."""


class PredictionFormatError(OomkitError, ValueError):
    """A saved prediction (``oomkit predict --json``) that cannot be explained."""


class BatchSplitError(OomkitError, ValueError):
    """A batch that OOM recovery cannot split into micro-batches (no tensor, or unequal first dims)."""


class OomRecoveryError(OomkitError, RuntimeError):
    """OOM recovery gave up on this rank because another rank could not recover."""


class SimulatedDeviceError(OomkitError, ValueError):
    """A ``SimulatedCudaDevice`` used in a way it cannot serve (entered twice, unknown device type)."""


class MonitorLogError(OomkitError, ValueError):
    """A monitor log (``Monitor(log_path=...)`` JSONL) that cannot be read."""


class MemoryHealthError(OomkitError, ValueError):
    """Memory samples or step traces that leak/fragmentation detection cannot use."""


class DiffInputError(OomkitError, ValueError):
    """Two inputs that ``oomkit diff`` cannot compare as given (other kinds, other GPUs)."""


class ScenarioError(OomkitError, ValueError):
    """A scenario (the Python API's keywords, a config file, CLI flags or an MCP call) with a
    field of the wrong type or range, an unknown key, or a combination that cannot run."""


class OutputPathError(OomkitError, ValueError):
    """An output path that must not or cannot be written: an input, a directory, a missing one."""


class InputFileError(OomkitError, OSError):
    """An input file that cannot be read: no permission, a directory, a failing disk (EIO)."""
