"""``--tp N`` in the CLI: which targets tensor parallel is modelled for, and the layout in words."""

from __future__ import annotations

import argparse

from oomkit.core.target import ParallelLayout
from oomkit.errors import OomkitError

__all__ = ["describe_layout", "refuse_tp_target", "tp_notes"]


def describe_layout(layout: ParallelLayout) -> str:
    """The parallel layout in words, outermost first: ``"FSDP2 4 x TP 2"``; replicas of FSDP2
    shard groups are HSDP's (``"HSDP replicas 2 x FSDP2 4"``), not DDP's."""
    replicas = "DDP" if layout.fsdp == 1 else "HSDP replicas"
    parts = [
        f"{label} {degree}"
        for label, degree in ((replicas, layout.dp), ("FSDP2", layout.fsdp), ("TP", layout.tp))
        if degree > 1
    ]
    # All degrees 1 and not DDP: the 1-rank mesh is FSDP2's (mesh_shape's ("fsdp",) dimension).
    return " x ".join(parts) or "FSDP2 1"


def refuse_tp_target(args: argparse.Namespace, command: str = "predict") -> None:
    """``--tp`` applies oomkit's tensor-parallel plan, written for the Llama presets.

    Args:
        args: the parsed flags.
        command: the subcommand (``"predict"``, ``"fit"``), for the messages' examples.

    Raises:
        OomkitError: ``--hf`` or ``file.py:function`` with ``--tp``: neither is given a plan.
    """
    from oomkit.interfaces.cli._user_function import is_user_target

    if args.hf is not None:
        raise OomkitError(
            "--tp is modelled for the Llama presets (torchtitan's tensor-parallel plan, e.g. "
            f"`oomkit {command} llama3-8b --tp 2`); a --hf model has no plan in oomkit: "
            f"{command} it with --fsdp N alone, or without --tp"
        )
    if args.target is not None and is_user_target(args.target):
        raise OomkitError(
            f"--tp is modelled for the Llama presets (e.g. `oomkit {command} llama3-8b --tp 2`); "
            f"{args.target} is a file.py:function step, which oomkit does not parallelize: "
            f"{command} it with --fsdp N (the function then takes `mesh` and calls fully_shard)"
        )


def tp_notes(layout: ParallelLayout) -> tuple[str, ...]:
    """What a ``--tp`` prediction models and leaves out, for the report's warnings."""
    if layout.tp == 1:
        return ()
    fsdp = (
        f"then FSDP2 over {layout.fsdp} ranks on the other mesh dimension; "
        if layout.fsdp > 1
        else "no FSDP, so bf16-mixed runs under torch.autocast (torchtitan's maybe_enable_amp "
        "would train in fp32 there); "
    )
    return (
        f"tensor parallel: torchtitan's Llama plan over {layout.tp} ranks (colwise q/k/v and "
        "gate/up, rowwise o/down, vocabulary-sharded embedding and LM head, sequence-parallel "
        f"norms, loss parallel), {fsdp}DTensor's all-gathers and reduce-scatters allocate on "
        "the current stream and are waited at once; async TP and Float8 TP are not modelled",
    )
