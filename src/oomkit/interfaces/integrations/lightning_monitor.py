"""PyTorch Lightning callback: an :class:`oomkit.Monitor` around training, one record per step.

Importing this module imports Lightning (``lightning.pytorch``, else ``pytorch_lightning``);
``import oomkit`` never does. Example::

    from oomkit.interfaces.integrations.lightning_monitor import OomkitMonitorCallback

    monitor = OomkitMonitorCallback(log_path="memory_{rank}.jsonl")
    L.Trainer(callbacks=[monitor]).fit(model)
    # oomkit report memory_0.jsonl --html memory.html
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oomkit.errors import ConfigError
from oomkit.runtime.monitor import Monitor, MonitorSummary

# mypy checks against ``lightning.pytorch``; the standalone package has the same API under its
# own class name, which mypy would see as a different type.
if TYPE_CHECKING:
    from lightning.pytorch import Callback
else:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the standalone package
        from pytorch_lightning import Callback

__all__ = ["OomkitMonitorCallback"]


class OomkitMonitorCallback(Callback):
    """Records memory after every optimizer step of ``fit`` (not after accumulation batches).

    A step is recorded when ``trainer.global_step`` advanced since the last training batch, so
    with ``accumulate_grad_batches=k`` there is one record per k batches. The record's levels
    are logged as ``oomkit/allocated_bytes``, ``oomkit/reserved_bytes``,
    ``oomkit/peak_allocated_bytes`` and ``oomkit/num_alloc_retries``. At ``on_train_end``
    every rank's summary is gathered to rank 0 (:meth:`Monitor.gather`) and the log closed.

    Args:
        log_metrics: log the record's figures through ``pl_module.log``.
        gather: gather every rank's summary at the end (a collective; all ranks call it).
        **monitor_kwargs: :class:`~oomkit.runtime.monitor.Monitor` arguments (``log_path``,
            ``every``, ``sink``, ``device``...); ``auto_step`` is not allowed (the callback
            steps).

    Attributes:
        monitor: the monitor of the current (or last) fit, or None before one.
        summaries: what :meth:`Monitor.gather` returned at the end (None on ranks but 0).
    """

    def __init__(self, *, log_metrics: bool = True, gather: bool = True, **monitor_kwargs: Any):
        if monitor_kwargs.get("auto_step"):
            raise ConfigError("OomkitMonitorCallback steps the monitor itself; drop auto_step")
        self.log_metrics = log_metrics
        self.gather = gather
        self.monitor_kwargs = monitor_kwargs
        self.monitor: Monitor | None = None
        self.summaries: list[MonitorSummary] | None = None
        self._last_global_step = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start a monitor for this fit."""
        self.monitor = Monitor(**self.monitor_kwargs).start()
        self._last_global_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Record a step when the optimizer stepped during this batch."""
        if self.monitor is None or trainer.global_step == self._last_global_step:
            return
        self._last_global_step = trainer.global_step
        record = self.monitor.step()
        if record is None or not self.log_metrics:
            return
        for name in (
            "allocated_bytes",
            "reserved_bytes",
            "peak_allocated_bytes",
            "num_alloc_retries",
        ):
            pl_module.log(f"oomkit/{name}", float(getattr(record, name)), on_step=True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Gather the ranks' summaries and close the log."""
        if self.monitor is None:
            return
        if self.gather:
            self.summaries = self.monitor.gather()
        self.monitor.close()
