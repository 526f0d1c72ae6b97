"""Float8 linear training on any torchtitan llama3 config: ``--override.imports`` targets.

torchtitan 0.3.0 sets Float8 on the model spec, not on a config field: a registry function
passes ``converters=[Float8LinearConverter.Config(...)]`` to ``model_registry`` (torchtitan/
models/llama3/config_registry.py ``llama3_debugmodel_float8``, the only Float8 llama3 config),
and no command-line override reaches ``model_spec`` (0.1/0.2's ``--model.converters float8``
is gone). What the launcher does take is ``--override.imports MODULE.FUNCTION``
(torchtitan/config/override.py): an ``@override`` factory swaps each matching
``Configurable.Config`` of the job for another, after ``update_from_config`` and before the
model is built (torchtitan/trainer.py:357-358 ``apply_overrides``). This module registers two
such factories, which do per linear what torchtitan's ``Float8LinearConverter.convert`` does
per model (its torchao recipe, its dims-divisible-by-16 filter, a ``Float8Linear.Config``):

* ``float8_linears``: every linear, the LM head included (as ``Float8LinearConverter`` with
  no ``filter_fqns``, i.e. ``llama3_debugmodel_float8``);
* ``float8_block_linears``: the linears of the blocks (``layers.*``), the LM head kept in
  bf16, as torchtitan ran Float8 in 2024 (torchtitan/float8.py at 9dec370
  ``convert_to_float8_training(..., module_filter_fn=lambda mod, fqn: fqn != "output")``).

Each takes torchao's ``recipe_name`` (``"rowwise"``, torchtitan 0.3.0's default;
``"tensorwise"``, torchao's and 2024's default), e.g. ``--override.imports
'oomkit.prediction._torchtitan_float8.float8_block_linears={"recipe_name": "tensorwise"}'``.
The same override runs on a GPU with torchtitan 0.3.0 and oomkit installed. The replacement is
made with torchtitan's ``derive``, so the sharding set by ``update_from_config`` is kept (the
converter, which runs before it, builds a fresh config).

A third, ``float8_recipe``, changes the recipe of a config that converts to Float8 itself
(``llama3_405b``: 0.3.0's converter, rowwise), e.g. to 2024's tensorwise:
``--override.imports 'oomkit.prediction._torchtitan_float8.float8_recipe={"recipe_name":
"tensorwise"}'``.

Float8 all-gather with FSDP2, which torchtitan 0.3.0 dropped with its ``float8`` config section:
both factories take ``enable_fsdp_float8_all_gather`` (the field of torchtitan's older Float8
converter, torchtitan/components/quantization/float8.py in 0.1.0-0.2.2, and torchtitan/float8.py
at 9dec370). 0.3.0's ``Float8Linear`` is built with ``__init__``, and torchao wraps the weight
in ``WeightWithDynamicFloat8CastTensor`` only in ``Float8Linear.from_float``
(torchao/float8/float8_linear.py); :class:`Float8AllGatherLinear` wraps it the same way when
built, on ``meta`` before ``parallelize_fn``, where the older converter's
``convert_to_float8_training`` wrapped it. FSDP2 then all-gathers each linear's weight as
float8 bytes (the wrapper's ``fsdp_pre_all_gather``: the shard cast with a scale from the
amax all-reduced over the FSDP mesh) instead of bf16. torchao allows it for the tensorwise
recipe only (torchao/float8/config.py ``Float8LinearConfig.__post_init__``), so a rowwise
recipe with it is refused. torchtitan's older converter turned it on only where FSDP shards
(``dp_shard`` > 1); ask for it with FSDP. 2024's 8B Float8 rows with it (torchtitan's table
does not say whether they had it; its docs of the time launched Float8 with it)::

    --override.imports 'oomkit.prediction._torchtitan_float8.float8_block_linears={"recipe_name":
    "tensorwise", "enable_fsdp_float8_all_gather": true}'

The older field ``precompute_float8_dynamic_scale_for_fsdp`` (with the all-gather only:
torchtitan's older converter kept it only then, ``precompute_scale =
enable_fsdp_float8_all_gather and ...`` in float8.py; here it is refused without it) runs
torchao's ``precompute_float8_dynamic_scale_for_fsdp`` on each model part after every optimizer
step, from a step post-hook on torchtitan's optimizers container, where torchtitan 0.2.2 ran it
(torchtitan/train.py:284-288 ``optimizers.register_step_post_hook(... post_optimizer_hook(
model_parts))``). torchao's function (torchao 0.18.0 fsdp_utils.py:27-85) takes every float8
weight's local amax in one ``_foreach_norm``, stacks them, all-reduces once (the DTensor
``clamp``) and keeps one float32 tensor of the part's scales, each weight's
``_precomputed_scale`` a 0-d view of it; the next all-gathers cast with that scale, without
the per-weight ``abs``/``max``, all-reduce and scale arithmetic (``fsdp_pre_all_gather``,
:228-251). It runs on the fake tensors as it is: nothing in it needs a value. What would is
the wrapper's ``__tensor_flatten__`` (:210-214: ``if self._precomputed_scale``, a read of the
0-d scale's value), which the step itself never calls (FSDP2 calls ``fsdp_pre_all_gather`` on
the wrapper; a compiled block sees the gathered ``Float8TrainingTensor``); the recorder, which
finds a wrapper's storage through it, takes this wrapper's weight without it
(``tracing/fake_storages.py``). On 2024's 8B FSDP 8 compiled Float8 row
(benchmarks/torchtitan_rows.py ``--float8-all-gather --float8-precompute``) the peak allocated
drops by 80,896 bytes (the 160 float8 weights' own 512-byte scale blocks for one 1,024-byte
block of 160 scales); the peak reserved is the same, 75.74 GiB (-1.4%), and FSDP 128's 60.85 GiB
(-1.5%)::

    --override.imports 'oomkit.prediction._torchtitan_float8.float8_block_linears={"recipe_name":
    "tensorwise", "enable_fsdp_float8_all_gather": true,
    "precompute_float8_dynamic_scale_for_fsdp": true}'
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from oomkit.errors import ConfigError
from oomkit.prediction._torchtitan_env import import_torchtitan

__all__ = [
    "BLOCK_LINEARS",
    "Float8AllGatherLinear",
    "float8_block_linears",
    "float8_linears",
    "float8_recipe",
]

_override = import_torchtitan("torchtitan.config.override")
_quantization = import_torchtitan("torchtitan.components.quantization.float8")
_fsdp_utils = import_torchtitan("torchao.float8.fsdp_utils")
_Linear = import_torchtitan("torchtitan.models.common.linear").Linear

# The FQN glob of the blocks' linears. apply_overrides traverses from the Trainer.Config, so
# the FQNs it matches are "model_spec.model.layers.0.attention.qkv_linear.wqkv" (not the bare
# module FQN its docstring shows); fnmatch's "*" also crosses dots, so either form matches.
BLOCK_LINEARS = "*layers.*"

_PRECOMPUTE = "precompute_float8_dynamic_scale_for_fsdp"


class Float8AllGatherLinear(_quantization.Float8Linear):  # type: ignore[name-defined]
    """torchtitan's ``Float8Linear`` whose weight FSDP2 all-gathers in float8.

    Built as torchtitan 0.3.0 builds its own (``__init__`` on ``meta``), then the weight is
    wrapped as torchao's ``Float8Linear.from_float`` wraps it when the torchao config asks
    for float8 all-gather (torchao/float8/float8_linear.py): a ``WeightWithDynamicFloat8CastTensor``
    parameter carrying the linear's matmul config and the weight's float8 dtype. With
    ``precompute_float8_dynamic_scale_for_fsdp`` (a field of torchtitan's Float8 converter
    config until torchtitan 6348d93 "quantize on config instead of on model", before 0.3.0),
    the optimizers that step it run torchao's scale precompute after each step (this module's
    docstring).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_quantization.Float8Linear.Config):  # type: ignore[name-defined]
        """``Float8Linear.Config`` that builds :class:`Float8AllGatherLinear`."""

        precompute_float8_dynamic_scale_for_fsdp: bool = False

    def __init__(self, config: Any) -> None:
        import torch

        super().__init__(config)
        self.precompute_float8_dynamic_scale_for_fsdp = bool(
            config.precompute_float8_dynamic_scale_for_fsdp
        )
        if self.config.enable_fsdp_float8_all_gather:
            # float8_linear.py Float8Linear.from_float: the wrapper goes on last, on the
            # weight as built (meta here, as convert_to_float8_training ran before FSDP2)
            weight: Any = self._parameters["weight"]
            self.weight = torch.nn.Parameter(
                _fsdp_utils.WeightWithDynamicFloat8CastTensor(
                    weight, self.linear_mm_config, self.config.cast_config_weight.target_dtype
                ),
                requires_grad=weight.requires_grad,
            )
        if self.precompute_float8_dynamic_scale_for_fsdp:
            _arm_precompute()


