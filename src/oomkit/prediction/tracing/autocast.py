"""CUDA autocast on meta tensors: the casts, dtypes and weight-cast cache a GPU run would make.

Why it is needed: on a CPU-only torch build, or a CUDA build on a machine without a GPU,
``torch.autocast("cuda")`` disables itself with a warning, and even where it is enabled, meta tensors do not carry the ``AutocastCUDA`` dispatch
key, so nothing is cast and every activation stays fp32.

How it works (all undone on exit):
- ``torch.autocast("cuda", ...)`` and ``torch.cuda.amp.autocast`` construct as on a CUDA build:
  their ``__init__`` runs with ``amp_definitely_not_available()`` answering False (and bf16
  reported supported, as ``torch.cuda.is_bf16_supported()`` does for every CUDA GPU by
  emulation). Their own ``__enter__``/``__exit__`` then keep the enabled flag, dtype, nesting
  and ``cache_enabled`` in torch's thread-local state, exactly as on a GPU.
- The ``AutocastCUDA`` key is added to the thread's *included* dispatch keys, so ops on meta
  tensors pass through it whenever autocast is enabled for CUDA (enabled = not excluded).
- A Python kernel per wrapped overload (``autocast_policy.cuda_autocast_policy``) is registered
  on that key. Like the C++ ``WrapFunction_`` wrappers in autocast_mode.h it runs above autograd
  with the key excluded, so casts are recorded by autograd and inputs are saved for backward in
  the dtype the op ran in; backward then runs outside autocast in the dtypes forward chose.
- ``cached_cast`` keeps the lower-precision copies of fp32 leaf tensors that require grad (the
  weights) until ``torch.clear_autocast_cache()``, which autocast's ``__exit__`` calls when the
  nesting level returns to 0 (autocast_mode.cpp ``cached_cast`` / ``clear_cache``). Under
  ``torch.inference_mode()`` newer releases cache nothing (pytorch/pytorch#158232 added
  ``!InferenceMode::is_enabled()`` to ``can_try_cache``); whether this torch does is asked of
  its own ``cached_cast`` (``cache_skips_inference_mode``).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, TypeGuard, cast

import torch
import torch.amp.autocast_mode as _autocast_mode
import torch.utils.checkpoint as _checkpoint
from torch.utils._pytree import tree_leaves, tree_map_only

from oomkit.prediction.tracing.autocast_policy import (
    BINARY_CROSS_ENTROPY_BANNED_MESSAGE,
    FP32_APPEND_DTYPE_REDISPATCH,
    CastPolicy,
    cuda_autocast_policy,
)
from oomkit.prediction.tracing.fake_storages import stands_for_cuda

__all__ = [
    "CudaAutocastEmulation",
    "cache_skips_inference_mode",
    "cuda_autocast_construction",
    "emulated_autocast_dtype",
]

_KEY = torch._C.DispatchKey.AutocastCUDA
_KEYSET = torch._C.DispatchKeySet(_KEY)
# autocast_mode.h is_autocast_eligible(CUDA): tensor.is_cuda() || tensor.is_xla(). Meta
# tensors stand for CUDA tensors while tracing.
_ELIGIBLE_DEVICES = frozenset({"cuda", "xla", "meta"})
# Ops whose CUDA composite takes a half_to_float fast path (aten/src/ATen/native/SoftMax.cpp).
_HALF_TO_FLOAT: dict[str, Any] = {
    "softmax.int": torch.ops.aten._softmax.default,
    "log_softmax.int": torch.ops.aten._log_softmax.default,
}


@functools.cache
def cache_skips_inference_mode() -> bool:
    """Whether this torch's autocast weight-cast cache is off under ``torch.inference_mode()``.

    autocast_mode.cpp ``cached_cast`` is one C++ function for every device type, and
    pytorch/pytorch#158232 added ``!c10::InferenceMode::is_enabled()`` to its ``can_try_cache``
    in some release; rather than guess which, the installed torch is asked: a CPU-autocast
    matmul with the same fp32 weight twice under ``inference_mode`` casts the weight twice when
    the cache is off, once when it is on (a tiny CPU probe: two 1x1 products).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class _CountCasts(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype):
                _CountCasts.casts += 1
            return func(*args, **(kwargs or {}))

    weight = torch.ones(1, 1, requires_grad=True)
    value = torch.ones(1, 1)
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16), _CountCasts():
        torch.mm(value, weight)
        torch.mm(value, weight)
    # Cached: the weight once and the input twice (3); not cached: 4.
    return _CountCasts.casts >= 4


