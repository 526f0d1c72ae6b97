"""The mem-efficient SDPA backward's cutlass kernel choice and workspace (kernel_backward.h).

Hand arithmetic in the comments uses kernel_backward.h ``Params``:
  gk = splits * BJ * align_up(K, BI)          (only when kNeedsAccumGradK: half, kMaxK > BI)
  gv = splits * BJ * align_up(Kv, BI)         (likewise)
  gq = ceil(M / BI) * ceil(K / BJ) * (16 + 4 * BI * BJ) / 4   (kNeedsAccumGradQ: sm >= 70 or half)
  bytes = B * nH * align_up(gk + gv + gq, 4) * 4
and attention_backward.cu's split heuristic: splits = ceil(N / BJ); 1 when B * nH >= 256 and
N <= 2 * BJ; min(splits, 200 // (B * nH)) when gk/gv exist; 1 below 1 or on Sm50 kernels.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from oomkit.core.gpus import get_gpu
from oomkit.prediction.tracing import TraceRecording, trace_step
from oomkit.prediction.tracing.emulations.mem_efficient_backward import (
    CutlassBKernel,
    EfficientBackwardConfig,
    UnresolvedKernel,
    cutlass_backward_kernels,
    efficient_backward_config,
    num_splits_key,
    select_backward_kernel,
)

EFFICIENT_BWD = "aten._scaled_dot_product_efficient_attention_backward.default"


def _config(
    cc: tuple[int, int],
    dtype: str,
    batch: int,
    heads: int,
    seq: int,
    head_dim: int,
    *,
    dropout: bool = False,
    deterministic: bool = False,
) -> EfficientBackwardConfig | UnresolvedKernel:
    return efficient_backward_config(
        cc,
        dtype,  # type: ignore[arg-type]
        num_batches=batch,
        num_heads=heads,
        num_queries=seq,
        num_keys=seq,
        head_dim=head_dim,
        head_dim_value=head_dim,
        dropout=dropout,
        head_strides=(seq * head_dim,) * 3,  # contiguous (B, H, L, K)
        deterministic=deterministic,
    )


def _resolved(config: EfficientBackwardConfig | UnresolvedKernel) -> EfficientBackwardConfig:
    assert isinstance(config, EfficientBackwardConfig), config
    return config


def test_a100_fp16_k128_keeps_dk_dv_in_registers():
    """A100 fp16 K=128 L=1024: 128x128 k128 seqaligned, only the dQ accumulator (8,390,656 B)."""
    # 1024 % 128 == 0 picks the _seqaligned twin; kOutputInRF (128 <= 128): no gk/gv.
    # gq = 8 blocks * 1 column * (16 + 4*128*128) / 4 = 8 * 16388 = 131104; * 2*8 BH * 4 B.
    config = _resolved(_config((8, 0), "float16", 2, 8, 1024, 128))
    assert config.kernel.name == "fmha_cutlassB_f16_aligned_128x128_k128_seqaligned_sm80"
    assert (config.kernel.block_size_i, config.kernel.block_size_j, config.kernel.max_k) == (
        128,
        128,
        128,
    )
    assert not config.kernel.needs_accum_grad_k and config.kernel.needs_accum_grad_q
    assert config.num_splits_key == 8  # ceil(1024 / 128); parallelism 16 < 256
    assert config.workspace_bytes == 2 * 8 * 131104 * 4 == 8_390_656
    assert config.zero_workspace  # should_zero_workspace: num_splits_key > 1


def test_sm86_fp16_k128_falls_back_to_64x64_with_dk_dv_accumulators():
    """A10 (99 KiB shmem): the 128x128 k128 kernel does not fit; 64x64 k128 adds gk/gv."""
    # splits = min(ceil(1024/64)=16, 200 // 16 = 12) = 12.
    # gk = gv = 12 * 64 * align_up(128, 64) = 98304; gq = 16 * 2 * 4100 = 131200.
    # (98304 * 2 + 131200) = 327808 per BH; * 16 BH * 4 B.
    config = _resolved(_config((8, 6), "float16", 2, 8, 1024, 128))
    assert config.kernel.name == "fmha_cutlassB_f16_aligned_64x64_k128_seqaligned_sm80"
    assert config.kernel.needs_accum_grad_k and config.kernel.needs_accum_grad_v
    assert config.num_splits_key == 12
    assert config.workspace_bytes == 16 * 327808 * 4 == 20_979_712


def test_sm86_head_dim_96_uses_its_dedicated_kernel_but_a100_does_not():
    """K=96: sm86 dispatches the 128x64 k96 kernel (4,196,352 B), A100 the 128x128 k128 one."""
    # sm86: gq = ceil(1000/128)=8 * ceil(96/64)=2 * (16 + 4*128*64)/4 = 8*2*8196 = 131136.
    sm86 = _resolved(_config((8, 6), "float16", 1, 8, 1000, 96))
    assert sm86.kernel.name == "fmha_cutlassB_f16_aligned_128x64_k96_sm80"
    assert sm86.workspace_bytes == 8 * 131136 * 4 == 4_196_352
    # sm80: gq = 8 * ceil(96/128)=1 * 16388 = 131104 (1000 % 128 != 0: not _seqaligned).
    sm80 = _resolved(_config((8, 0), "float16", 1, 8, 1000, 96))
    assert sm80.kernel.name == "fmha_cutlassB_f16_aligned_128x128_k128_sm80"
    assert sm80.workspace_bytes == 8 * 131104 * 4 == 4_195_328


def test_dropout_on_sm86_moves_head_dim_96_to_the_64x64_kernel():
    """The k96 kernel has no dropout: with dropout sm86 runs 64x64 k128 dropout (12,587,008 B)."""
    # splits = min(16, 200 // 8 = 25) = 16; gk = gv = 16 * 64 * 128 = 131072;
    # gq = 16 * 2 * 4100 = 131200; (2 * 131072 + 131200) = 393344 per BH.
    config = _resolved(_config((8, 6), "float16", 1, 8, 1000, 96, dropout=True))
    assert config.kernel.name == "fmha_cutlassB_f16_aligned_64x64_k128_dropout_sm80"
    assert config.workspace_bytes == 8 * 393344 * 4 == 12_587_008


def test_dropout_on_h100_keeps_the_same_block_sizes():
    """H100 bf16 K=128: the dropout kernel is 128x128 k128 too, so the workspace is unchanged."""
    plain = _resolved(_config((9, 0), "bfloat16", 2, 8, 1024, 128))
    dropout = _resolved(_config((9, 0), "bfloat16", 2, 8, 1024, 128, dropout=True))
    assert dropout.kernel.name == "fmha_cutlassB_bf16_aligned_128x128_k128_dropout_sm80"
    assert dropout.workspace_bytes == plain.workspace_bytes == 8_390_656


def test_fp32_block_sizes_differ_between_sm80_and_sm75():
    """fp32 K=128 L=1000: A100 runs 128x64 (8,392,704 B), T4 64x64 (8,396,800 B); gq only."""
    # fp32 never needs gk/gv (output_t is float). sm80: 8 blocks * 2 cols * (4 + 128*64) =
    # 131136; sm75: 16 blocks * 2 cols * (4 + 64*64) = 131200; * 16 BH * 4 B.
    sm80 = _resolved(_config((8, 0), "float32", 2, 8, 1000, 128))
    sm75 = _resolved(_config((7, 5), "float32", 2, 8, 1000, 128))
    assert sm80.kernel.name == "fmha_cutlassB_f32_aligned_128x64_k128_sm80"
    assert sm75.kernel.name == "fmha_cutlassB_f32_aligned_64x64_k128_sm75"
    assert sm80.workspace_bytes == 16 * 131136 * 4 == 8_392_704
    assert sm75.workspace_bytes == 16 * 131200 * 4 == 8_396_800


def test_v100_fp16_k128_and_t4_fp16_k64():
    """sm70 fp16 K=128 runs 128x64 k128 (4,196,352 B); sm75 fp16 K=64 runs 64x64 (2,099,200 B)."""
    # sm70: gq = 8 * 2 * 8196 = 131136 per BH, 8 BH. sm75: gq = 16 * 1 * 4100 = 65600.
    v100 = _resolved(_config((7, 0), "float16", 1, 8, 1000, 128))
    assert v100.kernel.name == "fmha_cutlassB_f16_aligned_128x64_k128_sm70"
    assert v100.kernel.kernel_computes_delta  # kOutputInRF on Sm70
    assert v100.workspace_bytes == 8 * 131136 * 4 == 4_196_352
    t4 = _resolved(_config((7, 5), "float16", 1, 8, 1000, 64))
    assert t4.workspace_bytes == 8 * 65600 * 4 == 2_099_200


def test_v100_fp16_64x64_k128_kernel_does_not_compute_delta():
    """kKernelComputesDelta is false for a half Sm70 kernel whose dK/dV are not in registers."""
    kernel = CutlassBKernel(70, "float16", True, False, False, 64, 64, 128)
    assert not kernel.kernel_computes_delta
    assert kernel.minimum_alignment == 2


def test_head_dim_above_128_splits_keys_with_the_sequence():
    """bf16 K=256 on H100 (128x64 k65536): 8 splits at L=512, capped at 200 // 4 = 50 at 8192."""
    # L=512: gk = gv = 8 * 64 * 256 = 131072; gq = 4 * 4 * 8196 = 131136 -> 393280 per BH.
    short = _resolved(_config((9, 0), "bfloat16", 1, 4, 512, 256))
    assert short.kernel.name == "fmha_cutlassB_bf16_aligned_128x64_k65536_sm80"
    assert short.num_splits_key == 8
    assert short.workspace_bytes == 4 * 393280 * 4 == 6_292_480
    # L=8192: gk = gv = 50 * 64 * 256 = 819200; gq = 64 * 4 * 8196 = 2098176 -> 3736576.
    long = _resolved(_config((9, 0), "bfloat16", 1, 4, 8192, 256))
    assert long.num_splits_key == 50
    assert long.workspace_bytes == 4 * 3736576 * 4 == 59_785_216