# --------------------------------------------------------------- the scale precompute

# The process's one optimizer step pre-hook that finds torchtitan's optimizers container of
# a job with precompute linears (its first step), and the containers it gave the post-hook.
_ARMED: list[Any] = []
_HOOKED: weakref.WeakSet[Any] = weakref.WeakSet()


def _arm_precompute() -> None:
    """Register (once per process) the pre-hook that gives the job's optimizers the post-hook.

    torchtitan 0.3.0's trainer registers no converter hook (trainer.py:549-553 builds the
    optimizers and calls only the model spec's ``post_optimizer_build_fn``), and an override
    reaches only the linears' configs; so the container is found at its first step and given
    the post-hook torchtitan 0.2.2's trainer registered at build. Post-hooks run after the
    step they were registered in (torch/optim/optimizer.py ``profile_hook_step``), so the
    first step runs it too, as on torchtitan 0.2.2.
    """
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    if not _ARMED:
        _ARMED.append(register_optimizer_step_pre_hook(_find_container))


def _find_container(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Give torchtitan's optimizers container of precompute linears the post-step hook."""
    containers = import_torchtitan("torchtitan.components.optimizer")
    if not isinstance(optimizer, containers.OptimizersContainer) or optimizer in _HOOKED:
        return
    if not any(
        getattr(module, _PRECOMPUTE, False)
        for part in optimizer.model_parts
        for module in part.modules()
    ):
        return
    _HOOKED.add(optimizer)
    # torchtitan 0.2.2 train.py:284-288: optimizers.register_step_post_hook(lambda *args,
    # **kwargs: model_converters.post_optimizer_hook(self.model_parts))
    optimizer.register_step_post_hook(_precompute_after_step)


def _precompute_after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torchtitan 0.2.2 ``Float8LinearConverter.post_optimizer_hook``: torchao's precompute
    of each model part's float8 weight scales (components/quantization/float8.py)."""
    for part in optimizer.model_parts:
        _fsdp_utils.precompute_float8_dynamic_scale_for_fsdp(part)


# --------------------------------------------------------------- the override factories


def _torchao_config(recipe_name: str, enable_fsdp_float8_all_gather: bool) -> Any:
    """The recipe's torchao config, with float8 all-gather where asked (tensorwise only)."""
    converter_config = _quantization.Float8LinearConverter.Config(recipe_name=recipe_name)
    # float8.py Float8LinearConverter.__init__: the GPU's capability check (the target's, under
    # oomkit's cuda_capability), torchao's recipe, the filter; convert() swaps what passes it.
    converter = converter_config.build()
    if not converter.enabled or not enable_fsdp_float8_all_gather:
        return converter
    torchao_config = converter.torchao_config
    granularity = torchao_config.cast_config_weight.scaling_granularity.value
    if granularity != "tensorwise":
        # torchao/float8/config.py Float8LinearConfig.__post_init__ asserts it
        raise ConfigError(
            f"enable_fsdp_float8_all_gather needs torchao's tensorwise recipe; the "
            f"{recipe_name!r} recipe scales the weight {granularity} (torchao/float8/config.py "
            "allows float8 all-gather only for tensorwise scaling). Pass "
            '{"recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": true}'
        )
    converter.torchao_config = dataclasses.replace(
        torchao_config, enable_fsdp_float8_all_gather=True
    )
    return converter


def _check_precompute(
    enable_fsdp_float8_all_gather: bool, precompute_float8_dynamic_scale_for_fsdp: bool
) -> None:
    """Refuse the scales' precompute without float8 all-gather."""
    if precompute_float8_dynamic_scale_for_fsdp and not enable_fsdp_float8_all_gather:
        # torchtitan 0.2.2 components/quantization/float8.py Float8LinearConverter.__init__:
        # precompute_scale = enable_fsdp_float8_all_gather and precompute_...; torchao's
        # precompute finds only all-gather weights (fsdp_utils.py, the wrapper's isinstance)
        raise ConfigError(
            "precompute_float8_dynamic_scale_for_fsdp precomputes the scales of float8 "
            "all-gather (torchao/float8/fsdp_utils.py), and torchtitan ran it only with "
            'enable_fsdp_float8_all_gather. Pass {"recipe_name": "tensorwise", '
            '"enable_fsdp_float8_all_gather": true, '
            '"precompute_float8_dynamic_scale_for_fsdp": true}, or drop it'
        )


def _derived(
    config: Any,
    converter: Any,
    enable_fsdp_float8_all_gather: bool,
    precompute_float8_dynamic_scale_for_fsdp: bool,
) -> Any:
    """``config`` as torchtitan's Float8 linear config of ``converter``'s recipe, or as
    ``Float8AllGatherLinear``'s with float8 all-gather."""
    if not enable_fsdp_float8_all_gather:
        return _override.derive(
            config, _quantization.Float8Linear.Config, _torchao_config=converter.torchao_config
        )
    return _override.derive(
        config,
        Float8AllGatherLinear.Config,
        _torchao_config=converter.torchao_config,
        precompute_float8_dynamic_scale_for_fsdp=precompute_float8_dynamic_scale_for_fsdp,
    )


def _float8(
    config: Any,
    recipe_name: str,
    enable_fsdp_float8_all_gather: bool,
    precompute_float8_dynamic_scale_for_fsdp: bool,
) -> Any:
    """``config`` as a Float8 linear config where torchtitan's converter would convert it."""
    _check_precompute(enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp)
    converter = _torchao_config(recipe_name, enable_fsdp_float8_all_gather)
    if not converter.enabled or not converter.filter_fn(config, ""):
        return config
    return _derived(
        config, converter, enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp
    )


@_override.override(
    target=_Linear.Config,
    exact=True,  # a Float8Linear.Config (a Linear.Config subclass) is not converted again
    description="torchao Float8 linear training on every linear (oomkit)",
)
def float8_linears(
    config: Any,
    recipe_name: str = "rowwise",
    enable_fsdp_float8_all_gather: bool = False,
    precompute_float8_dynamic_scale_for_fsdp: bool = False,
) -> Any:
    """Every linear of the job trains in Float8 (torchtitan's converter, no ``filter_fqns``)."""
    return _float8(
        config, recipe_name, enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp
    )


@_override.override(
    target=_Linear.Config,
    fqns=[BLOCK_LINEARS],
    exact=True,
    description="torchao Float8 linear training on the blocks' linears, LM head in bf16 (oomkit)",
)
def float8_block_linears(
    config: Any,
    recipe_name: str = "rowwise",
    enable_fsdp_float8_all_gather: bool = False,
    precompute_float8_dynamic_scale_for_fsdp: bool = False,
) -> Any:
    """The blocks' linears train in Float8; the LM head does not (torchtitan in 2024)."""
    return _float8(
        config, recipe_name, enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp
    )


@_override.override(
    target=_quantization.Float8Linear.Config,
    exact=True,  # torchtitan's own Float8 linears; Float8AllGatherLinear's are left as they are
    description="torchao recipe of the job's Float8 linears (oomkit)",
)
def float8_recipe(
    config: Any,
    recipe_name: str = "tensorwise",
    enable_fsdp_float8_all_gather: bool = False,
    precompute_float8_dynamic_scale_for_fsdp: bool = False,
) -> Any:
    """A config whose registry function already converts to Float8 (``llama3_405b``,
    ``llama3_debugmodel_float8``: 0.3.0's ``Float8LinearConverter``, rowwise unless told, run by
    ``model_registry`` when the config is built, before any override) with another torchao
    recipe, e.g. 2024's tensorwise (torchtitan/float8.py at 9dec370: torchao's default config).
    ``float8_linears`` and ``float8_block_linears`` convert plain linears only (``exact``), so
    they cannot change such a job's recipe. Float8 all-gather and the scales' precompute as in
    ``float8_linears`` (2024's 405B job set both: train_configs/llama3_405b.toml [float8])."""
    _check_precompute(enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp)
    converter = _torchao_config(recipe_name, enable_fsdp_float8_all_gather)
    if not converter.enabled:  # the converter's own refusal already ran for the job's config
        return config
    return _derived(
        config, converter, enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp
    )
