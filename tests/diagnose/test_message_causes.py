"""explain on a message: whose memory the NVML lines are, workload remedies, the GPU matched
by its total memory (issue 35 item 6)."""

from __future__ import annotations

import pytest
from cases.real_messages import CASES

from oomkit.diagnose._context import matched_gpu
from oomkit.diagnose.diagnosis import diagnose_oom_text
from oomkit.diagnose.oom_text import parse_oom_text

GiB = 2**30
MiB = 2**20


def _real(fragment: str) -> str:
    (case,) = [c for c in CASES if fragment in c.url]
    return case.text


def _native(total: str, free: str, processes: str, allocated: str, cached: str, ask: str) -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {ask}. GPU 0 has a total "
        f"capacity of {total} of which {free} is free. {processes}Of the allocated memory "
        f"{allocated} is allocated by PyTorch, and {cached} is reserved by PyTorch but "
        "unallocated."
    )


def test_a_container_pid_line_holding_the_reserved_memory_is_this_process():
    """vllm#27508: 'Process 3270336 has 78.96 GiB' is this process (R = 69.15 GiB), not another."""
    diagnosis = diagnose_oom_text(parse_oom_text(_real("vllm/issues/27508")))
    (finding,) = diagnosis.causes
    assert finding.cause == "outside_pytorch"
    assert finding.evidence_bytes["other_processes_bytes"] == 0
    assert "other processes used" not in finding.summary
    assert "this process itself held 9.81 GiB outside PyTorch's allocator" in finding.summary
    assert "NVML names no other process" in diagnosis.remedies[0].why


def test_other_processes_come_only_from_their_own_lines():
    """RLinf#255: this process has its own sentence; the two others sum exactly."""
    diagnosis = diagnose_oom_text(parse_oom_text(_real("RLinf/issues/255")))
    others = diagnosis.causes[0].evidence_bytes["other_processes_bytes"]
    assert others == round(419.48 * MiB) + round(14.85 * GiB)


def test_process_lines_that_fit_beside_this_process_are_all_others():
    """Lines that fit in total - free beside the reserved memory are other processes."""
    text = _native(
        "23.65 GiB",
        "10.00 MiB",
        "Process 11 has 6.00 GiB memory in use. Process 12 has 5.00 GiB memory in use. ",
        "11.00 GiB",
        "500.00 MiB",
        "2.00 GiB",
    )
    diagnosis = diagnose_oom_text(parse_oom_text(text))
    outside = next(f for f in diagnosis.causes if f.cause == "outside_pytorch")
    assert outside.evidence_bytes["other_processes_bytes"] == 11 * GiB
    assert "other processes used 11.00 GiB" in outside.summary


def test_workload_remedy_in_a_fragmentation_with_tensors_above_80_percent():
    """pytorch#16417: fragmentation, 97% of the GPU in tensors: 'reduce memory per step' too."""
    diagnosis = diagnose_oom_text(parse_oom_text(_real("pytorch/pytorch/issues/16417")))
    assert diagnosis.cause == "fragmentation"
    titles = [r.title for r in diagnosis.remedies]
    assert titles == [
        "expandable segments",
        "reduce memory per step",
        "do not rely on torch.cuda.empty_cache()",
    ]
    assert diagnosis.remedies[1].why.startswith(
        "Tensors held 22.90 GiB, 97% of the device's 23.65 GiB"
    )
    assert "activation checkpointing" in diagnosis.remedies[1].code


def test_no_workload_remedy_below_80_percent():
    """Mask2DiT#4: 11.97 GiB of 79.33 GiB in tensors (15%): the cache's remedies only."""
    diagnosis = diagnose_oom_text(parse_oom_text(_real("Mask2DiT/issues/4")))
    assert diagnosis.cause == "fragmentation"
    assert [r.title for r in diagnosis.remedies] == [
        "expandable segments",
        "do not rely on torch.cuda.empty_cache()",
    ]


def test_workload_remedy_on_an_outside_cause_above_80_percent():
    """vllm#27508: memory outside PyTorch, 87% in tensors: the workload remedy is listed."""
    diagnosis = diagnose_oom_text(parse_oom_text(_real("vllm/issues/27508")))
    assert "reduce memory per step" in [r.title for r in diagnosis.remedies]
    assert "87% of the device's 79.11 GiB" in diagnosis.remedies[1].why


@pytest.mark.parametrize(
    ("total", "name"),
    [
        ("14.75 GiB", "T4"),  # Colab's T4 (catalog 14.76 GiB)
        ("14.56 GiB", "T4"),  # 199.6 MiB below the catalog's 15109 MiB: an older driver
        ("79.11 GiB", "H100 PCIe"),
        ("23.99 GiB", "RTX 4090"),
        ("12.50 GiB", None),  # 512 MiB from the nearest (RTX 3060 12GB)
        ("14.40 GiB", None),  # 363 MiB below the T4
    ],
)
def test_gpu_matched_by_total_memory(total, name):
    """The nearest catalog GPU within 200 MiB (and the message's rounding), else none."""
    parsed = parse_oom_text(
        _native(total, "10.00 MiB", "", "10.00 GiB", "100.00 MiB", "2.00 GiB")
    )
    spec = matched_gpu(parsed)
    assert (spec.name if spec is not None else None) == name
    assert diagnose_oom_text(parsed).gpu_name == name


def test_t4_context_range_is_used_for_a_14_75_gib_message():
    """GenerateU#10 (14.75 GiB): the context range named is the T4's."""
    diagnosis = diagnose_oom_text(parse_oom_text(_real("GenerateU/issues/10")))
    assert diagnosis.gpu_name == "T4"
    assert "on T4, lazy module loading" in diagnosis.memory_explained