def test_enough_parallelism_and_short_keys_means_one_split():
    """B*nH = 512 >= 256 and N = 128 <= 2*64: one split, no zero-fill (134,250,496 B)."""
    # gk = gv = 64 * 256 = 16384; gq = 1 * 4 * 8196 = 32784 -> 65552 per BH, 512 BH.
    config = _resolved(_config((9, 0), "bfloat16", 32, 16, 128, 256))
    assert config.num_splits_key == 1
    assert not config.zero_workspace
    assert config.workspace_bytes == 512 * 65552 * 4 == 134_250_496


def test_deterministic_mode_forces_one_split():
    """use_deterministic_algorithms(True): num_splits_key = 1, so gk/gv shrink (9,445,376 B)."""
    # gk = gv = 1 * 64 * 128 = 8192; gq = 131200 -> 147584 per BH, 16 BH.
    config = _resolved(_config((8, 6), "float16", 2, 8, 1024, 128, deterministic=True))
    assert config.num_splits_key == 1
    assert config.workspace_bytes == 16 * 147584 * 4 == 9_445_376


def test_sm50_kernels_fp32_have_no_workspace_half_has_dq():
    """Sm50 kernels disable split keys: fp32 needs no accumulator; fp16 keeps gq (262,400 B)."""
    assert _resolved(_config((6, 1), "float32", 1, 8, 100, 64)).workspace_bytes == 0
    # fp16: gq = 2 blocks * 1 col * 4100 = 8200 per BH, 8 BH.
    half = _resolved(_config((6, 1), "float16", 1, 8, 100, 64))
    assert (half.num_splits_key, half.workspace_bytes) == (1, 8 * 8200 * 4)