def _autocast_dtype() -> torch.dtype:
    # torch >= 2.4 has the device-generic getter; older releases the GPU one.
    getter = getattr(torch, "get_autocast_dtype", None)
    if getter is not None:
        return getter("cuda")
    return torch.get_autocast_gpu_dtype()  # pragma: no cover - torch < 2.4


def _autocast_enabled() -> bool:
    # Enabled means the AutocastCUDA key is not excluded (autocast_mode.cpp is_autocast_enabled).
    return not torch._C._dispatch_tls_is_dispatch_key_excluded(_KEY)


def emulated_autocast_dtype() -> torch.dtype | None:
    """The dtype CUDA autocast casts to at this point of a trace, or None when it is off.

    For emulations that see ops before autocast does (a ``TorchFunctionMode`` sees
    ``scaled_dot_product_attention`` with fp32 inputs that autocast will cast).
    """
    if not _autocast_enabled() or not torch._C._dispatch_tls_is_dispatch_key_included(_KEY):
        return None
    return _autocast_dtype()


def _on_cuda(tensor: torch.Tensor) -> bool:
    """On a device CUDA autocast casts for: meta stands for CUDA, and so does a fake tensor
    (DDP on a fake process group) that is not host memory (``fake_storages.stands_for_cuda``)."""
    return tensor.device.type in _ELIGIBLE_DEVICES or stands_for_cuda(tensor)


def _is_eligible(value: Any) -> TypeGuard[torch.Tensor]:
    # autocast_mode.h is_eligible: defined, autocast-eligible and not double.
    return (
        isinstance(value, torch.Tensor)
        and _on_cuda(value)
        and value.is_floating_point()
        and value.dtype != torch.float64
    )


def _resolve(name: str) -> Any | None:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


