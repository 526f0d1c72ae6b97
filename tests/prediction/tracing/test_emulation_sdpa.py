"""SDPA recorded as the CUDA kernel runs it: fused outputs forward, workspaces backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from oomkit.core.gpus import get_gpu
from oomkit.prediction.tracing import EmulationRegistry, TraceRecording, trace_step
from oomkit.prediction.tracing.emulations import SdpaSettings, register_defaults, use_sdpa_settings

B, H, L, E = 2, 4, 100, 64
BF16 = 2
HALF_QKV_BYTES = B * H * L * E * BF16  # 102400
_TORCH = tuple(int(n) for n in torch.__version__.split(".")[:2])
# The flash forward's philox outputs as the meta kernel returns them: from torch 2.7 (flash moved
# to a third-party submodule, pytorch PR #146372) rng_state uint64[2] and an unused uint64[];
# before, a philox seed and offset, int64[] each.
FLASH_RNG_BYTES = [16, 8] if _TORCH >= (2, 7) else [8, 8]


@pytest.fixture(autouse=True)
def _cuda12_cudnn():
    """These tests trace for an H100 with cuDNN 9.10.2 (a CUDA 12 wheel), where flash comes
    first; the cuDNN tests bring a registry with their own settings."""
    with use_sdpa_settings(SdpaSettings(cudnn_version=91002)):
        yield


def _allocs(recording: TraceRecording) -> list[tuple[int, str | None, str | None]]:
    return [
        (e.size, dict(e.tags).get("op"), dict(e.tags).get("emulated"))
        for e in recording.events
        if e.action == "alloc"
    ]


def _attend_and_backward(q: torch.Tensor, **kwargs) -> None:
    F.scaled_dot_product_attention(q, q, q, **kwargs).sum().backward()


def _bf16_query(shape=(B, H, L, E)) -> torch.Tensor:
    return torch.randn(*shape, device="meta", dtype=torch.bfloat16, requires_grad=True)


def test_flash_forward_records_output_logsumexp_and_rng_state():
    """Flash on H100: output, fp32 logsumexp [B, H, L], then the philox outputs FLASH_RNG_BYTES."""
    # The installed torch's meta kernel returns the philox outputs FLASH_RNG_BYTES describes.
    small = torch.empty(1, 1, 8, 8, device="meta", dtype=torch.bfloat16)
    philox = torch.ops.aten._scaled_dot_product_flash_attention(small, small, small)[6:8]
    assert [t.numel() * t.element_size() for t in philox] == FLASH_RNG_BYTES
    recording = trace_step(_attend_and_backward, _bf16_query(), is_causal=True)
    flash = "aten._scaled_dot_product_flash_attention.default"
    assert [size for size, op, _ in _allocs(recording) if op == flash] == [
        HALF_QKV_BYTES,
        B * H * L * 4,
        *FLASH_RNG_BYTES,
    ]
    ops = {op for _, op, _ in _allocs(recording)}
    assert "aten.bmm.default" not in ops  # the math path is not what CUDA records
    assert recording.warnings == ()


def test_flash_backward_workspaces():
    """_flash_attention_backward copies grad_out (sum's expanded gradient) and out ([b, h, s, d]
    in memory) into [b, s, h, d]; then mha_bwd: dq, dk, dv, softmax_d [B, H, 128] and dq_accum
    [B, 128, H, 64] in fp32."""
    recording = trace_step(_attend_and_backward, _bf16_query(), is_causal=True)
    backward = "aten._scaled_dot_product_flash_attention_backward.default"
    assert [(size, what) for size, op, what in _allocs(recording) if op == backward] == [
        (HALF_QKV_BYTES, "flash_grad_out"),
        (HALF_QKV_BYTES, "flash_out"),
        (HALF_QKV_BYTES, None),
        (HALF_QKV_BYTES, None),
        (HALF_QKV_BYTES, None),
        (B * H * 128 * 4, "flash_softmax_d"),
        (B * 128 * H * 64 * 4, "flash_dq_accum"),
    ]
    workspace_frees = [
        e.size
        for e in recording.events
        if e.action == "free_requested" and dict(e.tags)["category"] == "workspace"
    ]
    assert workspace_frees == [B * 128 * H * 64 * 4, B * H * 128 * 4]


def test_flash_backward_with_grouped_query_attention_expands_dk_dv():
    """num_heads_k != num_heads: dk/dv expanded to the query heads as bf16 temporaries."""
    q = _bf16_query((1, 8, 128, 64))
    kv = torch.randn(1, 2, 128, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)

    def step(q, kv):
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True).sum().backward()

    recording = trace_step(step, q, kv)
    expanded = [
        size
        for size, _, what in _allocs(recording)
        if what in ("flash_dk_expanded", "flash_dv_expanded")
    ]
    assert expanded == [1 * 128 * 8 * 64 * BF16] * 2


def test_flash_pads_the_head_dim_to_a_multiple_of_8():
    """Head dim 60: q, k, v are padded to 64 (three padded copies) before the flash kernel."""
    recording = trace_step(_attend_and_backward, _bf16_query((1, 2, 16, 60)))
    pads = [
        (e.size, dict(e.tags)["phase"])
        for e in recording.events
        if e.action == "alloc" and dict(e.tags).get("op") == "aten.constant_pad_nd.default"
    ]
    # Forward pads to 64; autograd's pad backward slices the gradients back to 60.
    assert (
        pads == [(1 * 2 * 16 * 64 * BF16, "user")] * 3 + [(1 * 2 * 16 * 60 * BF16, "backward")] * 3
    )


def test_efficient_logsumexp_is_padded_to_32_rows():
    """fp32 picks the mem-efficient kernel; its logsumexp is [B, H, ceil(L/32)*32] in fp32; its
    philox seed and offset are host tensors (attention.cu: kCPU unless a graph is captured)."""
    q = torch.randn(B, H, L, E, device="meta", requires_grad=True)
    recording = trace_step(_attend_and_backward, q)
    efficient = "aten._scaled_dot_product_efficient_attention.default"
    assert [size for size, op, _ in _allocs(recording) if op == efficient] == [
        B * H * L * E * 4,
        B * H * 128 * 4,
    ]
    # Its backward's kernel workspace is emulated on H100 (mem_efficient_backward.py): no warning.
    assert not any("efficient_attention_backward" in w for w in recording.warnings)


def test_math_fallback_materialises_the_attention_matrix():
    """bf16 on a V100 has no fused kernel: the math path upcasts and keeps L x L scores (fp32),
    then _safe_softmax's temporaries: 1 byte per score, 1 byte per row, a 4-byte zero."""
    recording = trace_step(_attend_and_backward, _bf16_query(), gpu=get_gpu("v100-32gb"))
    ops = [op for _, op, _ in _allocs(recording)]
    assert "aten._scaled_dot_product_flash_attention.default" not in ops
    softmax = [size for size, op, _ in _allocs(recording) if op == "aten._safe_softmax.default"]
    assert softmax == [B * H * L * L * 4, B * H * L * L, B * H * L, 4]


