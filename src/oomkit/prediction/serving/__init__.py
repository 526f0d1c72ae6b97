"""Serving engines before start-up: vLLM's and SGLang's memory accounting, GPU-free.

``predict_vllm(VllmRequest(...))`` and ``predict_sglang(SglangRequest(...))`` walk an engine's
start-up as a modelled release computes it (weights from the config, the profile run recorded on
meta, the KV cache in blocks or tokens) and say whether it starts, why not, and which knob to
turn.
"""

from __future__ import annotations

from oomkit.prediction.serving.cuda_graph import GraphEstimate, estimate_graphs
from oomkit.prediction.serving.model_spec import (
    ServingConfigError,
    ServingModel,
    dtype_bytes,
    kv_dtype_bytes,
    read_serving_model,
)
from oomkit.prediction.serving.profile_run import ProfilePeak, RankRecorder, trace_profile_run
from oomkit.prediction.serving.sglang import (
    DEFAULT_SGLANG_VERSION,
    SGLANG_VERSIONS,
    SglangRequest,
    SglangStartup,
    default_sglang_settings,
    predict_sglang,
)
from oomkit.prediction.serving.verdict import Knob, Verdict
from oomkit.prediction.serving.vllm import VllmRequest, VllmStartup, predict_vllm
from oomkit.prediction.serving.vllm_kv_cache import KvLayout, kv_layout
from oomkit.prediction.serving.vllm_versions import (
    DEFAULT_VLLM_VERSION,
    VLLM_VERSIONS,
    VllmRules,
    vllm_rules,
)
from oomkit.prediction.serving.weights import WeightBytes, linear_bits, rank_model, weight_bytes

__all__ = [
    "DEFAULT_SGLANG_VERSION",
    "DEFAULT_VLLM_VERSION",
    "SGLANG_VERSIONS",
    "SglangRequest",
    "SglangStartup",
    "default_sglang_settings",
    "predict_sglang",
    "GraphEstimate",
    "Knob",
    "KvLayout",
    "ProfilePeak",
    "RankRecorder",
    "ServingConfigError",
    "ServingModel",
    "VLLM_VERSIONS",
    "Verdict",
    "VllmRequest",
    "VllmRules",
    "VllmStartup",
    "WeightBytes",
    "dtype_bytes",
    "estimate_graphs",
    "kv_dtype_bytes",
    "kv_layout",
    "linear_bits",
    "predict_vllm",
    "rank_model",
    "read_serving_model",
    "trace_profile_run",
    "vllm_rules",
    "weight_bytes",
]
