"""SDPA's emulated CUDA memory against an H200's, request by request.

``validation/sdpa-probe-h200-torch2.11.0.json`` (``scripts/probe_sdpa_on_gpu.py``; torch 2.11,
cuDNN 9.19.0) holds, for each call shape, the sizes the caching allocator was asked for in the
forward and in the backward, in order. cuDNN attention (torch's choice on sm90 with this cuDNN)
is reproduced exactly at every shape: the seed and offset, output and statistics, the forward's
256-byte workspace, and the backward's single workspace (fp32 dQ accumulator, fp32 softmax sum,
the engine's 256 bytes and, for grouped-query attention, full-head dK/dV). Flash's forward is
exact too; its grouped-query backward on the probe's layout allocates two query-sized buffers
more than the emulation records (not yet explained), so only its forward is held here.
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
    sizes = [e.size for e in recording.events[recording.step_starts[0]:] if e.action == "alloc"]
    split = sizes.index(MARKER_BYTES)
    return sizes[:split], sizes[split + 1:]


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
def test_flash_attention_forward_requests_match_the_h200(case):
    """Also proves the step's own ``sdpa_kernel`` choice is honoured (cuDNN would be picked)."""
    forward, _ = _recorded(case)
    assert forward == _requests(case["forward"])