def test_no_logsumexp_without_grad():
    """Inference: should_compute_logsumexp is False, so the efficient kernel's lse is empty."""
    q = torch.randn(B, H, L, E, device="meta")
    recording = trace_step(lambda t: F.scaled_dot_product_attention(t, t, t), q)
    efficient = "aten._scaled_dot_product_efficient_attention.default"
    assert [size for size, op, _ in _allocs(recording) if op == efficient] == [B * H * L * E * 4]


def test_autocast_casts_before_the_backend_choice():
    """fp32 activations under bf16 autocast are cast first (3 bf16 copies), so flash runs."""
    x = torch.randn(B, H, L, E, device="meta", requires_grad=True)

    def step(x):
        q = x * 2.0  # a non-leaf activation: autocast casts it once per argument
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.float().sum().backward()

    recording = trace_step(step, x)
    forward = [
        (e.size, dict(e.tags).get("op"))
        for e in recording.events
        if e.action == "alloc" and dict(e.tags)["phase"] == "user"
    ]
    assert forward[2:9] == [
        (HALF_QKV_BYTES, "aten._to_copy.default"),
        (HALF_QKV_BYTES, "aten._to_copy.default"),
        (HALF_QKV_BYTES, "aten._to_copy.default"),
        (HALF_QKV_BYTES, "aten._scaled_dot_product_flash_attention.default"),
        (B * H * L * 4, "aten._scaled_dot_product_flash_attention.default"),
        *[(size, "aten._scaled_dot_product_flash_attention.default") for size in FLASH_RNG_BYTES],
    ]


def test_autocast_casts_a_leaf_once():
    """A leaf that requires grad passed as q, k and v is cast once (autocast's cached_cast)."""
    q = torch.randn(B, H, L, E, device="meta", requires_grad=True)

    def step(q):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)

    recording = trace_step(step, q)
    casts = [size for size, op, _ in _allocs(recording) if op == "aten._to_copy.default"]
    assert casts == [HALF_QKV_BYTES]


EFFICIENT_BWD = "aten._scaled_dot_product_efficient_attention_backward.default"
FP32_QKV_BYTES = B * H * L * E * 4
# H100, E=64, L=100: fmha_cutlassB_{f32,bf16}_aligned_64x64_k64(_sm80) runs; only the dQ
# accumulator: ceil(100/64)=2 query blocks * ceil(64/64)=1 column * (16 + 4*64*64) bytes of
# GradQTempStorage = 8200 floats per (batch, head), so 2 * 4 * 8200 * 4 bytes.
EFFICIENT_WORKSPACE_BYTES = B * H * 8200 * 4  # 262400


