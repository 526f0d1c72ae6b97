"""``float8_recipe``: another torchao recipe for a config that converts to Float8 itself.

torchtitan 0.3.0's ``llama3_405b`` and ``llama3_debugmodel_float8`` convert their linears in
``model_registry`` (0.3.0's ``Float8LinearConverter``: rowwise unless told), before any
override runs; 2024's torchtitan ran torchao's tensorwise recipe. The debug model (6 blocks of
5 linears and the LM head, all converted by ``llama3_debugmodel_float8``) on an H100; the jobs
recorded are the debug model and its Float8 config cut to their first 2 blocks (``TWO_BLOCKS``,
``TWO_BLOCKS_FLOAT8``), shared with the other Float8 tests (``_torchtitan_recordings``).
"""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torchtitan")

from _torchtitan_recordings import recorded_job  # noqa: E402
from _torchtitan_small_job import FLOAT8_FACTORIES, SMALL_STEP, TWO_BLOCKS, TWO_BLOCKS_FLOAT8  # noqa: E402

from oomkit.prediction._torchtitan_env import (  # noqa: E402
    SUPPORTED_TORCHTITAN,
    cuda_capability,
    import_torchtitan,
    torchtitan_version,
)
from oomkit.prediction.torchtitan_job import (  # noqa: E402
    TorchtitanJob,
    load_job_config,
)

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)

_TENSORWISE = ("--override.imports", f'{FLOAT8_FACTORIES}.float8_recipe={{"recipe_name": "tensorwise"}}')


def _linears(config_name: str, overrides: tuple[str, ...]) -> tuple[dict, dict]:
    """The job's linear configs (FQN -> config) before and after torchtitan's apply_overrides
    (trainer.py:357-358), on an H100's capability."""
    linear = import_torchtitan("torchtitan.models.common.linear").Linear
    with cuda_capability((9, 0)):
        config = load_job_config(TorchtitanJob("llama3", config_name, SMALL_STEP + overrides))
        before = {fqn: cfg for fqn, cfg, _, _ in config.traverse(linear.Config)}
        import_torchtitan("torchtitan.config.override").apply_overrides(config.override, config)
    return before, {fqn: cfg for fqn, cfg, _, _ in config.traverse(linear.Config)}


def _recipe(name: str) -> str:
    return repr(import_torchtitan("torchao.float8").Float8LinearConfig.from_recipe_name(name))


def test_the_registry_float8_config_is_rowwise_and_the_override_makes_it_tensorwise():
    before, after = _linears("debugmodel_float8", _TENSORWISE)
    assert len(after) == 6 * 5 + 1
    assert {repr(cfg._torchao_config) for cfg in before.values()} == {_recipe("rowwise")}
    assert {repr(cfg._torchao_config) for cfg in after.values()} == {_recipe("tensorwise")}
    assert {type(cfg).__qualname__ for cfg in after.values()} == {"Float8Linear.Config"}
    for fqn, cfg in before.items():  # derive() keeps every other field
        for field in dataclasses.fields(cfg):
            if field.name != "_torchao_config":
                assert getattr(after[fqn], field.name) is getattr(cfg, field.name), (fqn, field.name)


def test_plain_linears_are_left_to_the_converting_factories():
    """``exact``: a job without Float8 keeps its bf16 linears."""
    before, after = _linears("debugmodel", _TENSORWISE)
    assert {type(cfg).__qualname__ for cfg in after.values()} == {"Linear.Config"}
    assert after.keys() == before.keys()


def test_the_recipe_override_records_the_same_bytes_as_a_tensorwise_conversion():
    """``llama3_debugmodel_float8`` made tensorwise records, to the byte, what ``debugmodel``
    converted tensorwise by ``float8_linears`` records (FSDP 2, H100), and not what the
    registry's rowwise records."""
    peaks = {}
    for label, name, extra in (
        ("recipe", TWO_BLOCKS_FLOAT8, _TENSORWISE),
        ("converted", TWO_BLOCKS, (
            "--override.imports", f'{FLOAT8_FACTORIES}.float8_linears={{"recipe_name": "tensorwise"}}')),
        ("rowwise", TWO_BLOCKS_FLOAT8, ()),
    ):
        _, _, prediction = recorded_job(TorchtitanJob(*name, SMALL_STEP + extra, world_size=2))
        peaks[label] = (prediction.peak_allocated_bytes, prediction.peak_reserved_bytes)
    assert peaks["recipe"] == peaks["converted"]
    assert peaks["recipe"] != peaks["rowwise"]


def test_the_recipe_override_takes_float8_all_gather_and_the_precompute_too():
    """2024's 405B job gathered float8 weights and precomputed their scales: through
    ``float8_recipe`` on ``llama3_debugmodel_float8`` that records, to the byte, what
    ``float8_linears`` with the same fields records on ``debugmodel`` (FSDP 2, H100), each
    linear built as ``Float8AllGatherLinear``; and without all-gather the precompute is
    refused as in ``float8_linears``."""
    fields = '"recipe_name": "tensorwise", "enable_fsdp_float8_all_gather": true, ' \
             '"precompute_float8_dynamic_scale_for_fsdp": true'
    _, after = _linears(
        "debugmodel_float8", ("--override.imports", f"{FLOAT8_FACTORIES}.float8_recipe={{{fields}}}")
    )
    assert {type(cfg).__qualname__ for cfg in after.values()} == {"Float8AllGatherLinear.Config"}
    assert {cfg.precompute_float8_dynamic_scale_for_fsdp for cfg in after.values()} == {True}
    peaks = {}
    for label, name, factory in (
        ("recipe", TWO_BLOCKS_FLOAT8, "float8_recipe"),
        ("converted", TWO_BLOCKS, "float8_linears"),
    ):
        extra = ("--override.imports", f"{FLOAT8_FACTORIES}.{factory}={{{fields}}}")
        _, _, prediction = recorded_job(TorchtitanJob(*name, SMALL_STEP + extra, world_size=2), steps=2)
        peaks[label] = (prediction.peak_allocated_bytes, prediction.peak_reserved_bytes)
    assert peaks["recipe"] == peaks["converted"]
    from oomkit.errors import ConfigError

    with pytest.raises(ConfigError, match="precompute_float8_dynamic_scale_for_fsdp precomputes"):
        _linears("debugmodel_float8", (
            "--override.imports",
            f'{FLOAT8_FACTORIES}.float8_recipe={{"precompute_float8_dynamic_scale_for_fsdp": true}}'))
