"""A Diagnosis prints as one line in a REPL: its cause, its evidence and the first remedy."""

from __future__ import annotations

from oomkit.diagnose.diagnosis import Diagnosis, Finding, Remedy, diagnose_oom_text
from oomkit.diagnose.oom_text import parse_oom_text

GiB = 2**30

MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.65 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process "
    "has 22.51 GiB memory in use. Of the allocated memory 20.10 GiB is allocated by PyTorch, and "
    "1.90 GiB is reserved by PyTorch but unallocated."
)


def test_a_message_s_diagnosis_is_one_line():
    """The fragmentation case: cause, the finding's sentence, the first remedy with its
    estimated saving, and how many more; str() is the same line (no 2 KB field dump)."""
    diagnosis = diagnose_oom_text(parse_oom_text(MESSAGE))
    text = repr(diagnosis)
    assert text == str(diagnosis) and "\n" not in text
    assert text.startswith(
        "<Diagnosis: fragmentation: 1.90 GiB was reserved but unallocated, yet no cached block "
        "was large enough: the cache is fragmented; first remedy: "
    )
    assert text.endswith(f", {len(diagnosis.remedies) - 1} more>")
    assert len(text) < 300


def test_a_measured_saving_has_no_tilde_and_no_remedy_says_none():
    """A computed saving reads exactly; a diagnosis without remedies ends at its finding."""
    finding = Finding("shortage", GiB, "the step needs 1.00 GiB more than the GPU has")
    remedy = Remedy("halve the batch", 3 * GiB // 2, "high", "--batch 4", "why", estimate=False)
    with_one = Diagnosis("shortage", (finding,), (remedy,), "", GiB)
    assert repr(with_one) == (
        "<Diagnosis: shortage: the step needs 1.00 GiB more than the GPU has; first remedy: "
        "halve the batch (saves 1.50 GiB)>"
    )
    none = Diagnosis("shortage", (finding,), (), "", None)
    assert repr(none) == "<Diagnosis: shortage: the step needs 1.00 GiB more than the GPU has>"