def test_sm121_dispatches_as_sm120_without_the_k96_kernel():
    """computeCapability 121 -> 120; K=96 there runs 64x64 k128 (no cc==86||89 kernel)."""
    assert _config((12, 1), "float16", 2, 8, 1024, 128) == _config(
        (12, 0), "float16", 2, 8, 1024, 128
    )
    config = _resolved(_config((12, 0), "float16", 1, 8, 1000, 96))
    assert config.kernel.name == "fmha_cutlassB_f16_aligned_64x64_k128_sm80"
    assert config.workspace_bytes == 12_587_008


def test_undecidable_shared_memory_fit_is_unresolved():
    """fp32 K=128 on sm86 hinges on whether 128x64 k128 fits 99 KiB: not guessed."""
    config = _config((8, 6), "float32", 2, 8, 1000, 128)
    assert isinstance(config, UnresolvedKernel)
    assert "fmha_cutlassB_f32_aligned_128x64_k128_sm80" in config.reason
    assert "shared memory" in config.reason


def test_no_kernel_for_bf16_before_sm80():
    """dispatch_cutlassB has no bf16 kernel for sm75."""
    config = _config((7, 5), "bfloat16", 1, 8, 100, 64)
    assert isinstance(config, UnresolvedKernel)
    assert "no bfloat16 kernel for sm75" in config.reason


