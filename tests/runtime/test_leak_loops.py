"""Leaking and clean training loops on a simulated CUDA device: the leak is flagged at its line.

Each loop runs real PyTorch code on CPU under ``SimulatedCudaDevice(record_history=True)`` and
records what the runtime monitor records at every step's end (allocated, reserved, the peaks
since the previous step, inactive split bytes, retries) plus the allocator trace cut at the same
step boundaries. The leaking statement of each leaking loop carries a ``# LEAK:<name>`` marker;
the test finds its line number from this file's source.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from oomkit.core.trace import TraceEvent  # noqa: E402
from oomkit.diagnose.memory_health import (  # noqa: E402
    LeakFinding,
    MemorySample,
    attribute_leak,
    detect_fragmentation,
    detect_leak,
    explain_leak,
    memory_findings,
)
from oomkit.runtime import SimulatedCudaDevice  # noqa: E402

STEPS = 24
SEEDS = range(10)
BATCH = 64
IN_FEATURES = 32
HIDDEN = 512
CLASSES = 16


def _marker_line(name: str, marker: str = "LEAK") -> int:
    """The line of this file that carries ``# LEAK:<name>`` (or another marker)."""
    lines = Path(__file__).read_text().splitlines()
    tag = f"# {marker}:{name}"
    hits = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(tag)]
    assert len(hits) == 1, tag
    return hits[0]


@dataclass
class Run:
    """What a monitored loop left: per-step samples and the trace cut per step."""

    samples: list[MemorySample]
    events_by_step: list[list[TraceEvent]]


class _Recorder:
    """Records what ``oomkit.Monitor.step()`` records, from the simulated device."""

    def __init__(self, device: SimulatedCudaDevice) -> None:
        self.device = device
        self.samples: list[MemorySample] = []
        self.events_by_step: list[list[TraceEvent]] = []
        self._mark = 0

    def step(self, step: int) -> None:
        dev = self.device
        stats = dev.memory_stats()
        self.samples.append(
            MemorySample(
                step=step,
                allocated_bytes=dev.memory_allocated(),
                reserved_bytes=dev.memory_reserved(),
                peak_allocated_bytes=dev.max_memory_allocated(),
                peak_reserved_bytes=dev.max_memory_reserved(),
                inactive_split_bytes=stats["inactive_split_bytes.all.current"],
                num_alloc_retries=stats["num_alloc_retries"],
            )
        )
        dev.reset_peak_memory_stats()
        events = dev.events()
        self.events_by_step.append(list(events[self._mark :]))
        self._mark = len(events)


def _mlp(out_features: int = CLASSES) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, out_features)
    )


def _encoder_and_head(
    encoder: torch.nn.Module,
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """``encoder``, a Linear head on its HIDDEN features, and one SGD over both."""
    head = torch.nn.Linear(HIDDEN, CLASSES)
    return encoder, head, torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.01)


def _batch(size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, IN_FEATURES), torch.randint(0, CLASSES, (size,))


# ----------------------------------------------------------------------------- leaking loops


def loop_loss_accumulated(rec: _Recorder) -> None:
    """A validation loss summed every step without .item() (and without no_grad)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    val_loss = 0.0
    for step in range(STEPS):
        x, y = _batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        xv, yv = _batch()
        val_loss = val_loss + F.cross_entropy(model(xv), yv)  # LEAK:loss
        rec.step(step)


def loop_outputs_in_list(rec: _Recorder) -> None:
    """Every step's output appended to a list that is never cleared."""
    model = _mlp(out_features=HIDDEN)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    outputs = []
    for step in range(STEPS):
        x, _ = _batch()
        opt.zero_grad()
        outputs.append(model(x))  # LEAK:list
        outputs[-1].pow(2).mean().backward()
        opt.step()
        rec.step(step)


