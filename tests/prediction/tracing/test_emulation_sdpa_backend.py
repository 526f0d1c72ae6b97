"""The SDPA backend choice replayed from sdp_utils.cpp select_sdp_backend."""

from __future__ import annotations

import pytest

from oomkit.prediction.tracing.emulations import SdpaCall, SdpaSettings, select_sdp_backend

H100, A100, RTX3090, V100, T4 = (9, 0), (8, 0), (8, 6), (7, 0), (7, 5)


def _call(dtype="bfloat16", q=(2, 8, 128, 64), kv=None, **flags) -> SdpaCall:
    kv = kv or q
    return SdpaCall(query_shape=q, key_shape=kv, value_shape=kv, dtype=dtype, **flags)


def test_half_precision_on_hopper_runs_flash():
    """bf16, head dim 64, no mask on sm90: flash attention comes first."""
    assert select_sdp_backend(_call(), H100) == "flash_attention"


def test_fp32_runs_mem_efficient():
    """Flash needs fp16/bf16; fp32 falls to the mem-efficient kernel."""
    assert select_sdp_backend(_call("float32"), H100) == "efficient_attention"


def test_attn_mask_rules_out_flash():
    """check_for_attn_mask: an explicit mask sends bf16 to the mem-efficient kernel."""
    assert select_sdp_backend(_call(has_attn_mask=True), A100) == "efficient_attention"


def test_causal_with_unequal_lengths_rules_out_flash():
    """check_flash_causal_non_square_seqlens: is_causal with L != S is not flash."""
    call = _call(q=(2, 8, 1, 64), kv=(2, 8, 128, 64), is_causal=True)
    assert select_sdp_backend(call, H100) == "efficient_attention"


def test_volta_has_no_flash_and_no_bf16_efficient():
    """Flash needs sm80+; below sm80 the efficient kernel takes fp16/fp32 only."""
    assert select_sdp_backend(_call("float16"), V100) == "efficient_attention"
    assert select_sdp_backend(_call("bfloat16"), T4) == "math"


def test_mem_efficient_head_dim_alignment():
    """minimum_gemm_alignment: fp16 head dims must divide by 8, fp32 by 4 on sm80+."""
    assert select_sdp_backend(_call("float32", q=(1, 2, 16, 6)), A100) == "math"
    assert select_sdp_backend(_call("float32", q=(1, 2, 16, 12)), A100) == "efficient_attention"
    assert (
        select_sdp_backend(_call("float16", q=(1, 2, 16, 12), has_attn_mask=True), A100) == "math"
    )


def test_flash_head_dim_limit_and_sm86_training_rule():
    """Head dim 256 is flash, 264 is not; head dim 200 in training on sm86 is not flash."""
    assert select_sdp_backend(_call(q=(1, 2, 64, 256)), H100) == "flash_attention"
    assert select_sdp_backend(_call(q=(1, 2, 64, 264)), H100) == "efficient_attention"
    training = _call(q=(1, 2, 64, 200), requires_grad=True)
    assert select_sdp_backend(training, RTX3090) == "efficient_attention"
    assert select_sdp_backend(training, A100) == "flash_attention"


def test_grouped_query_attention():
    """enable_gqa: flash takes fewer key heads; the efficient kernel cannot, so fp32 is math."""
    gqa = {"q": (2, 8, 128, 64), "kv": (2, 2, 128, 64), "enable_gqa": True}
    assert select_sdp_backend(_call(**gqa), H100) == "flash_attention"
    assert select_sdp_backend(_call("float32", **gqa), H100) == "math"
    no_flag = _call(q=(2, 8, 128, 64), kv=(2, 2, 128, 64))
    assert select_sdp_backend(no_flag, H100) == "math"


def test_cudnn_first_with_a_new_cudnn_on_hopper_only():
    """check_prefer_cudnn_attention: cuDNN > 9.15.0 on sm90 puts cuDNN first; not on sm80."""
    new_cudnn = SdpaSettings(cudnn_version=91501)
    assert select_sdp_backend(_call(), H100, new_cudnn) == "cudnn_attention"
    assert select_sdp_backend(_call(), A100, new_cudnn) == "flash_attention"
    assert select_sdp_backend(_call(), H100, SdpaSettings(cudnn_version=91002)) == (
        "flash_attention"
    )
    deprioritized = SdpaSettings(cudnn_version=91501, cudnn_deprioritized=True)
    assert select_sdp_backend(_call(), H100, deprioritized) == "flash_attention"


def test_disabled_backends_fall_through_and_none_left_raises():
    """With flash disabled bf16 runs the efficient kernel; with everything off it raises."""
    assert select_sdp_backend(_call(), H100, SdpaSettings(flash_enabled=False)) == (
        "efficient_attention"
    )
    nothing = SdpaSettings(
        flash_enabled=False, mem_efficient_enabled=False, math_enabled=False, cudnn_enabled=False
    )
    with pytest.raises(ValueError, match="no scaled_dot_product_attention backend"):
        select_sdp_backend(_call(), H100, nothing)


def test_use_sdpa_settings_is_scoped_and_nests():
    """Inside the block the given settings are current; on exit the previous ones come back."""
    from oomkit.prediction.tracing.emulations import (
        SdpaSettings,
        current_sdpa_settings,
        default_sdpa_settings,
        use_sdpa_settings,
    )

    assert current_sdpa_settings() == default_sdpa_settings()
    with use_sdpa_settings(SdpaSettings(cudnn_version=91501)):
        assert current_sdpa_settings().cudnn_version == 91501
        with use_sdpa_settings(SdpaSettings(flash_enabled=False)):
            assert current_sdpa_settings() == SdpaSettings(flash_enabled=False)
        assert current_sdpa_settings().cudnn_version == 91501
    assert current_sdpa_settings() == default_sdpa_settings()


def test_default_settings_carry_this_installs_cudnn():
    """Outside any block the tracer uses this torch install's cuDNN (2.13's wheel: 9.20.0)."""
    import torch

    from oomkit.prediction.tracing.emulations import cudnn_build_for, default_sdpa_settings

    expected = cudnn_build_for(torch.__version__, torch.backends.cudnn.version()).version
    assert default_sdpa_settings() == SdpaSettings(cudnn_version=expected)
    if torch.__version__.startswith("2.13.") and torch.backends.cudnn.version() is None:
        assert expected == 92000  # the CPU dev build: torch 2.13's default wheel pins 9.20.0.48