def test_misaligned_head_stride_rejects_sm80_kernels():
    """A head stride of 6 elements fails kMinimumAlignment 4 on sm80 but not 2 on Volta fp16."""
    kwargs = dict(
        head_dim=64,
        head_dim_value=64,
        num_queries=128,
        num_keys=128,
        dropout=False,
        head_strides=(6, 64, 64),
    )
    assert isinstance(select_backward_kernel((8, 0), "float16", **kwargs), UnresolvedKernel)
    chosen = select_backward_kernel((7, 0), "float16", **kwargs)
    assert isinstance(chosen, CutlassBKernel)
    assert chosen.name == "fmha_cutlassB_f16_aligned_64x64_k64_seqaligned_sm70"


def test_num_splits_key_wraps_like_int16():
    """p.num_splits_key is int16_t: 40000 splits wrap negative and fall back to 1."""
    kernel = CutlassBKernel(80, "float32", True, False, False, 64, 64, 64)
    assert num_splits_key(kernel, num_batches=1, num_heads=1, num_keys=64 * 30000) == 30000
    assert num_splits_key(kernel, num_batches=1, num_heads=1, num_keys=64 * 40000) == 1


_HEADER = (
    Path(torch.__file__).parent
    / "include/ATen/native/transformers/cuda/mem_eff_attention/kernels/cutlassB.h"
)


_CUDA_12_4_ONLY = "#if defined(CUDA_VERSION) && CUDA_VERSION == 12040 && !defined(USE_ROCM)"


def _lines_compiled_without_cuda_12_4(body: str) -> list[str]:
    # torch 2.8-2.11 headers put two 32x32 sm50 f32 dropout kernels under _CUDA_12_4_ONLY and the
    # usual 64x64 ones under its #else, which the default PyPI wheels (CUDA 12.8) compile.
    lines, in_cuda_12_4_branch = [], False
    for line in body.strip().splitlines():
        directive = line.strip()
        if directive.startswith("#if"):
            assert directive == _CUDA_12_4_ONLY, directive
            in_cuda_12_4_branch = True
        elif directive in ("#else", "#endif"):
            in_cuda_12_4_branch = False
        elif not in_cuda_12_4_branch:
            lines.append(line)
    return lines


@pytest.mark.skipif(not _HEADER.exists(), reason="torch ships no cutlassB.h header")
def test_kernel_lists_match_the_installed_cutlassB_header():
    """Every dispatch_cutlassB_<dtype>_sm<N> list equals the generated one, in order."""
    dtypes = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
    first_cc = {50: (5, 0), 70: (7, 0), 75: (7, 5), 80: (8, 6)}  # sm86 also gets the k96 kernel
    text = _HEADER.read_text()
    families = re.findall(
        r"void dispatch_cutlassB_(\w+)_sm(\d+)\(T cb, int cc\) \{(.*?)\n\}", text, re.S
    )
    assert len(families) == 9
    for short, sm, body in families:
        expected = []
        for line in _lines_compiled_without_cuda_12_4(body):
            args = re.search(r"AttentionBackwardKernel<([^>]*)>\(\)", line)
            assert args is not None
            a = [x.strip() for x in args.group(1).split(",")]
            flags = [x == "true" for x in a[2:5]]
            seq = len(a) > 8 and a[8] == "true"
            expected.append((*flags, int(a[5]), int(a[6]), int(a[7]), seq))
        got = [
            (
                k.is_aligned,
                k.apply_dropout,
                k.preload,
                k.block_size_i,
                k.block_size_j,
                k.max_k,
                k.keys_queries_aligned,
            )
            for k in cutlass_backward_kernels(first_cc[int(sm)], dtypes[short])  # type: ignore[arg-type]
        ]
        assert got == expected, (short, sm)


_RESOLVED_CCS = [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]


@settings(max_examples=200, deadline=None)
@given(
    cc=st.sampled_from(_RESOLVED_CCS),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    batch=st.integers(1, 64),
    heads=st.integers(1, 32),
    head_dim=st.integers(1, 40).map(lambda n: 8 * n),
    dropout=st.booleans(),
    seq=st.integers(1, 100_000),
    extra=st.integers(0, 50_000),
)
def test_workspace_is_16_byte_aligned_and_monotone_in_sequence_length(
    cc, dtype, batch, heads, head_dim, dropout, seq, extra
):
    """Bytes are a multiple of 16 and never shrink as L (= N) grows, other inputs fixed."""
    # Holds below ceil(N / BJ) = 32768, where the int16 num_splits_key would wrap.
    shorter = _config(cc, dtype, batch, heads, seq, head_dim, dropout=dropout)
    longer = _config(cc, dtype, batch, heads, seq + extra, head_dim, dropout=dropout)
    if isinstance(shorter, UnresolvedKernel) or isinstance(longer, UnresolvedKernel):
        # The kernel choice never depends on L except through same-sized _seqaligned twins.
        assert isinstance(shorter, UnresolvedKernel) == isinstance(longer, UnresolvedKernel)
        return
    assert shorter.workspace_bytes % 16 == 0
    assert shorter.workspace_bytes <= longer.workspace_bytes