def _bind(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Arguments by schema name, with defaults filled in for the ones not passed."""
    bound: dict[str, Any] = {}
    for index, arg in enumerate(op._schema.arguments):
        if index < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[index]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


class CudaAutocastEmulation:
    """Applies CUDA autocast's casts to meta tensors while it is active (a context manager).

    Args:
        on_cached_cast: called with each new weight-cast copy that enters the cache, so the
            recorder can tag its allocation ``autocast_cache``.
    """

    def __init__(self, on_cached_cast: Callable[[torch.Tensor], None] | None = None) -> None:
        self._on_cached_cast = on_cached_cast
        # autocast_mode.cpp get_cached_casts: keyed by the source TensorImpl, holding a weak
        # reference to the source and a strong one to the cast.
        self._cache: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]] = {}
        self._stack: contextlib.ExitStack | None = None
        # CUDA autocast regions entered disabled because the object was built without CUDA.
        self.disabled_entries = 0

    def warnings(self) -> list[str]:
        """What the recording should say about the regions entered (a region entered
        disabled was recorded in fp32)."""
        if not self.disabled_entries:
            return []
        return [
            f"torch.autocast('cuda') was entered {self.disabled_entries} time(s) "
            "disabled, so those regions were recorded in fp32: it was built where CUDA is "
            "unavailable (e.g. at module level before the trace), and torch disabled it then. "
            "Build it in the builder or the step, or under "
            "oomkit.prediction.tracing.cuda_autocast_construction(); ignore this only if you "
            "passed enabled=False on purpose"
        ]

    @property
    def cached_bytes(self) -> int:
        """Bytes of the weight casts the cache holds now."""
        return sum(cast.untyped_storage().nbytes() for _, cast in self._cache.values())

    def __enter__(self) -> CudaAutocastEmulation:
        if self._stack is not None:
            raise RuntimeError("CudaAutocastEmulation is not reentrant; create a new one")
        # Asked once, before any kernel or mode of ours is in place, so the probe sees plain torch.
        cache_skips_inference_mode()
        stack = contextlib.ExitStack()
        try:
            self._register_kernels(stack)
            stack.enter_context(torch._C._IncludeDispatchKeyGuard(_KEY))
            self._patch_autocast(stack)
        except BaseException:
            stack.close()
            raise
        stack.callback(self._cache.clear)
        self._stack = stack
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._stack is not None, "__exit__ without __enter__"
        stack, self._stack = self._stack, None
        stack.close()

    # ------------------------------------------------------------------ installation

    def _register_kernels(self, stack: contextlib.ExitStack) -> None:
        library = torch.library.Library("aten", "IMPL")
        stack.callback(library._destroy)
        with warnings.catch_warnings():
            # The dispatcher warns once that a kernel overrides the C++ autocast one; destroying
            # the library restores it.
            warnings.simplefilter("ignore")
            # The installed torch's lists: the GPU run uses the same torch version.
            for name, policy in cuda_autocast_policy(torch.__version__).items():
                op = _resolve(name)
                if op is not None:
                    library.impl(name, self._kernel(name, op, policy), "AutocastCUDA")

    def _patch_autocast(self, stack: contextlib.ExitStack) -> None:
        autocast_cls = _autocast_mode.autocast
        original_clear = torch.clear_autocast_cache
        stack.enter_context(cuda_autocast_construction())
        original_enter = autocast_cls.__enter__

        def enter(ac: Any) -> Any:
            # An autocast("cuda") built where CUDA was unavailable and outside the construction
            # emulation (at module level before the trace, say) was disabled by torch when it was
            # built; entering it records fp32. Count it, so that this is never silent.
            if ac.device == "cuda" and not ac._enabled and not getattr(ac, _BUILT_AS_CUDA, False):
                self.disabled_entries += 1
            return original_enter(ac)

        autocast_cls.__enter__ = enter  # type: ignore[method-assign]
        stack.callback(setattr, autocast_cls, "__enter__", original_enter)

        def clear_autocast_cache() -> None:
            original_clear()
            self._cache.clear()

        # torch.utils.checkpoint records the autocast state of the inputs' device type and
        # re-enters it for the recomputation in backward (checkpoint.py _get_autocast_kwargs,
        # recompute_fn / CheckpointFunction.backward). Meta tensors stand for CUDA ones here, so
        # checkpoint must see "cuda": on "meta" (no autocast) the recomputation ran in fp32 and
        # failed checkpoint's check that it saves what forward saved. No RNG state is touched:
        # get_device_states skips meta (and cpu) tensors.
        original_infer = _checkpoint._infer_device_type

        def infer_device_type(*args: Any) -> str:
            device_type = original_infer(*args)
            if device_type == "cpu":  # fake tensors (DDP on a fake group) report cpu
                tensors = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
                if any(stands_for_cuda(t) for t in tensors):
                    return "cuda"
            return "cuda" if device_type == "meta" else device_type

        _checkpoint._infer_device_type = infer_device_type
        stack.callback(setattr, _checkpoint, "_infer_device_type", original_infer)
        # autocast.__exit__ calls torch.clear_autocast_cache() when the nesting returns to 0.
        torch.clear_autocast_cache = clear_autocast_cache
        stack.callback(setattr, torch, "clear_autocast_cache", original_clear)
        # Code that asks the autocast state of its tensors' device (trl's chunked log-probs:
        # torch.is_autocast_enabled(hidden.device.type)) asks it of "meta", which stands for
        # "cuda" and has no autocast state (autocast_mode.cpp
        # get_autocast_dispatch_key_from_device_type raises "unknown device type").
        for name in ("is_autocast_enabled", "get_autocast_dtype"):
            original = getattr(torch, name, None)
            if original is not None:
                setattr(torch, name, _meta_as_cuda(original))
                stack.callback(setattr, torch, name, original)

    # ------------------------------------------------------------------ casting

    def cached_cast(self, to_dtype: torch.dtype, value: Any) -> Any:
        """autocast_mode.cpp ``cached_cast``: cast an eligible tensor, caching weight casts."""
        if not _is_eligible(value) or value.dtype == to_dtype:
            return value
        can_cache = (
            to_dtype == _autocast_dtype()
            and value.dtype == torch.float32
            and value.requires_grad
            and value.is_leaf
            and not value._is_view()
            and torch.is_autocast_cache_enabled()
            and not (torch.is_inference_mode_enabled() and cache_skips_inference_mode())
        )
        if not can_cache:
            return torch.ops.aten.to.dtype(value, to_dtype)
        key = value._cdata
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is value:
            return hit[1]
        cast = torch.ops.aten.to.dtype(value, to_dtype)
        self._cache[key] = (weakref.ref(value), cast)
        if self._on_cached_cast is not None:
            self._on_cached_cast(cast)
        return cast

    def _cast_all(
        self, to_dtype: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Cast every argument, the last first: autocast_mode.h ``WrapFunction_::call`` casts in
        a pack expansion inside a call's arguments, whose order C++ leaves to the compiler, and
        GCC (the Linux wheels) evaluates them right to left. Measured on an H200 (torch 2.11,
        validation/fidelity-nvidia-h200-torch2.11.0.json): a bf16 ``linear`` cast its bias, then
        its weight, then its input. A list argument's tensors are cast in order (the
        ``TensorList`` overload of ``cached_cast`` loops)."""

        def cast(value: Any) -> Any:
            return tree_map_only(torch.Tensor, lambda t: self.cached_cast(to_dtype, t), value)

        cast_kwargs = {name: cast(value) for name, value in reversed(kwargs.items())}
        cast_args = [cast(value) for value in reversed(args)]
        return tuple(reversed(cast_args)), {name: cast_kwargs[name] for name in kwargs}

    def _call_cast(
        self, op: Any, to_dtype: torch.dtype, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``op`` on the cast arguments. The casts are temporaries of ``WrapFunction_::call``'s
        full expression, destroyed in the reverse of their construction: the first argument's
        first (on the H200, an uncached cast input, then weight, then bias)."""
        cast_args, cast_kwargs = self._cast_all(to_dtype, args, kwargs)
        result = op(*cast_args, **cast_kwargs)
        release = tree_leaves((cast_args, cast_kwargs))
        del cast_args, cast_kwargs
        for index in range(len(release)):  # first to last, each dropped as it is reached
            release[index] = None
        return result

    def _kernel(self, name: str, op: Any, policy: CastPolicy) -> Callable[..., Any]:
        def kernel(*args: Any, **kwargs: Any) -> Any:
            # The WrapFunction_ wrappers exclude the autocast key for everything below them.
            with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
                return self._apply(name, op, policy, args, kwargs)

        return kernel

    def _apply(
        self,
        name: str,
        op: Any,
        policy: CastPolicy,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if policy == "lower_precision_fp":
            return self._call_cast(op, _autocast_dtype(), args, kwargs)
        if policy == "fp32":
            return self._call_cast(op, torch.float32, args, kwargs)
        if policy == "fp32_set_opt_dtype":
            bound = _bind(op, args, kwargs)
            # firstarg_is_eligible / set_opt_dtype: an explicit dtype is respected.
            first = bound.get("self")
            if _is_eligible(first) and bound.get("dtype") is None:
                bound["dtype"] = torch.float32
            half_to_float = _HALF_TO_FLOAT.get(name)
            if (
                half_to_float is not None
                and _is_eligible(first)
                and first.dtype == torch.float16
                and bound.get("dtype") == torch.float32
            ):
                # SoftMax.cpp softmax / log_softmax: a CUDA fp16 input with dtype=float runs
                # _softmax(input, dim, half_to_float=true), with no fp32 copy of the input; the
                # meta path would convert first (bf16 converts on CUDA too).
                return half_to_float(first, bound["dim"], True)
            return op(**bound)
        if policy == "fp32_append_dtype":
            bound = _bind(op, args, kwargs)
            first = bound["self"]
            # type_from_firstarg: float32 when the first argument is eligible, else its dtype.
            bound["dtype"] = torch.float32 if _is_eligible(first) else first.dtype
            redispatch = _resolve(FP32_APPEND_DTYPE_REDISPATCH[name])
            # The *_dtype overloads ship with every torch that has the wrapped op.
            assert redispatch is not None, FP32_APPEND_DTYPE_REDISPATCH[name]
            return redispatch(**bound)
        if policy == "promote":
            return self._call_cast(op, _promote_type(tree_leaves((args, kwargs))), args, kwargs)
        # Banned: autocast_mode.cpp binary_cross_entropy_banned raises (a RuntimeError in
        # Python, which user code may catch, so the same type is raised here).
        raise RuntimeError(BINARY_CROSS_ENTROPY_BANNED_MESSAGE)


def _promote_type(leaves: list[Any]) -> torch.dtype:
    """autocast_mode.h promote_type / prioritize over the tensor arguments, in order."""
    lower = _autocast_dtype()
    current = lower
    for leaf in leaves:
        if not (
            isinstance(leaf, torch.Tensor)
            and _on_cuda(leaf)
            and leaf.is_floating_point()
        ):
            continue
        if leaf.dtype == torch.float64:
            continue  # prioritize ignores double tensors
        if current == torch.float32 or leaf.dtype == torch.float32:
            current = torch.float32
        elif not (current == lower and leaf.dtype == lower):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


# Set on autocast objects built under cuda_autocast_construction (as a CUDA build builds them).
_BUILT_AS_CUDA = "_oomkit_built_as_cuda"


def _meta_as_cuda(query: Callable[..., Any]) -> Callable[..., Any]:
    """``query(device_type, ...)`` asked of ``"cuda"`` where it names ``"meta"``."""

    @functools.wraps(query)
    def asked(*args: Any, **kwargs: Any) -> Any:
        if args and args[0] == "meta":
            args = ("cuda", *args[1:])
        if kwargs.get("device_type") == "meta":
            kwargs["device_type"] = "cuda"
        return query(*args, **kwargs)

    return asked


@contextlib.contextmanager
def cuda_autocast_construction() -> Iterator[None]:
    """While open, ``torch.autocast("cuda")`` (and ``torch.cuda.amp.autocast``) builds as on CUDA.

    Without a GPU torch builds a CUDA autocast disabled ("CUDA is not available ... Disabling
    autocast"), so one made once and reused (nanoGPT's ``ctx = torch.amp.autocast(...)``) would
    record an fp32 step. The recorder opens this while it traces; ``oomkit predict
    file.py:function`` also imports the file and calls the builder under it. From the Python
    API, build such objects under it (or inside the step). Nested use is a no-op.
    """
    autocast_cls = _autocast_mode.autocast
    original_init = autocast_cls.__init__
    if getattr(original_init, _BUILT_AS_CUDA, False):
        yield
        return

    def init(
        ac: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        # Meta tensors stand for CUDA ones: model code that takes the autocast device from a
        # tensor (transformers 4.x rotary embeddings: ``torch.autocast(x.device.type,
        # enabled=False)`` to force fp32) names "cuda" on the GPU; "meta" has no autocast
        # state at all (torch.get_autocast_dtype("meta") raises).
        if device_type == "meta":
            device_type = "cuda"
        if device_type == "cuda" and torch.cuda.amp.common.amp_definitely_not_available():
            with _cuda_amp_reported_available():
                original_init(ac, device_type, dtype, enabled, cache_enabled)
        else:
            original_init(ac, device_type, dtype, enabled, cache_enabled)
        if device_type == "cuda":
            setattr(ac, _BUILT_AS_CUDA, True)

    setattr(init, _BUILT_AS_CUDA, True)
    # A plain function standing in for the method: mypy cannot match it to the bound
    # signature (``self`` is positional here), hence the cast.
    autocast_cls.__init__ = cast(Any, init)  # type: ignore[method-assign]
    try:
        yield
    finally:
        autocast_cls.__init__ = original_init  # type: ignore[method-assign]


@contextlib.contextmanager
def _cuda_amp_reported_available() -> Any:
    """While autocast constructs: CUDA AMP available and bf16 supported, as on any CUDA GPU."""
    common = torch.cuda.amp.common
    original_available = common.amp_definitely_not_available
    original_bf16 = torch.cuda.is_bf16_supported
    # torch/cuda/__init__.py is_bf16_supported(including_emulation=True): True on sm >= 8.0 and,
    # by emulation, on every older CUDA GPU that can hold a bf16 tensor.
    common.amp_definitely_not_available = lambda: False
    torch.cuda.is_bf16_supported = lambda including_emulation=True: True
    try:
        yield
    finally:
        common.amp_definitely_not_available = original_available
        torch.cuda.is_bf16_supported = original_bf16
