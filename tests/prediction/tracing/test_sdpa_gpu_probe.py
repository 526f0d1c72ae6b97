"""SDPA's emulated CUDA memory against an H200's, request by request.

``validation/sdpa-probe-h200-torch2.11.0.json`` (``scripts/probe_sdpa_on_gpu.py``; torch 2.11,
cuDNN 9.19.0) holds, for each call shape, the sizes the caching allocator was asked for in the
forward and in the backward, in order. cuDNN attention (torch's choice on sm90 with this cuDNN)
is reproduced exactly at every shape: the seed and offset, output and statistics, the forward's
256-byte workspace, and the backward's single workspace (fp32 dQ accumulator, fp32 softmax sum,
the engine's 256 bytes and, for grouped-query attention, full-head dK/dV). Flash is exact
too, forward and backward: on the probe's [b, h, s, d]-contiguous inputs its backward first
copies grad_out and out into the kernel's [b, s, h, d] layout (attention_backward.cu
``_flash_attention_backward``), and frees every temporary in the GPU's order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from oomkit.core.gpus import get_gpu
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.emulations import SdpaSettings, use_sdpa_settings

PROBE = Path(__file__).resolve().parents[3] / "validation" / "sdpa-probe-h200-torch2.11.0.json"
MARKER_BYTES = 3 * 512  # allocated between forward and backward, to split the recording
_DOCUMENT = json.loads(PROBE.read_text())
_CASES = [c for c in _DOCUMENT["cases"] if "error" not in c]


def _requests(entries: list) -> list[int]:
    return [size for action, size in entries if action == "alloc"]


def _recorded(case: dict) -> tuple[list[int], list[int]]:
    forward, backward = _recorded_events(case)
    return _requests(forward), _requests(backward)


def _recorded_events(case: dict) -> tuple[list[list], list[list]]:
    """The recorded step's forward and backward as ``[action, size]`` pairs (allocations and
    completed frees), split at the marker."""
    shape = case["case"]
    b, h, kv, s, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim"))
    with torch.device("meta"):
        q = torch.empty(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(b, kv, s, d, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(b, kv, s, d, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.empty(b, h, s, d, dtype=torch.bfloat16)

    def step(q, k, v, grad):
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=shape["causal"], enable_gqa=kv != h
        )
        torch.empty(MARKER_BYTES, dtype=torch.uint8)
        out.backward(grad)

    backend = {"flash": SDPBackend.FLASH_ATTENTION}.get(shape["backend"])
    with use_sdpa_settings(SdpaSettings(cudnn_version=_DOCUMENT["cudnn_version"])):
        if backend is None:
            recording = trace_step(step, q, k, v, grad, gpu=get_gpu("h200"))
        else:
            with sdpa_kernel([backend]):
                recording = trace_step(step, q, k, v, grad, gpu=get_gpu("h200"))
    events = [[e.action, e.size] for e in recording.events[recording.step_starts[0]:]
              if e.action in ("alloc", "free_completed")]
    split = events.index(["alloc", MARKER_BYTES])
    # The marker's own free opens the backward (the GPU's recording began after it).
    return events[:split], events[split + 2:]


def _query_elements(case: dict) -> int:
    c = case["case"]
    return c["batch"] * c["heads"] * c["seq"] * c["head_dim"]


def _case_id(case: dict) -> str:
    c = case["case"]
    return (f"b{c['batch']}-h{c['heads']}-kv{c['kv_heads']}-s{c['seq']}-d{c['head_dim']}"
            f"-{'causal' if c['causal'] else 'full'}-{c['backend']}")


def _bf16_contiguous(case: dict, backend: str) -> bool:
    c = case["case"]
    return (c["backend"] == backend and c.get("dtype", "bfloat16") == "bfloat16"
            and c.get("layout", "bhsd") == "bhsd")


@pytest.mark.parametrize("case", [c for c in _CASES if _bf16_contiguous(c, "default")],
                         ids=_case_id)
def test_cudnn_attention_requests_match_the_h200(case):
    assert case["grad_fn"] == "ScaledDotProductCudnnAttentionBackward0"
    forward, backward = _recorded(case)
    assert forward == _requests(case["forward"])
    assert backward == _requests(case["backward"])


@pytest.mark.parametrize("case", [c for c in _CASES if _bf16_contiguous(c, "flash")],
                         ids=_case_id)
def test_flash_attention_requests_match_the_h200(case):
    """Also proves the step's own ``sdpa_kernel`` choice is honoured (cuDNN would be picked)."""
    forward, backward = _recorded(case)
    assert forward == _requests(case["forward"])
    assert backward == _requests(case["backward"])


@pytest.mark.parametrize("case", [c for c in _CASES if _bf16_contiguous(c, "flash")],
                         ids=_case_id)
def test_flash_backward_frees_in_the_gpus_order(case):
    """Allocations and frees interleaved as the H200's allocator saw them: mha_bwd's temporaries
    (expanded dK/dV, dq_accum, softmax_d) die first, then the grad_out and out copies, then the
    forward's saved logsumexp and philox seed/offset."""
    _, backward = _recorded_events(case)
    measured = [list(entry) for entry in case["backward"]]
    # The GPU's recording ended there; the step then frees its output (query-sized).
    assert backward[:len(measured)] == measured
    assert backward[len(measured):] == [["free_completed", 2 * _query_elements(case)]]


def test_flash_backward_copies_nothing_for_projection_layout_inputs():
    """Inputs that are [b, s, h, d] projections transposed (as models make them) need no copy:
    the backward asks for dq, dk, dv and mha_bwd's temporaries only."""
    b, h, kv, s, d = 1, 32, 8, 512, 64

    def transposed(heads: int, requires_grad: bool) -> torch.Tensor:
        t = torch.empty(b, s, heads, d, dtype=torch.bfloat16, device="meta").transpose(1, 2)
        return t.requires_grad_(requires_grad)

    q, k, v = transposed(h, True), transposed(kv, True), transposed(kv, True)
    grad = transposed(h, False)

    def step(q, k, v, grad):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.empty(MARKER_BYTES, dtype=torch.uint8)
        out.backward(grad)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        recording = trace_step(step, q, k, v, grad, gpu=get_gpu("h200"))
    sizes = [e.size for e in recording.events[recording.step_starts[0]:] if e.action == "alloc"]
    backward = sizes[sizes.index(MARKER_BYTES) + 1:]
    q_bytes, kv_bytes = b * h * s * d * 2, b * kv * s * d * 2
    # dq, dk, dv; softmax_d [b, h, 512] fp32; dq_accum [b, 512, h, 64] fp32; dk/dv expanded.
    assert backward == [q_bytes, kv_bytes, kv_bytes, b * h * s * 4, b * s * h * d * 4,
                        q_bytes, q_bytes]
