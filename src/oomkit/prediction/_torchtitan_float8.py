"""Float8 linear training on any torchtitan llama3 config: two ``--override.imports`` targets.

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
converter, which runs before it, builds a fresh config). Float8 all-gather is not available
this way: 0.3.0's ``Float8Linear`` is built with ``__init__``, and torchao wraps the weight for
FSDP2's float8 all-gather only in ``Float8Linear.from_float``
(torchao/float8/float8_linear.py).
"""

from __future__ import annotations

from typing import Any

from oomkit.prediction._torchtitan_env import import_torchtitan

__all__ = ["BLOCK_LINEARS", "float8_block_linears", "float8_linears"]

_override = import_torchtitan("torchtitan.config.override")
_quantization = import_torchtitan("torchtitan.components.quantization.float8")
_Linear = import_torchtitan("torchtitan.models.common.linear").Linear

# The FQN glob of the blocks' linears. apply_overrides traverses from the Trainer.Config, so
# the FQNs it matches are "model_spec.model.layers.0.attention.qkv_linear.wqkv" (not the bare
# module FQN its docstring shows); fnmatch's "*" also crosses dots, so either form matches.
BLOCK_LINEARS = "*layers.*"


def _float8(config: Any, recipe_name: str) -> Any:
    """``config`` as a ``Float8Linear.Config`` where torchtitan's converter would convert it."""
    converter_config = _quantization.Float8LinearConverter.Config(recipe_name=recipe_name)
    # float8.py Float8LinearConverter.__init__: the GPU's capability check (the target's, under
    # oomkit's cuda_capability), torchao's recipe, the filter; convert() swaps what passes it.
    converter = converter_config.build()
    if not converter.enabled or not converter.filter_fn(config, ""):
        return config
    return _override.derive(
        config, _quantization.Float8Linear.Config, _torchao_config=converter.torchao_config
    )


@_override.override(
    target=_Linear.Config,
    exact=True,  # a Float8Linear.Config (a Linear.Config subclass) is not converted again
    description="torchao Float8 linear training on every linear (oomkit)",
)
def float8_linears(config: Any, recipe_name: str = "rowwise") -> Any:
    """Every linear of the job trains in Float8 (torchtitan's converter, no ``filter_fqns``)."""
    return _float8(config, recipe_name)


@_override.override(
    target=_Linear.Config,
    fqns=[BLOCK_LINEARS],
    exact=True,
    description="torchao Float8 linear training on the blocks' linears, LM head in bf16 (oomkit)",
)
def float8_block_linears(config: Any, recipe_name: str = "rowwise") -> Any:
    """The blocks' linears train in Float8; the LM head does not (torchtitan in 2024)."""
    return _float8(config, recipe_name)