def loop_retain_graph(rec: _Recorder) -> None:
    """A running feature average carried across steps without detach, backward(retain_graph)."""
    encoder, head, opt = _encoder_and_head(torch.nn.Linear(IN_FEATURES, HIDDEN))
    h = torch.zeros(BATCH, HIDDEN)
    for step in range(STEPS):
        x, y = _batch()
        opt.zero_grad()
        h = 0.9 * h + 0.1 * torch.relu(encoder(x))  # LEAK:retain
        loss = F.cross_entropy(head(h), y)
        loss.backward(retain_graph=True)
        opt.step()
        rec.step(step)


_FEATURE_CACHE: dict[int, torch.Tensor] = {}


def loop_global_cache(rec: _Recorder) -> None:
    """Encoder features stored in a module-level dict keyed by step, never evicted."""
    _FEATURE_CACHE.clear()
    encoder, head, opt = _encoder_and_head(
        torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU())
    )
    for step in range(STEPS):
        x, y = _batch()
        opt.zero_grad()
        _FEATURE_CACHE[step] = encoder(x)  # LEAK:cache
        F.cross_entropy(head(_FEATURE_CACHE[step]), y).backward()
        opt.step()
        rec.step(step)
    _FEATURE_CACHE.clear()


_ACTIVATIONS: list[torch.Tensor] = []


def save_activation_hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
    """A forward hook that keeps a copy of every activation."""
    _ACTIVATIONS.append(output.detach().clone())  # LEAK:hook


