"""CUDA autocast emulated on meta tensors: cast policy, weight-cast cache lifetime, nesting."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from oomkit.core.trace import TraceEvent
from oomkit.prediction.tracing import (
    CUDA_AUTOCAST_POLICY,
    CudaAutocastEmulation,
    Tracer,
    TraceRecording,
    cuda_autocast_policy,
    cuda_cast_policy,
    emulated_autocast_dtype,
)

WEIGHT_BYTES = 64 * 32 * 4  # Linear(32, 64) weight, fp32
BIAS_BYTES = 64 * 4
X_BYTES = 8 * 32 * 4  # input (8, 32), fp32
START_MARK, EXIT_MARK = 3, 5  # odd byte sizes that no tensor of the model has


def _linear() -> tuple[torch.nn.Linear, torch.Tensor]:
    with torch.device("meta"):
        return torch.nn.Linear(32, 64), torch.randn(8, 32)


def _mark(size_bytes: int) -> torch.Tensor:
    return torch.empty(size_bytes, dtype=torch.uint8, device="meta")


def _record(body) -> tuple[TraceRecording, dict]:
    model, x = _linear()
    seen: dict = {}
    with Tracer() as tracer:
        tracer.track(model, x)
        tracer.mark_step()
        body(model, x, seen)
    return tracer.recording, seen


def _allocs(recording: TraceRecording, category: str) -> list[TraceEvent]:
    return [e for e in recording.events if e.action == "alloc" and _tag(e, "category") == category]


def _tag(event: TraceEvent, key: str) -> str | None:
    return dict(event.tags).get(key)


def _index(recording: TraceRecording, action: str, address: int) -> int:
    for i, event in enumerate(recording.events):
        if event.action == action and event.address == address:
            return i
    raise AssertionError(f"no {action} of {address}")


def _mark_index(recording: TraceRecording, size_bytes: int) -> int:
    for i, event in enumerate(recording.events):
        if event.action == "alloc" and event.size == size_bytes:
            return i
    raise AssertionError(f"no alloc of {size_bytes} bytes")


def test_linear_bf16_caches_weight_casts_until_exit():
    """A Linear under bf16 autocast records bf16 bias/weight copies alive until the region exits
    (cast last argument first, as GCC-built torch does: validation/fidelity-nvidia-h200-*.json)."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seen["out"] = model(x)
            _mark(START_MARK)
        _mark(EXIT_MARK)

    recording, seen = _record(body)
    assert seen["out"].dtype == torch.bfloat16
    cached = _allocs(recording, "autocast_cache")
    assert [(e.size, _tag(e, "op")) for e in cached] == [
        (BIAS_BYTES // 2, "aten._to_copy.default"),
        (WEIGHT_BYTES // 2, "aten._to_copy.default"),
    ]
    start, end = _mark_index(recording, START_MARK), _mark_index(recording, EXIT_MARK)
    for event in cached:
        assert start < _index(recording, "free_completed", event.address) < end
    assert recording.bytes_by_category["autocast_cache"] == (WEIGHT_BYTES + BIAS_BYTES) // 2


def test_input_cast_is_an_activation_saved_for_backward():
    """The bf16 copy of the input is not cached; addmm saves it to compute the weight gradient."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seen["out"] = model(x)

    recording, _ = _record(body)
    casts = [
        e
        for e in recording.events
        if e.action == "alloc"
        and _tag(e, "op") == "aten._to_copy.default"
        and e.size == X_BYTES // 2
    ]
    assert len(casts) == 1
    assert _tag(casts[0], "category") == "activation"
    assert _tag(casts[0], "saved_for_backward") == "true"


def test_cache_disabled_makes_the_weight_cast_a_temporary():
    """cache_enabled=False: the weight cast is freed right after the op, as a temporary."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            seen["out"] = model(x)
            _mark(START_MARK)

    recording, seen = _record(body)
    assert seen["out"].dtype == torch.bfloat16
    assert "autocast_cache" not in recording.bytes_by_category
    weight_casts = [
        e for e in recording.events if e.action == "alloc" and e.size == WEIGHT_BYTES // 2
    ]
    assert [_tag(e, "category") for e in weight_casts] == ["temporary"]
    freed = _index(recording, "free_completed", weight_casts[0].address)
    assert freed < _mark_index(recording, START_MARK)


def test_installed_torch_skips_the_cache_under_inference_mode():
    """torch 2.13's cached_cast has !InferenceMode::is_enabled(): the probe reads it so."""
    from oomkit.prediction.tracing.autocast import cache_skips_inference_mode

    # Checked on the dev pin (2.13); which release first added the condition is left to the probe.
    if torch.__version__ >= "2.13":
        assert cache_skips_inference_mode() is True
    else:  # pragma: no cover - older torch
        assert isinstance(cache_skips_inference_mode(), bool)


@pytest.mark.parametrize(
    ("grad_context", "cached_bytes"),
    [
        # no_grad keeps the cache: can_try_cache reads requires_grad, not GradMode.
        (torch.no_grad, (WEIGHT_BYTES + BIAS_BYTES) // 2),
        # inference_mode: nothing is cached; each cast is a temporary of its op.
        (torch.inference_mode, 0),
    ],
)
def test_weight_cast_cache_under_no_grad_and_inference_mode(grad_context, cached_bytes):
    """Two calls of one Linear: cached casts are made once, uncached ones per call."""
    from oomkit.prediction.tracing.autocast import cache_skips_inference_mode

    if grad_context is torch.inference_mode and not cache_skips_inference_mode():
        cached_bytes = (WEIGHT_BYTES + BIAS_BYTES) // 2  # pragma: no cover - an older torch

    def body(model, x, seen):
        with grad_context(), torch.autocast("cuda", dtype=torch.bfloat16):
            seen["out"] = model(x)
            seen["again"] = model(x)

    recording, seen = _record(body)
    assert seen["again"].dtype == torch.bfloat16
    assert recording.bytes_by_category.get("autocast_cache", 0) == cached_bytes
    weight_casts = [
        e for e in recording.events if e.action == "alloc" and e.size == WEIGHT_BYTES // 2
    ]
    assert len(weight_casts) == (1 if cached_bytes else 2)


def test_nested_regions_keep_the_cache_until_the_outermost_exit():
    """Inner exits do not clear the cache; a second call reuses it; the outer exit frees it."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                model(x)
            _mark(START_MARK)
            seen["out"] = model(x)
        _mark(EXIT_MARK)

    recording, seen = _record(body)
    assert seen["out"].dtype == torch.bfloat16
    cached = _allocs(recording, "autocast_cache")
    assert [e.size for e in cached] == [BIAS_BYTES // 2, WEIGHT_BYTES // 2]
    start, end = _mark_index(recording, START_MARK), _mark_index(recording, EXIT_MARK)
    for event in cached:
        assert start < _index(recording, "free_completed", event.address) < end


def test_softmax_and_layer_norm_run_in_fp32():
    """softmax (fp32_set_opt_dtype) and layer_norm (fp32) give fp32 outputs from bf16 inputs."""

    def body(model, x, seen):
        with torch.device("meta"):
            norm = torch.nn.LayerNorm(64)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
            seen["softmax"] = torch.softmax(y, -1)
            seen["layer_norm"] = norm(y)
            seen["sum"] = y.sum()

    recording, seen = _record(body)
    assert {k: v.dtype for k, v in seen.items()} == dict.fromkeys(seen, torch.float32)
    softmax_out = [e for e in recording.events if _tag(e, "op") == "aten._softmax.default"]
    assert [e.size for e in softmax_out] == [8 * 64 * 4]
    layer_norm_out = [
        e
        for e in recording.events
        if _tag(e, "op") == "aten.native_layer_norm.default" and e.action == "alloc"
    ]
    assert [e.size for e in layer_norm_out] == [8 * 64 * 4, 8 * 4, 8 * 4]


def test_fp16_softmax_takes_the_half_to_float_path_without_a_copy():
    """fp16 softmax under autocast runs _softmax(half_to_float=True): no fp32 copy of the input."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.float16):
            y = model(x)
            _mark(START_MARK)
            seen["softmax"] = torch.softmax(y, -1)

    recording, seen = _record(body)
    assert seen["softmax"].dtype == torch.float32
    after = recording.events[_mark_index(recording, START_MARK) + 1 :]
    assert [(e.size, _tag(e, "op")) for e in after if e.action == "alloc"] == [
        (8 * 64 * 4, "aten._softmax.default")
    ]


def test_backward_runs_in_the_forward_dtypes():
    """The weight gradient is computed in bf16 by mm, then cast back to fp32 for .grad."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().sum()
        _mark(START_MARK)
        loss.backward()
        seen["grad"] = model.weight.grad

    recording, seen = _record(body)
    assert seen["grad"].dtype == torch.float32
    after = recording.events[_mark_index(recording, START_MARK) :]
    backward = [(e.size, _tag(e, "op")) for e in after if _tag(e, "phase") == "backward"]
    assert (WEIGHT_BYTES // 2, "aten.mm.default") in backward
    gradients = [(e.size, _tag(e, "op")) for e in after if _tag(e, "category") == "gradient"]
    assert (WEIGHT_BYTES, "aten._to_copy.default") in gradients


def test_disabled_inner_region_does_not_cast():
    """autocast(enabled=False) nested inside an enabled region runs ops in their own dtype."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.autocast("cuda", enabled=False):
                seen["out"] = model(x)

    recording, seen = _record(body)
    assert seen["out"].dtype == torch.float32
    assert "autocast_cache" not in recording.bytes_by_category


def test_autocast_named_by_a_meta_tensors_device_is_cudas():
    """torch.autocast(x.device.type, enabled=False) with x on meta disables CUDA autocast, as on
    a GPU (transformers 4.x rotary embeddings force fp32 this way; "meta" used to raise)."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with torch.autocast(device_type=x.device.type, enabled=False):
                seen["inner"] = model(x)
                seen["inner_enabled"] = torch.is_autocast_enabled("cuda")
            seen["outer"] = model(x)

    recording, seen = _record(body)
    assert seen["inner"].dtype == torch.float32
    assert seen["inner_enabled"] is False
    assert seen["outer"].dtype == torch.bfloat16


def test_cuda_amp_autocast_defaults_to_fp16():
    """The deprecated torch.cuda.amp.autocast() casts to float16 by default."""

    def body(model, x, seen):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with torch.cuda.amp.autocast():
                seen["out"] = model(x)

    recording, seen = _record(body)
    assert seen["out"].dtype == torch.float16
    assert recording.bytes_by_category["autocast_cache"] == (WEIGHT_BYTES + BIAS_BYTES) // 2


def test_promote_runs_in_the_widest_dtype():
    """addcmul (promote) of an fp32 and two bf16 tensors runs in fp32."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            half = torch.ones(4, device="meta", dtype=torch.bfloat16)
            seen["fp32"] = torch.addcmul(torch.ones(4, device="meta"), half, half)
            seen["bf16"] = torch.addcmul(half, half, half)

    _, seen = _record(body)
    assert (seen["fp32"].dtype, seen["bf16"].dtype) == (torch.float32, torch.bfloat16)


def test_norm_appends_an_fp32_dtype():
    """norm.Scalar (fp32_append_dtype) redispatches with dtype=float32."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seen["norm"] = torch.ops.aten.norm.Scalar(model(x), 2)

    _, seen = _record(body)
    assert seen["norm"].dtype == torch.float32


def test_binary_cross_entropy_is_refused_as_on_cuda():
    """binary_cross_entropy under CUDA autocast raises PyTorch's error."""

    def body(model, x, seen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            probs = torch.sigmoid(model(x))
            torch.nn.functional.binary_cross_entropy(probs, torch.zeros_like(probs))

    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        _record(body)


def test_autocast_dtype_is_visible_to_other_emulations():
    """emulated_autocast_dtype() is bf16 inside a region, None outside or untraced."""

    def body(model, x, seen):
        seen["outside"] = emulated_autocast_dtype()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seen["inside"] = emulated_autocast_dtype()

    _, seen = _record(body)
    assert seen == {"outside": None, "inside": torch.bfloat16}
    assert emulated_autocast_dtype() is None


def test_everything_is_restored_on_exit():
    """After the emulation exits, CUDA autocast on a CPU build disables itself again."""
    emulation = CudaAutocastEmulation()
    with emulation:
        pass
    model, x = _linear()
    if torch.cuda.is_available():  # pragma: no cover - this test targets CPU builds
        pytest.skip("on a CUDA build autocast is genuinely available")
    # torch 2.5-2.8 warn "... but CUDA is not available. Disabling"; 2.10 and 2.13 "CUDA is not
    # available or torch_xla is imported. Disabling autocast."
    disabling = r"CUDA is not available( or torch_xla is imported)?\. Disabling"
    with pytest.warns(UserWarning, match=disabling):
        region = torch.autocast("cuda", dtype=torch.bfloat16)
    with region:
        assert model(x).dtype == torch.float32


def test_cached_bytes_counts_the_live_weight_casts():
    """cached_bytes is the size of the casts held by the cache while a region is open."""
    model, x = _linear()
    with CudaAutocastEmulation() as emulation:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x)
            inside = emulation.cached_bytes
        after = emulation.cached_bytes
    assert (inside, after) == ((WEIGHT_BYTES + BIAS_BYTES) // 2, 0)


def test_policy_table_matches_autocast_mode_h():
    """Spot checks of the op lists: linear low precision, layer_norm fp32, softmax.int set dtype."""
    assert cuda_cast_policy("aten.linear.default") == "lower_precision_fp"
    assert cuda_cast_policy("aten::layer_norm") == "fp32"
    assert cuda_cast_policy("softmax.int") == "fp32_set_opt_dtype"
    assert cuda_cast_policy("softmax.Dimname") is None
    assert cuda_cast_policy("norm.Scalar") == "fp32_append_dtype"
    assert cuda_cast_policy("addcmul") == "promote"
    assert cuda_cast_policy("binary_cross_entropy") == "banned"
    assert cuda_cast_policy("relu") is None
    assert len(CUDA_AUTOCAST_POLICY) == 35 + 59 + 11 + 2 + 11 + 1


def _header_list(text: str, macro: str) -> list[str]:
    body = text.split(f"#define {macro}(_)", 1)[1].split("\n\n", 1)[0]
    names = []
    for line in body.splitlines():
        line = line.strip().rstrip("\\").strip()
        if line.startswith("_(") and line.endswith(")"):
            parts = [p.strip() for p in line[2:-1].split(",")]
            names.append(".".join(parts))
    return names


def test_policy_lists_equal_the_installed_header():
    """Each AT_FORALL_* list in the installed torch's autocast_mode.h maps to its policy."""
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        pytest.skip("this torch wheel ships no ATen headers")
    text = header.read_text()
    installed = cuda_autocast_policy(torch.__version__)
    for macro, policy in (
        ("AT_FORALL_LOWER_PRECISION_FP", "lower_precision_fp"),
        ("AT_FORALL_FP32", "fp32"),
        ("AT_FORALL_FP32_SET_OPT_DTYPE", "fp32_set_opt_dtype"),
        ("AT_FORALL_PROMOTE", "promote"),
    ):
        names = _header_list(text, macro)
        assert names, macro
        listed = {n for n, p in installed.items() if p == policy}
        extra = (
            {"cudnn_convolution", "cudnn_convolution_transpose"}
            if policy == "lower_precision_fp"
            else set()
        )
        assert listed == set(names) | extra, macro


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputes_under_the_forward_autocast_state(use_reentrant):
    """Checkpointed Linear in a bf16 region: backward's recomputation casts as forward did.

    checkpoint restores the autocast state of the inputs' device type; meta must count as CUDA
    or the recomputation runs in fp32 and checkpoint rejects it (CheckpointError).
    """
    from torch.utils.checkpoint import checkpoint

    model, x = _linear()
    x.requires_grad_(True)
    with Tracer() as tracer:
        tracer.track(model, x)
        tracer.mark_step()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = checkpoint(model, x, use_reentrant=use_reentrant)
        assert y.dtype == torch.bfloat16
        y.float().sum().backward()
        assert checkpoint_module_restored() is False
    backward = [
        (e.size, _tag(e, "category"), _tag(e, "op"))
        for e in tracer.recording.events
        if e.action == "alloc" and _tag(e, "phase") == "backward"
    ]
    # The recomputation casts again under the restored bf16 state (fp32 would cast nothing),
    # last argument first as in forward: the bias (64) -> 128 B, the weight (64, 32) -> 4096 B,
    # x (8, 32) -> 512 B, cached as in forward. Non-reentrant checkpoint stops once the saved tensors are back (addmm saves its
    # inputs, not its output); reentrant reruns the whole Linear, so its bf16 output (8 * 64 *
    # 2 = 1024 B) is made again.
    casts = [(size, cat) for size, cat, op in backward if op == "aten._to_copy.default"]
    assert casts[1:4] == [
        (128, "autocast_cache"),
        (4096, "autocast_cache"),
        (512, "autocast_cache"),
    ]
    rerun = [
        size for size, cat, op in backward if op == "aten.addmm.default" and cat != "workspace"
    ]
    assert rerun == ([1024] if use_reentrant else [])


def checkpoint_module_restored() -> bool:
    """Whether torch.utils.checkpoint sees meta as meta (True outside the emulation)."""
    import torch.utils.checkpoint as ckpt

    return ckpt._infer_device_type(torch.empty(1, device="meta")) == "meta"


def test_checkpoint_device_type_is_restored_on_exit():
    """Outside the tracer, checkpoint sees meta tensors as meta again."""
    with CudaAutocastEmulation():
        assert checkpoint_module_restored() is False
    assert checkpoint_module_restored() is True


def test_other_releases_lists_follow_their_headers():
    """rms_norm is fp32 from torch 2.12 (2.11 let it through); the Dimname overloads were cast
    up to 2.12 and are not in 2.13."""
    assert cuda_autocast_policy("2.11.0+cu130").get("rms_norm") is None
    assert cuda_autocast_policy("2.12.0")["rms_norm"] == "fp32"
    assert cuda_autocast_policy("2.12.0")["softmax.Dimname"] == "fp32_set_opt_dtype"
    assert cuda_autocast_policy("2.12.0")["norm.names_ScalarOpt_dim"] == "fp32_append_dtype"
    assert cuda_autocast_policy("2.13.0+cpu") == dict(CUDA_AUTOCAST_POLICY)
    assert "softmax.Dimname" not in CUDA_AUTOCAST_POLICY
    assert len(cuda_autocast_policy("2.5.1")) == len(CUDA_AUTOCAST_POLICY) - 1 + 7


@pytest.mark.parametrize(
    ("make_weight", "cached"),
    [
        (lambda w: w, True),  # fp32 leaf that requires grad: the one cached case
        (lambda w: w.detach(), False),  # requires_grad() false
        (lambda w: w * 1, False),  # not a leaf
        (lambda w: w[:, :16], False),  # a view (is_view())
        (lambda w: w.detach().half().requires_grad_(), False),  # fp16 source: not kFloat
    ],
    ids=["weight", "no-grad", "non-leaf", "view", "fp16"],
)
def test_each_condition_of_can_try_cache(make_weight, cached):
    """autocast_mode.cpp cached_cast: to_type is the lower dtype, source kFloat, requires_grad,
    is_leaf, not a view, cache enabled (and not inference mode: tested above)."""

    def body(model, x, seen):
        weight = make_weight(model.weight)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            seen["out"] = torch.nn.functional.linear(x[:, : weight.shape[1]], weight)

    recording, seen = _record(body)
    assert seen["out"].dtype == torch.bfloat16
    cached_sizes = [e.size for e in _allocs(recording, "autocast_cache")]
    expected = WEIGHT_BYTES // 2 if cached else None
    assert cached_sizes == ([expected] if cached else [])
