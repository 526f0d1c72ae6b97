"""Tests for the built-in training-like workload."""

from collections import Counter

from oomkit.core.workloads import DEFAULT_WORKLOAD, TrainingWorkload, training_events


def test_workload_is_deterministic():
    """The same workload yields exactly the same events twice."""
    w = TrainingWorkload(steps=2)
    assert list(training_events(w)) == list(training_events(w))


def test_seq_lengths_are_seeded_multiples_of_128():
    """Sequence lengths come from the seed and stay in [min_seq, max_seq]."""
    lengths = DEFAULT_WORKLOAD.seq_lengths()
    assert len(lengths) == DEFAULT_WORKLOAD.steps
    assert all(n % 128 == 0 and 256 <= n <= 2048 for n in lengths)
    assert lengths == TrainingWorkload(seed=0).seq_lengths()
    assert lengths != TrainingWorkload(seed=1).seq_lengths()


def test_only_parameters_and_optimizer_state_stay_live():
    """Every allocation but parameters and AdamW's two states is freed by the end of a step."""
    w = TrainingWorkload(layers=2, steps=3)
    live = {}
    counts = Counter()
    for event in training_events(w):
        counts[event.action] += 1
        if event.action == "alloc":
            live[event.address] = event.size
        elif event.action == "free_completed":
            del live[event.address]
    params = 1 + 6 * w.layers
    assert len(live) == 3 * params
    assert counts["free_requested"] == counts["free_completed"]
    h = w.hidden
    param_bytes = 4 * (w.vocab * h + w.layers * (12 * h * h + 2 * h))
    assert sum(live.values()) == 3 * param_bytes
