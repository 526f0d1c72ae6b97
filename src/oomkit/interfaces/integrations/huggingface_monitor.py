"""Hugging Face ``transformers`` Trainer callback: an :class:`oomkit.Monitor` per training run.

Importing this module imports ``transformers``; ``import oomkit`` never does. Example::

    from oomkit.interfaces.integrations.huggingface_monitor import OomkitMonitorTrainerCallback

    trainer = Trainer(model, args, callbacks=[OomkitMonitorTrainerCallback(
        log_path="memory_{rank}.jsonl")], ...)
    trainer.train()
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from oomkit.errors import ConfigError
from oomkit.runtime.monitor import Monitor, MonitorSummary

__all__ = ["OomkitMonitorTrainerCallback"]


class OomkitMonitorTrainerCallback(TrainerCallback):
    """Records memory at every optimizer step (``on_step_end``) of ``Trainer.train``.

    The latest record's figures are added to the Trainer's logs (``oomkit/allocated_bytes``,
    ``oomkit/reserved_bytes``, ``oomkit/peak_allocated_bytes``, ``oomkit/num_alloc_retries``)
    when it logs. At ``on_train_end`` every rank's summary is gathered to rank 0 and the log
    closed.

    Args:
        gather: gather every rank's summary at the end (a collective; all ranks call it).
        **monitor_kwargs: :class:`~oomkit.runtime.monitor.Monitor` arguments (``log_path``,
            ``every``, ``sink``, ``device``...); not ``auto_step``.

    Attributes:
        monitor: the monitor of the current (or last) run.
        summaries: what :meth:`Monitor.gather` returned at the end (None on ranks but 0).
    """

    def __init__(self, *, gather: bool = True, **monitor_kwargs: Any) -> None:
        if monitor_kwargs.get("auto_step"):
            raise ConfigError("OomkitMonitorTrainerCallback steps the monitor itself; drop auto_step")
        self.gather = gather
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Monitor | None = None
        self.summaries: list[MonitorSummary] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start a monitor for this run."""
        self.monitor = Monitor(**self.monitor_kwargs).start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Record the optimizer step that just ended."""
        if self.monitor is not None:
            self.monitor.step()

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """Add the latest record's figures to the Trainer's logs."""
        record = None if self.monitor is None else self.monitor.last_record
        if logs is None or record is None:
            return
        for name in ("allocated_bytes", "reserved_bytes", "peak_allocated_bytes",
                     "num_alloc_retries"):
            logs[f"oomkit/{name}"] = getattr(record, name)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Gather the ranks' summaries and close the log."""
        if self.monitor is None:
            return
        if self.gather:
            self.summaries = self.monitor.gather()
        self.monitor.close()
