"""The memory an engine's CUDA graphs hold after capture: oomkit's estimate, per captured size.

Neither vLLM 0.8 nor 0.13 budgets this before the KV cache is allocated: ``capture_model``
(``gpu_model_runner.py``) runs after it and returns what the capture took, which the worker
only logs (``gpu_worker.py`` ``compile_or_warm_up_model``). Captures run largest size first into
one shared memory pool, so the pool holds about the largest size's activations
(``torch.cuda.graph(pool=...)``); every instantiated graph also holds driver memory for its
nodes. The per-graph figure is an estimate (``GRAPH_BYTES_PER_LAYER``); expect the total to
differ from the engine's "Graph capturing finished ... took X GiB" by up to ~0.5 GiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomkit.prediction.serving.profile_run import ProfilePeak

__all__ = ["GRAPH_BYTES_PER_LAYER", "GraphEstimate", "estimate_graphs"]

# Driver memory an instantiated graph holds per decoder layer it covers (kernel nodes, their
# parameters): an estimate sized so that Llama-3.1-8B's 51 sizes in two modes come to ~0.4 GiB,
# the order vLLM logs for 8B models on an H100 ("Graph capturing finished in N secs, took
# 0.4-0.6 GiB").
GRAPH_BYTES_PER_LAYER = 128 * 1024


@dataclass(frozen=True)
class GraphEstimate:
    """The CUDA graphs' memory after capture.

    Attributes:
        sizes: the batch sizes captured, ascending (empty: eager).
        modes: graphs a size (vLLM 0.13's FULL_AND_PIECEWISE: 2).
        pool_bytes: the shared pool: the largest size's recorded activation peak.
        graph_bytes: driver memory of the instantiated graphs.
    """

    sizes: tuple[int, ...]
    modes: int
    pool_bytes: int
    graph_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.graph_bytes


def estimate_graphs(
    sizes: tuple[int, ...], *, pool_peak: ProfilePeak | None, num_layers: int, modes: int
) -> GraphEstimate:
    """Estimate the graphs of ``sizes`` (none when eager).

    Args:
        sizes: captured batch sizes.
        pool_peak: the recorded forward of the largest size (no sampler).
        num_layers: decoder layers each graph covers.
        modes: graphs captured a size.
    """
    if not sizes or pool_peak is None:
        return GraphEstimate(sizes=(), modes=0, pool_bytes=0, graph_bytes=0)
    return GraphEstimate(
        sizes=tuple(sizes),
        modes=modes,
        pool_bytes=pool_peak.peak_bytes,
        graph_bytes=len(sizes) * modes * num_layers * GRAPH_BYTES_PER_LAYER,
    )