# End to end through the tracer.


def _events(recording: TraceRecording) -> list[tuple[str, int, str | None]]:
    names: dict[int, str | None] = {}
    out = []
    for e in recording.events:
        tags = dict(e.tags)
        if e.action == "alloc":
            names[e.address] = tags.get("emulated")
            if tags.get("op") == EFFICIENT_BWD:
                out.append(("alloc", e.size, tags.get("emulated")))
        elif e.action == "free_requested" and (names.get(e.address) or "").startswith("efficient"):
            out.append(("free", e.size, names[e.address]))
    return out


def test_tracer_records_the_workspace_after_delta_and_frees_it_before_grad_out():
    """A100 fp32 K=128: 128x64 k128 workspace (262,272 B) after delta; freed after delta."""
    # gq = ceil(200/128)=2 blocks * ceil(128/64)=2 cols * (4 + 128*64) = 32784 per BH, 2 BH.
    workspace = 1 * 2 * 32784 * 4
    q = torch.randn(1, 2, 200, 128, device="meta", requires_grad=True)

    def step(q):
        F.scaled_dot_product_attention(q, q, q).sum().backward()

    recording = trace_step(step, q, gpu=get_gpu("a100-80gb"))
    qkv = 1 * 2 * 200 * 128 * 4
    delta = 1 * 2 * 200 * 4
    assert _events(recording) == [
        ("alloc", qkv, "efficient_grad_out"),
        ("alloc", qkv, None),
        ("alloc", qkv, None),
        ("alloc", qkv, None),
        ("alloc", 1 * 200 * 2 * 128 * 4, "efficient_delta_product"),
        ("alloc", delta, "efficient_delta_sum"),
        ("alloc", delta, "efficient_delta"),
        ("free", delta, "efficient_delta_sum"),
        ("free", 1 * 200 * 2 * 128 * 4, "efficient_delta_product"),
        ("alloc", workspace, "efficient_workspace"),
        ("free", delta, "efficient_delta"),
        ("free", workspace, "efficient_workspace"),
        ("free", qkv, "efficient_grad_out"),
    ]
    assert workspace == 262_272
    categories = {
        dict(e.tags).get("category")
        for e in recording.events
        if e.action == "alloc" and dict(e.tags).get("emulated") == "efficient_workspace"
    }
    assert categories == {"workspace"}
    assert not any(EFFICIENT_BWD in w for w in recording.warnings)


def test_tracer_warns_with_the_reason_when_the_kernel_is_unresolved():
    """A10G fp32 K=128: the shared-memory fit is undecidable, so the workspace is a warning."""
    q = torch.randn(1, 2, 200, 128, device="meta", requires_grad=True)

    def step(q):
        F.scaled_dot_product_attention(q, q, q).sum().backward()

    recording = trace_step(step, q, gpu=get_gpu("a10g"))
    assert not [e for e in _events(recording) if e[2] == "efficient_workspace"]
    warnings = [w for w in recording.warnings if EFFICIENT_BWD in w]
    assert len(warnings) == 1
    assert "fmha_cutlassB_f32_aligned_128x64_k128_sm80" in warnings[0]


@pytest.mark.parametrize(("dropout_p", "expected"), [(0.0, 4_196_352), (0.1, 12_587_008)])
def test_tracer_dropout_changes_the_sm86_kernel(dropout_p, expected):
    """A10G fp16 K=96 with a mask: 128x64 k96 without dropout, 64x64 k128 dropout with it."""
    # The byte counts are worked out in the two sm86 K=96 tests above.
    q = torch.randn(1, 8, 1000, 96, device="meta", dtype=torch.float16, requires_grad=True)
    mask = torch.zeros(1000, 1000, device="meta", dtype=torch.float16)

    def step(q, mask):
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=dropout_p)
        out.sum().backward()

    recording = trace_step(step, q, mask, gpu=get_gpu("a10g"))
    assert [e[1] for e in _events(recording) if e[:3:2] == ("alloc", "efficient_workspace")] == [
        expected
    ]
    assert not any(EFFICIENT_BWD in w for w in recording.warnings)