def _op_allocs(recording: TraceRecording, op: str) -> list[tuple[int, str | None]]:
    return [(size, what) for size, name, what in _allocs(recording) if name == op]


def test_efficient_backward_fp32_copies_grad_out_and_computes_delta():
    """fp32: grad_out copy, dq/dk/dv, delta's product [B,L,H,E] and sum, delta, kernel workspace."""
    q = torch.randn(B, H, L, E, device="meta", requires_grad=True)
    recording = trace_step(_attend_and_backward, q)
    assert _op_allocs(recording, EFFICIENT_BWD) == [
        (FP32_QKV_BYTES, "efficient_grad_out"),
        (FP32_QKV_BYTES, None),
        (FP32_QKV_BYTES, None),
        (FP32_QKV_BYTES, None),
        (B * L * H * E * 4, "efficient_delta_product"),
        (B * H * L * 4, "efficient_delta_sum"),
        (B * H * L * 4, "efficient_delta"),
        (EFFICIENT_WORKSPACE_BYTES, "efficient_workspace"),
    ]
    emulated = {
        e.address: dict(e.tags)["emulated"]
        for e in recording.events
        if e.action == "alloc" and "emulated" in dict(e.tags)
    }
    frees = [
        emulated[e.address]
        for e in recording.events
        if e.action == "free_requested" and e.address in emulated
    ]
    assert frees == [
        "efficient_delta_sum",
        "efficient_delta_product",
        "efficient_delta",
        "efficient_workspace",
        "efficient_grad_out",
    ]


def test_efficient_backward_half_has_a_kernel_delta_and_no_copy_for_a_bmhk_gradient():
    """bf16 with a mask (not flash): fp32 delta [B, H, L] only; a (B, L, H, E) grad is not copied."""
    q = _bf16_query()
    mask = torch.zeros(L, L, device="meta", dtype=torch.bfloat16)
    w = torch.randn(H * E, 8, device="meta", dtype=torch.bfloat16)

    def step(q, mask, w):
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        # As in a transformer block: back to (B, L, H*E), then a projection, so the gradient
        # reaching SDPA is a transposed view of a contiguous (B, L, H, E) tensor.
        (out.transpose(1, 2).reshape(B, L, H * E) @ w).sum().backward()

    recording = trace_step(step, q, mask, w)
    assert _op_allocs(recording, EFFICIENT_BWD) == [
        (HALF_QKV_BYTES, None),
        (HALF_QKV_BYTES, None),
        (HALF_QKV_BYTES, None),
        (B * H * L * 4, "efficient_delta"),
        (EFFICIENT_WORKSPACE_BYTES, "efficient_workspace"),
    ]
    assert recording.warnings == ()


def _cudnn_registry() -> EmulationRegistry:
    registry = EmulationRegistry()
    register_defaults(registry, sdpa=SdpaSettings(cudnn_version=91501))
    return registry


def test_cudnn_attention_records_output_and_softmax_stats():
    """cuDNN 9.15.1 on H100 prefers cuDNN SDPA: philox seed and offset, bf16 output and fp32
    stats [B, H, L, 1], then the graph's 256-byte workspace (sm90, measured on an H200)."""
    recording = trace_step(
        _attend_and_backward, _bf16_query(), is_causal=True, emulations=_cudnn_registry()
    )
    forward = "aten._scaled_dot_product_cudnn_attention.default"
    backward = "aten._scaled_dot_product_cudnn_attention_backward.default"
    assert _op_allocs(recording, forward) == [
        (8, None), (8, None), (HALF_QKV_BYTES, None), (B * H * L * 1 * 4, None),
        (256, "cudnn_workspace"),
    ]
    # dq, dk, dv; sum()'s gradient is an expand (innermost stride 0), so cuDNN gets a contiguous
    # copy; then one graph workspace: the frontend's fp32 dQ accumulator [B, H, L, E] and fp32
    # softmax sum [B, H, L, 1], and the engine's 256 bytes (no grouped-query heads here).
    assert _op_allocs(recording, backward) == [(HALF_QKV_BYTES, None)] * 3 + [
        (HALF_QKV_BYTES, "cudnn_grad_out"),
        (B * H * L * E * 4 + B * H * L * 4 + 256, "cudnn_workspace"),
    ]
    emulated = {
        e.address: dict(e.tags)["emulated"]
        for e in recording.events
        if e.action == "alloc" and "emulated" in dict(e.tags)
    }
    freed = [emulated[e.address] for e in recording.events if e.action == "free_requested"
             and e.address in emulated]
    # The forward's workspace; then the backward's workspace_ptr first, then dO_.
    assert freed == ["cudnn_workspace", "cudnn_workspace", "cudnn_grad_out"]
    assert recording.warnings == ()
    assert recording.assumptions == {"cuDNN": "9.15.1 (as given)"}


