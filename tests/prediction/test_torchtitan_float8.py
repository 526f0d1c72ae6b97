"""Float8 on any llama3 config through ``--override.imports``: torchtitan's converter per linear.

torchtitan 0.3.0 puts Float8 on the model spec (``model_registry(..., converters=[...])``), which
no override field reaches; ``oomkit.prediction._torchtitan_float8`` registers two ``@override``
factories the launcher's ``--override.imports`` names. The debug model: 6 blocks of 5 linears
(wqkv, wo, w1, w2, w3) and the LM head, every dimension a multiple of 16.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torchtitan")

from _torchtitan_recordings import recorded_job  # noqa: E402
from _torchtitan_small_job import FLOAT8_FACTORIES, SMALL_STEP, TWO_BLOCKS, TWO_BLOCKS_FLOAT8  # noqa: E402

from oomkit.core.target import Target  # noqa: E402
from oomkit.errors import OomkitError  # noqa: E402
from oomkit.prediction._torchtitan_env import (  # noqa: E402
    SUPPORTED_TORCHTITAN,
    cuda_capability,
    import_torchtitan,
    torchtitan_version,
)
from oomkit.prediction.torchtitan_job import (  # noqa: E402
    TorchtitanJob,
    load_job_config,
    record_torchtitan_job,
)

if torchtitan_version() not in SUPPORTED_TORCHTITAN:  # pragma: no cover - another release
    pytest.skip("an unsupported torchtitan is installed", allow_module_level=True)



def _linears_after_overrides(*imports: str) -> dict[str, type]:
    """The job's linear configs (FQN -> config type) after torchtitan's apply_overrides, as
    trainer.py:357-358 applies them (on an H100's capability)."""
    overrides = ("--override.imports", *imports) if imports else ()
    config = load_job_config(TorchtitanJob("llama3", "debugmodel", SMALL_STEP + overrides))
    linear = import_torchtitan("torchtitan.models.common.linear").Linear
    with cuda_capability((9, 0)):
        import_torchtitan("torchtitan.config.override").apply_overrides(config.override, config)
    return {fqn: cfg for fqn, cfg, _, _ in config.traverse(linear.Config)}


def test_float8_linears_converts_every_linear_the_lm_head_too():
    found = _linears_after_overrides(f"{FLOAT8_FACTORIES}.float8_linears")
    assert len(found) == 6 * 5 + 1
    assert {type(cfg).__qualname__ for cfg in found.values()} == {"Float8Linear.Config"}


def test_float8_block_linears_keeps_the_lm_head_as_torchtitan_did_in_2024():
    found = _linears_after_overrides(f'{FLOAT8_FACTORIES}.float8_block_linears={{"recipe_name": "tensorwise"}}')
    kinds = {fqn.rsplit("model.", 1)[-1]: type(cfg).__qualname__ for fqn, cfg in found.items()}
    assert kinds.pop("lm_head") == "Linear.Config"
    assert set(kinds.values()) == {"Float8Linear.Config"} and len(kinds) == 30
    torchao = import_torchtitan("torchao.float8")
    recipes = {repr(cfg._torchao_config) for cfg in found.values() if hasattr(cfg, "_torchao_config")}
    assert recipes == {repr(torchao.Float8LinearConfig.from_recipe_name("tensorwise"))}


def test_the_replacement_keeps_the_fields_update_from_config_set():
    """derive() hands over every Linear.Config field of the replaced config (the sharding set by
    update_from_config, the param_init draws), where the converter would build a fresh one."""
    import dataclasses

    overrides = ("--override.imports", f"{FLOAT8_FACTORIES}.float8_linears")
    config = load_job_config(TorchtitanJob("llama3", "debugmodel", SMALL_STEP + overrides))
    linear = import_torchtitan("torchtitan.models.common.linear").Linear
    before = {fqn: cfg for fqn, cfg, _, _ in config.traverse(linear.Config)}
    with cuda_capability((9, 0)):
        import_torchtitan("torchtitan.config.override").apply_overrides(config.override, config)
    after = {fqn: cfg for fqn, cfg, _, _ in config.traverse(linear.Config)}
    assert after.keys() == before.keys()
    for fqn, cfg in before.items():
        assert after[fqn] is not cfg
        for field in dataclasses.fields(cfg):
            assert getattr(after[fqn], field.name) is getattr(cfg, field.name), (fqn, field.name)


def test_the_override_records_the_same_bytes_as_torchtitans_float8_config():
    """``llama3_debugmodel`` + ``float8_linears`` is ``llama3_debugmodel_float8`` (the registry's
    converter on every linear): the same peak, to the byte, on FSDP 2 and an H100. Both cut to
    their first 2 blocks (``TWO_BLOCKS``, ``TWO_BLOCKS_FLOAT8``: the registry converts before
    the cut), which record in half the time of 6; the registry's recording is shared with the
    other Float8 tests (``_torchtitan_recordings``)."""
    peaks = []
    for name, extra in (
        (TWO_BLOCKS_FLOAT8, ()),
        (TWO_BLOCKS, ("--override.imports", f"{FLOAT8_FACTORIES}.float8_linears")),
    ):
        _, _, prediction = recorded_job(TorchtitanJob(*name, SMALL_STEP + extra, world_size=2))
        peaks.append((prediction.peak_allocated_bytes, prediction.peak_reserved_bytes))
    assert peaks[0] == peaks[1]


def test_float8_through_the_override_on_an_a100_is_refused_in_torchtitans_words():
    job = TorchtitanJob(
        "llama3", "debugmodel", SMALL_STEP + ("--override.imports", f"{FLOAT8_FACTORIES}.float8_linears"),
        world_size=2,
    )
    with pytest.raises(OomkitError, match="float8 is only supported on NVIDIA SM89 or later"):
        record_torchtitan_job(job, target=Target.resolve("A100 80GB SXM"))


@settings(max_examples=40, deadline=None)
@given(
    in_features=st.integers(1, 4096),
    out_features=st.integers(1, 4096),
    recipe=st.sampled_from(["rowwise", "tensorwise", "rowwise_with_gw_hp"]),
)
def test_a_linear_is_swapped_exactly_when_the_converter_would(in_features, out_features, recipe):
    """torchtitan's module_filter_fn: float8 matmuls need every dimension a multiple of 16; a
    linear that passes becomes Float8Linear.Config with the recipe's torchao config, any other
    is handed back as it is."""
    from oomkit.prediction._torchtitan_float8 import float8_linears

    linear = import_torchtitan("torchtitan.models.common.linear").Linear
    torchao = import_torchtitan("torchao.float8")
    config = linear.Config(in_features=in_features, out_features=out_features)
    with cuda_capability((9, 0)):
        swapped = float8_linears(config, recipe_name=recipe)
    if in_features % 16 or out_features % 16:
        assert swapped is config
        return
    assert type(swapped).__qualname__ == "Float8Linear.Config"
    assert (swapped.in_features, swapped.out_features) == (in_features, out_features)
    assert repr(swapped._torchao_config) == repr(torchao.Float8LinearConfig.from_recipe_name(recipe))
