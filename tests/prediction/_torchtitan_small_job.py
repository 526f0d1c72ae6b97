"""What the torchtitan Float8 and job tests share (``tests/prediction`` is on ``sys.path``, as
for ``_torchtitan_two_blocks``): the small step their jobs run, the module of oomkit's Float8
override factories, and one debug-model block's parameters."""

from __future__ import annotations

import functools

from oomkit.prediction._torchtitan_env import import_torchtitan

__all__ = [
    "FLOAT8_FACTORIES",
    "SMALL_STEP",
    "TWO_BLOCKS",
    "TWO_BLOCKS_FLOAT8",
    "debug_block_parameters",
    "debug_model_on_meta",
    "debug_pp_row",
    "float8_block_linears_override",
    "small_step",
]

# The module ``--override.imports`` names for oomkit's Float8 factories.
FLOAT8_FACTORIES = "oomkit.prediction._torchtitan_float8"

def small_step(batch: int = 2, seq: int = 256) -> tuple[str, ...]:
    """torchtitan overrides of a small step on fake ranks: ``batch`` sequences of ``seq`` tokens,
    DTensor sharding, no CUDA graphs (the fake process group cannot capture one)."""
    return (
        "--parallelism.spmd_backend", "partial_dtensor",
        "--training.local_batch_size", str(batch),
        "--training.seq_len", str(seq),
        "--training.disable_cuda_graphs",
    )


# The Float8 and job tests' step: 2 sequences of 256 tokens.
SMALL_STEP = small_step()


def debug_pp_row(row_id: str, *, fsdp: int, tp: int) -> dict:
    """A benchmarks/torchtitan_rows.py row of the debugmodel on 4 fake GPUs: PP 2 (1F1B) by
    ``fsdp`` x ``tp``, 4 sequences of 512 tokens, full AC, eager, no Float8."""
    return {
        "id": row_id,
        "model": "debugmodel",
        "gpus": 4,
        "layout": {"fsdp": fsdp, "tp": tp, "pp": 2, "cp": 1},
        "local_batch_size": 4,
        "seq_len": 512,
        "activation_checkpoint": "full",
        "compile": False,
        "float8": False,
        "pp_schedule": "1F1B",
        "measured_gib": 1.0,
    }

# (module, config) of the tests' registry modules (tests/prediction): llama3's debugmodel and its
# registry's debugmodel_float8 (every linear converted), each cut to its first 2 blocks.
TWO_BLOCKS = ("_torchtitan_two_blocks", "llama3_debug_two_blocks")
TWO_BLOCKS_FLOAT8 = ("_torchtitan_two_blocks_float8", "llama3_debug_two_blocks_float8")


@functools.cache
def debug_model_on_meta():
    """torchtitan's llama3 ``debugmodel``, built on the meta device (read its sizes only)."""
    import torch

    registry = import_torchtitan("torchtitan.models.llama3.config_registry")
    with torch.device("meta"):
        return registry.llama3_debugmodel().model_spec.model.build()


def debug_block_parameters() -> tuple[dict[str, int], dict[str, int]]:
    """One debugmodel block's parameters, element counts: (linear weights, the rest)."""
    linears: dict[str, int] = {}
    others: dict[str, int] = {}
    for name, param in debug_model_on_meta().layers["0"].named_parameters():
        (linears if param.ndim == 2 else others)[name] = param.numel()
    return linears, others


def float8_block_linears_override(*, all_gather: bool, precompute: bool) -> tuple[str, ...]:
    """``--override.imports`` of 2024's Float8 (``float8_block_linears``, tensorwise) with
    float8 all-gather and the scales' precompute on or off: one spelling for the float8
    all-gather and precompute tests, whose jobs are then recorded once for both."""
    def word(flag: bool) -> str:
        return "true" if flag else "false"

    return (
        "--override.imports",
        f'{FLOAT8_FACTORIES}.float8_block_linears={{"recipe_name": "tensorwise", '
        f'"enable_fsdp_float8_all_gather": {word(all_gather)}, '
        f'"precompute_float8_dynamic_scale_for_fsdp": {word(precompute)}}}',
    )
