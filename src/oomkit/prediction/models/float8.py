"""Float8 linear training with torchao, as torchtitan converts a model for it.

torchtitan's ``Float8LinearConverter`` (torchtitan/components/quantization/float8.py) swaps
every ``Linear`` whose in and out features are both multiples of 16 (components/quantization/
utils.py ``module_filter_fn``: "float8 tensorcore hardware requirements") and whose name matches
none of its ``filter_fqns`` for torchao's ``Float8Linear``, configured by
``Float8LinearConfig.from_recipe_name(recipe)``. Here the same swap is made on the built preset
by torchao's own ``convert_to_float8_training`` (torchao/float8/float8_linear_utils.py) with the
same filter, before tensor parallel, checkpointing, compile and FSDP2, as torchtitan converts
the model before ``parallelize``.

What runs is torchao's code: each ``Float8Linear`` forward casts its input and weight to
``float8_e4m3fn`` (tensorwise: one scale per tensor, from ``amax``; rowwise: one per row,
``round_scales_to_power_of_2``), each cast a chain of transient buffers (``abs``, ``max``, the
scaled fp32 copy, the fp8 result), and calls ``torch._scaled_mm``. For backward it saves the
high-precision input and weight and casts them again there
(torchao/float8/float8_linear.py ``matmul_with_hp_or_float8_args.forward``:
``ctx.save_for_backward(input_hp, weight_hp_t)``); only with float8 all-gather is the saved
weight already fp8 (the all-gathered parameter is). Under ``torch.compile`` the partitioner
chooses what to save instead (``--compile``, recorded through the compiled backend). ``_scaled_mm`` has a
meta kernel (torch/_meta_registrations.py ``meta_scaled_mm``: an ``(M, N)`` output of
``out_dtype``), which is what CUDA allocates (aten/src/ATen/native/cuda/Blas.cpp
``_scaled_mm_out_cuda``: ``out`` resized to ``{mat1.size(0), mat2.size(1)}``); its cuBLASLt
workspace is the stream's, as for any GEMM (emulations/cublas.py).

Float8 all-gather (``--float8-all-gather``, tensorwise only: torchao/float8/config.py
``Float8LinearConfig.__post_init__``): torchao wraps each weight in
``WeightWithDynamicFloat8CastTensor`` (torchao/float8/fsdp_utils.py), whose
``fsdp_pre_all_gather`` casts the local shard to fp8 on FSDP2's all-gather stream (its amax
all-reduced over the shard group, its 4-byte scale kept with the gathered weight), so FSDP2
all-gathers and holds one byte per element instead of two (bf16), and the forward casts only
the input.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from oomkit._logs import TORCHAO_IMPORT_LOGGERS, quiet_loggers
from oomkit.errors import ConfigError

__all__ = [
    "FLOAT8_RECIPES",
    "Float8Options",
    "Float8Recipe",
    "convert_to_float8",
    "float8_words",
]

Float8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
# torchao/float8/config.py Float8LinearRecipeName (torchtitan 0.3.0 offers the last two).
FLOAT8_RECIPES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# components/quantization/utils.py module_filter_fn: both dims multiples of 16.
_DIM_MULTIPLE = 16


@dataclasses.dataclass(frozen=True)
class Float8Options:
    """How the linear layers train in float8.

    Attributes:
        recipe: torchao's recipe; torchtitan 0.3.0's default is ``rowwise``.
        all_gather: FSDP2 all-gathers the weights in float8 (tensorwise only).
        skip: module names left in high precision (torchtitan's ``filter_fqns``; its
            Llama 3.1 405B job filters the LM head, ``filter_fqns=["lm_head"]`` in
            torchtitan/models/llama3/config_registry.py ``llama3_405b``).
    """

    recipe: Float8Recipe = "rowwise"
    all_gather: bool = False
    skip: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        if self.recipe not in FLOAT8_RECIPES:
            raise ConfigError(
                f"unknown float8 recipe {self.recipe!r}; use one of {', '.join(FLOAT8_RECIPES)}"
            )
        if self.all_gather and self.recipe != "tensorwise":
            # torchao/float8/config.py Float8LinearConfig.__post_init__ asserts it.
            raise ConfigError(
                "--float8-all-gather needs --float8-recipe tensorwise (torchao's float8 "
                f"all-gather casts with one scale per tensor); got {self.recipe}"
            )

    def torchao_config(self) -> object:
        """torchao's ``Float8LinearConfig`` for these options."""
        from torchao.float8 import Float8LinearConfig  # type: ignore[import-untyped]

        if self.recipe == "tensorwise":
            return Float8LinearConfig(enable_fsdp_float8_all_gather=self.all_gather)
        return Float8LinearConfig.from_recipe_name(self.recipe)




def _import_torchao() -> None:
    try:
        with quiet_loggers(*TORCHAO_IMPORT_LOGGERS):
            import torchao.float8  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "--float8 converts the model with torchao's convert_to_float8_training; torchao "
            f"is not importable here ({exc}). Install it: pip install torchao"
        ) from exc


def convert_to_float8(model: torch.nn.Module, options: Float8Options) -> list[str]:
    """Swap ``model``'s eligible ``nn.Linear`` layers for torchao's ``Float8Linear``, in place.

    Args:
        model: the built (unsharded) model.
        options: the recipe, float8 all-gather and the names left in high precision.

    Returns:
        The converted modules' names, in model order.

    Raises:
        ConfigError: torchao is missing, or no linear layer qualifies.
    """
    _import_torchao()
    from torchao.float8 import convert_to_float8_training

    converted: list[str] = []

    def module_filter_fn(module: torch.nn.Module, fqn: str) -> bool:
        if not isinstance(module, torch.nn.Linear):
            return True  # torchao recurses into containers; only Linears are swapped
        eligible = (
            module.in_features % _DIM_MULTIPLE == 0
            and module.out_features % _DIM_MULTIPLE == 0
            and not any(name in fqn for name in options.skip)
        )
        if eligible:
            converted.append(fqn)
        return eligible

    convert_to_float8_training(
        model, config=options.torchao_config(), module_filter_fn=module_filter_fn
    )
    if not converted:
        raise ConfigError(
            "--float8 found no linear layer whose in and out features are multiples of 16 "
            "(torchtitan's module_filter_fn); drop --float8"
        )
    return converted


def float8_words(options: Float8Options, layers: int) -> str:
    """The conversion in words, for the step's description."""
    gather = ", float8 all-gather" if options.all_gather else ""
    return f"Float8 {options.recipe} (torchao, {layers} linear layers{gather})"