def test_cudnn_attention_engine_workspace_is_left_out_off_sm90():
    """On a B200 (sm100) the engine's workspace was never measured: the frontend's part only,
    with a warning for each op."""
    recording = trace_step(
        _attend_and_backward, _bf16_query(), is_causal=True, emulations=_cudnn_registry(),
        gpu=get_gpu("b200"),
    )
    forward = "aten._scaled_dot_product_cudnn_attention.default"
    backward = "aten._scaled_dot_product_cudnn_attention_backward.default"
    assert [what for _, what in _op_allocs(recording, forward)] == [None] * 4
    assert _op_allocs(recording, backward)[-1] == (
        B * H * L * E * 4 + B * H * L * 4, "cudnn_workspace"
    )
    assert [w.split(" ran ")[0] for w in recording.warnings] == [forward, backward]
    assert "beyond the frontend's fp32 dQ accumulator and softmax sum" in recording.warnings[1]


def _weighted_backward(x: torch.Tensor) -> None:
    # The usual layout: q is a (B, L, H, E) tensor transposed to (B, H, L, E), so the output
    # (allocated in q's layout) has (B, L, H, E) strides; (out * w).sum() makes its gradient w,
    # a contiguous (B, H, L, E) tensor: unit inner stride, other strides unlike out's.
    q = x.transpose(1, 2)
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    w = torch.randn(B, H, L, E, device="meta", dtype=torch.bfloat16)
    (out * w).sum().backward()


def test_cudnn_backward_copies_grad_out_by_the_versions_stride_rule():
    """cuDNN >= 9.5.1 takes any grad_out with unit inner stride; older cuDNN needs out's strides."""
    backward = "aten._scaled_dot_product_cudnn_attention_backward.default"
    # 9.5.0 does not put cuDNN first on an H100: the other backends are turned off to reach it.
    only_cudnn = {"flash_enabled": False, "mem_efficient_enabled": False, "math_enabled": False}
    # 9.5.0 copies because out has q's (B, L, H, E) layout, as CUDA allocates it from torch 2.6 on
    # (MHA.cpp alloc_with_matching_layout, pytorch PR #138354); torch 2.5 allocates out
    # contiguous, like w, so there is nothing to copy. (torch 2.6's meta kernel still allocates
    # out contiguous, fixed in 2.7 by PR #148921: there the recorder misses the copy and this fails.)
    for version, copied in ((91501, False), (90500, _TORCH >= (2, 6))):
        registry = EmulationRegistry()
        register_defaults(registry, sdpa=SdpaSettings(cudnn_version=version, **only_cudnn))
        x = torch.randn(B, L, H, E, device="meta", dtype=torch.bfloat16, requires_grad=True)
        recording = trace_step(_weighted_backward, x, emulations=registry)
        whats = [what for _, what in _op_allocs(recording, backward)]
        assert whats == [None] * 3 + ["cudnn_grad_out"] * copied + ["cudnn_workspace"], version


def test_multihead_attention_runs_the_fused_kernel():
    """nn.MultiheadAttention calls SDPA from inside F.multi_head_attention_forward: still flash."""
    with torch.device("meta"):
        mha = torch.nn.MultiheadAttention(H * E, H, batch_first=True, dtype=torch.bfloat16)
    x = torch.randn(B, L, H * E, device="meta", dtype=torch.bfloat16, requires_grad=True)

    def step(m, x):
        m(x, x, x, need_weights=False)[0].sum().backward()

    recording = trace_step(step, mha, x)
    ops = {op for _, op, _ in _allocs(recording)}
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert "aten._scaled_dot_product_flash_attention_backward.default" in ops
    assert "aten.bmm.default" not in ops  # not the math path's L x L scores
    flash = [
        size
        for size, op, _ in _allocs(recording)
        if op == "aten._scaled_dot_product_flash_attention.default"
    ]
    assert flash[:2] == [HALF_QKV_BYTES, B * H * L * 4]
    assert recording.warnings == ()


def test_recording_lists_the_sdpa_backends_chosen():
    """fp32 on an H100 runs the mem-efficient kernel, bf16 flash: the recording counts each."""
    import torch.nn.functional as F

    from oomkit.core.gpus import get_gpu
    from oomkit.prediction.tracing import trace_step

    def attend(q):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.scaled_dot_product_attention(
            q.to(torch.bfloat16), q.to(torch.bfloat16), q.to(torch.bfloat16)
        )

    q = torch.randn(2, 4, 32, 64, device="meta")
    recording = trace_step(attend, q, steps=2, gpu=get_gpu("h100-sxm"))
    assert recording.kernel_choices == {"SDPA efficient_attention": 2, "SDPA flash_attention": 2}
