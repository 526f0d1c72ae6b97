"""Where a pasted out-of-memory error was raised: the user's line and the training phase.

Python prints the traceback before the exception line (``Traceback (most recent call last):``,
then per frame ``File "PATH", line N, in FUNC`` and, where the source is readable, the source
line). ``find_oom_location`` reads the last traceback that precedes the first OOM message and
returns the innermost frame in the user's own code (not in an installed library or the
standard library) and the phase the frames show, from the PyTorch functions on the stack:

- ``backward``: ``torch/autograd`` (``Tensor.backward`` -> ``torch.autograd.backward`` ->
  ``_engine_run_backward`` in torch/autograd/graph.py), or a user line calling ``.backward(``;
- ``optimizer state creation``: an optimizer's ``_init_group`` (torch/optim/adam.py,
  adamw.py, sgd.py ...: the first ``step()`` creates ``exp_avg`` / ``exp_avg_sq`` with
  ``torch.zeros_like``);
- ``optimizer step``: any other frame in ``torch/optim``, or a user line calling ``.step(``
  on an optimizer;
- ``loss``: torch/nn/modules/loss.py or the loss functions of torch/nn/functional.py;
- ``forward``: torch/nn/modules/module.py ``_call_impl`` / ``_wrapped_call_impl`` (a module
  called) or a frame named ``forward``.

The innermost frame that shows one of these decides. The traceback's outermost frame names the
script Python ran (``File "/home/me/train.py", line 210, in <module>``), which the remedies'
commands name instead of a placeholder; a frame of a trainer's loop (transformers/trainer.py,
Lightning's) names the trainer, whose own arguments the remedies then use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from oomkit._lazy import LazyPattern
from oomkit.diagnose.script_frames import is_library_path, script_of

__all__ = ["OomLocation", "Phase", "Trainer", "find_oom_location"]

Phase = Literal["forward", "loss", "backward", "optimizer state creation", "optimizer step"]
# The training loop that ran the step, where a frame of it shows: Hugging Face's Trainer
# (transformers/trainer.py; trl's trainers subclass it) or Lightning's (lightning/pytorch/,
# pytorch_lightning/).
Trainer = Literal["transformers", "lightning"]

_TRACEBACK = "Traceback (most recent call last):"
# The patterns are compiled when first matched (issue 41 item 4: start-up).
_FRAME = LazyPattern(
    r'^\s*File "(?P<path>[^"\n]+)", line (?P<line>\d{1,9}), in (?P<func>[^\n]+)$'
)
# The message follows its traceback; a traceback is rarely over a few hundred frames.
_LOOKBACK_CHARS = 200_000
_LOSS_FUNCTIONS = frozenset(
    {"cross_entropy", "nll_loss", "mse_loss", "binary_cross_entropy_with_logits", "kl_div"}
)
_OOM_ANCHOR = LazyPattern(r"(?:out|exceed)\s+(?:of|allowed)\s+memory")
# torchrun's prefix on each line a worker prints (torch/distributed/elastic/multiprocessing: "[rank0]: "
# on error output since 2.2, "[default0]:" with --tee): the rank's lines, read without it.
_RANK_PREFIX = LazyPattern(r"\[(?:rank|default)\d{1,7}\]: ?")


@dataclass(frozen=True)
class OomLocation:
    """The frame of the user's code where the OOM surfaced, and the phase.

    Attributes:
        path: the file, as the traceback prints it.
        line: the line number.
        function: the function the line is in (``<module>`` at the top level).
        source: the source line (``loss.backward()``), or "" when the traceback lacks it.
        phase: what the step was doing; None where the frames do not show it.
        script: the file Python ran, as the traceback prints it: the outermost frame, where it
            is a file's top level (``<module>``) outside installed libraries; None otherwise
            (``python -m``, whose first frames are runpy's; a notebook cell; ``python -c``).
        trainer: the trainer whose loop ran the step (a frame of it is on the stack); None
            where none shows.
    """

    path: str
    line: int
    function: str
    source: str
    phase: Phase | None
    script: str | None = None
    trainer: Trainer | None = None

    @property
    def label(self) -> str:
        """``loss.backward() at train.py:180``, or ``train.py:180 in step`` without source."""
        name = self.path.replace("\\", "/").rsplit("/", 1)[-1]
        where = f"{name}:{self.line}"
        return f"{self.source} at {where}" if self.source else f"{where} in {self.function}"


@dataclass(frozen=True)
class _Frame:
    path: str
    line: int
    function: str
    source: str


def _frames(block: str) -> list[_Frame]:
    lines = block.splitlines()
    frames: list[_Frame] = []
    for i, text in enumerate(lines):
        m = _FRAME.match(text)
        if m is None:
            continue
        source = ""
        # The source line is indented under its frame; the exception line that ends the
        # traceback is not. Python 3.11+ marks the failing span with ^^^ / ~~~ below it.
        if i + 1 < len(lines) and lines[i + 1][:1].isspace():
            following = lines[i + 1].strip()
            if _FRAME.match(lines[i + 1]) is None and not set(following) <= set("^~ "):
                source = following
        frames.append(
            _Frame(m.group("path"), int(m.group("line")), m.group("func").strip(), source)
        )
    return frames


def _frame_phase(frame: _Frame) -> Phase | None:
    """The phase one frame shows, or None."""
    path = frame.path.replace("\\", "/")
    if "/torch/autograd/" in path or ".backward(" in frame.source:
        return "backward"
    if "/torch/optim/" in path:
        return "optimizer state creation" if frame.function == "_init_group" else "optimizer step"
    if re.search(r"optim\w*\.step\(", frame.source):
        return "optimizer step"
    if path.endswith("torch/nn/modules/loss.py") or (
        path.endswith("torch/nn/functional.py") and frame.function in _LOSS_FUNCTIONS
    ):
        return "loss"
    if frame.function in ("_call_impl", "_wrapped_call_impl", "forward"):
        return "forward"
    return None


def _phase(frames: list[_Frame]) -> Phase | None:
    """The innermost frame that shows a phase decides: Lightning runs the forward pass inside
    ``optimizer.step(closure)``, so an outer optimizer frame does not make it a step."""
    for frame in reversed(frames):
        phase = _frame_phase(frame)
        if phase is not None:
            return phase
    return None


def _trainer(frames: list[_Frame]) -> Trainer | None:
    """The trainer whose loop a frame belongs to, or None."""
    for frame in frames:
        path = frame.path.replace("\\", "/")
        if path.endswith("/transformers/trainer.py"):
            return "transformers"
        if "/lightning/pytorch/" in path or "/pytorch_lightning/" in path:
            return "lightning"
    return None


def _one_rank(text: str, prefix: str) -> str:
    """The lines of ``text`` that start with ``prefix`` (``[rank0]:``), without it and the
    space after it: other ranks' lines interleave with them in a torchrun log."""
    kept = []
    for line in text.splitlines():
        if line.startswith(prefix):
            rest = line[len(prefix) :]
            kept.append(rest[1:] if rest.startswith(" ") else rest)
    return "\n".join(kept)


def find_oom_location(text: str) -> OomLocation | None:
    """The user's frame and the phase of the traceback before the first OOM message in ``text``.

    Returns:
        None where no traceback precedes the message (a pasted message alone).
    """
    anchor = _OOM_ANCHOR.search(text)
    if anchor is not None:
        prefix = _RANK_PREFIX.match(text, text.rfind("\n", 0, anchor.start()) + 1)
        if prefix is not None:  # a torchrun worker's lines: its rank's, unprefixed
            text = _one_rank(text[: anchor.end()], prefix.group().rstrip())
            anchor = _OOM_ANCHOR.search(text)
    end = len(text) if anchor is None else anchor.start()
    start = text.rfind(_TRACEBACK, max(0, end - _LOOKBACK_CHARS), end)
    if start < 0:
        return None
    frames = _frames(text[start:end])
    if not frames:
        return None
    users = [f for f in frames if not is_library_path(f.path)]
    # The innermost frame of the user's code; a trace all inside libraries keeps its outermost.
    frame = users[-1] if users else frames[0]
    script = script_of(frames[0].path, frames[0].function)
    return OomLocation(
        frame.path,
        frame.line,
        frame.function,
        frame.source,
        _phase(frames),
        script,
        _trainer(frames),
    )