def loop_hook_stores(rec: _Recorder) -> None:
    """A forward hook on the hidden layer that stores a copy of each activation."""
    _ACTIVATIONS.clear()
    model = _mlp()
    handle = model[1].register_forward_hook(save_activation_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = _batch()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        rec.step(step)
    handle.remove()
    _ACTIVATIONS.clear()


# ----------------------------------------------------------------------------- clean loops


def loop_clean_adam(rec: _Recorder) -> None:
    """Plain training with Adam: its state appears at the first optimizer step (warm-up)."""
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    running = 0.0
    rec.step(0)  # the monitor starts before the first step: grads and Adam state come at step 1
    for step in range(1, STEPS):
        x, y = _batch()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        running += loss.item()
        rec.step(step)


def loop_clean_noisy_batches(rec: _Recorder) -> None:
    """SGD with momentum on batches of random size (16-256 rows): noisy end-of-step memory."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(random.randint(16, 256))
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        rec.step(step)


def loop_clean_detached_state(rec: _Recorder) -> None:
    """The running feature average of the retain_graph loop, detached each step (truncated BPTT)."""
    encoder, head, opt = _encoder_and_head(torch.nn.Linear(IN_FEATURES, HIDDEN))
    h = torch.zeros(BATCH, HIDDEN)
    for step in range(STEPS):
        x, y = _batch()
        opt.zero_grad()
        h = 0.9 * h.detach() + 0.1 * torch.relu(encoder(x))
        F.cross_entropy(head(h), y).backward()
        opt.step()
        rec.step(step)


def loop_clean_bounded_cache(rec: _Recorder) -> None:
    """A feature cache that keeps the last 4 steps: it fills, then stays level."""
    encoder, head, opt = _encoder_and_head(
        torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.ReLU())
    )
    cache: dict[int, torch.Tensor] = {}
    for step in range(STEPS):
        x, y = _batch()
        opt.zero_grad()
        feats = encoder(x)
        cache[step] = feats.detach()
        cache.pop(step - 4, None)
        F.cross_entropy(head(feats), y).backward()
        opt.step()
        rec.step(step)


def loop_growing_sequences(rec: _Recorder) -> None:
    """A curriculum: every step's sequences are 256 tokens longer (a fragmenting cache)."""
    encoder = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(encoder.parameters(), lr=0.01)
    for step in range(12):
        x = torch.randn(32, 2048 + step * 256, 64)  # GROWS:curriculum
        opt.zero_grad()
        encoder(x).pow(2).mean().backward()
        opt.step()
        rec.step(step)


def _run(loop: Callable[[_Recorder], None], seed: int) -> Run:
    torch.manual_seed(seed)
    random.seed(seed)
    with SimulatedCudaDevice("1GiB", context_overhead_bytes=0, record_history=True) as dev:
        rec = _Recorder(dev)
        loop(rec)
    return Run(rec.samples, rec.events_by_step)


LEAKING = {
    "loss": (loop_loss_accumulated, "loss_accumulated"),
    "list": (loop_outputs_in_list, "kept_in_list"),
    "retain": (loop_retain_graph, "retain_graph"),
    "cache": (loop_global_cache, "stored_in_container"),
    "hook": (loop_hook_stores, "hook_stores_tensors"),
}
CLEAN = {
    "adam": loop_clean_adam,
    "noisy": loop_clean_noisy_batches,
    "detached": loop_clean_detached_state,
    "bounded_cache": loop_clean_bounded_cache,
}


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    """One intra-op thread: the loops are tiny and the machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(LEAKING))
def test_leaking_loop_flagged_at_its_line(name: str, seed: int) -> None:
    """Every leaking loop is flagged, its top growing site is the marked line, the cause named."""
    loop, kind = LEAKING[name]
    run = _run(loop, seed)
    finding = detect_leak(run.samples)
    assert isinstance(finding, LeakFinding)
    sites = attribute_leak(run.events_by_step, warmup_steps=finding.warmup_steps)
    assert sites, "no growing site"
    top = sites[0]
    assert (top.filename, top.line) == (__file__, _marker_line(name))
    assert top.growth_count >= STEPS - finding.warmup_steps - 1
    assert explain_leak(top).kind == kind


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_loop_not_flagged(name: str, seed: int) -> None:
    """No clean loop is flagged as leaking, warm-up, noisy batches and a filling cache included."""
    run = _run(CLEAN[name], seed)
    assert detect_leak(run.samples) is None


def test_growth_per_step_is_the_leaked_block() -> None:
    """The list leak grows by exactly one output block (64 x 512 float32 = 128 KiB) per step."""
    run = _run(loop_outputs_in_list, 0)
    finding = detect_leak(run.samples)
    assert finding is not None
    assert finding.growth_bytes_per_step == BATCH * HIDDEN * 4 == 131072
    sites = attribute_leak(run.events_by_step, warmup_steps=finding.warmup_steps)
    assert sites[0].growth_bytes_per_step == 131072
    assert sites[0].typical_size_bytes == 131072


def test_memory_findings_attributes_the_leak() -> None:
    """``memory_findings`` (what Monitor.findings calls) returns the leak with its site attached."""
    run = _run(loop_global_cache, 3)
    findings = memory_findings(run.samples, events_by_step=run.events_by_step)
    leak = findings[0]
    assert isinstance(leak, LeakFinding)
    assert leak.sites[0].line == _marker_line("cache")
    assert f"test_leak_loops.py:{_marker_line('cache')}" in leak.summary
    assert "Likely cause: tensors stored in a dict" in leak.summary
    assert leak.summary.count("Likely cause") == 1


def test_growing_inputs_fragment_and_are_explained() -> None:
    """Longer sequences every step: fragmentation priced by replay, growth blamed on sizes."""
    run = _run(loop_growing_sequences, 0)
    events = [ev for step in run.events_by_step for ev in step]
    frag = detect_fragmentation(run.samples, events=events, capacity_bytes=2**30)
    assert frag is not None
    assert "reserved_unused" in frag.signals
    assert frag.tuning is not None and frag.tuning.best is not None
    best = frag.tuning.best
    assert best.alloc_conf.startswith("expandable_segments:True")
    assert frag.tuning.saving_bytes > 0
    assert frag.recommendations[0].startswith(f"PYTORCH_CUDA_ALLOC_CONF={best.alloc_conf}: ")
    # End-of-step memory rises with the input size; with the trace, the site explains it.
    leak = detect_leak(run.samples)
    assert leak is not None and leak.growth_bytes_per_step == 32 * 256 * 64 * 4
    sites = attribute_leak(run.events_by_step, warmup_steps=leak.warmup_steps)
    assert (sites[0].line, sites[0].growth_count) == (_marker_line("curriculum", "GROWS"), 0)
    assert explain_leak(sites[0]).kind == "growing_tensor"
