"""Labelled predictions: small built-in presets that do not fit a small GPU.

Each case is ``oomkit predict PRESET ... --gpu SIZE --steps 2 --json``; ``explain`` must find a
shortage and rank first the remedy named here, measured by re-predicting the step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PredictionCase:
    name: str
    preset: str
    options: Mapping[str, int] = field(default_factory=dict)
    gpu: str = "3GiB"
    expected: str = "shortage"
    top_remedy: str = ""

    def argv(self) -> list[str]:
        """The `oomkit predict` command line (without the program name)."""
        flags = {"batch_size": "--batch", "seq_len": "--seq", "image_size": "--image-size"}
        out = ["predict", self.preset, "--gpu", self.gpu, "--steps", "2", "--json"]
        for key, value in self.options.items():
            out += [flags[key], str(value)]
        return out


PREDICTION_CASES: tuple[PredictionCase, ...] = (
    # Activations dominate and the batch can shrink 4x; pure bf16 (weights, gradients and Adam
    # states in bf16) fits too and saves more, so it leads the remedies that fit (issue 35).
    PredictionCase(
        "gpt2 batch",
        "gpt2-124m",
        {"batch_size": 8, "seq_len": 256},
        "3GiB",
        top_remedy="pure bf16 weights, gradients and optimizer states",
    ),
    # ViT-B/16's activations recompute cheaply per block: checkpointing saves more than halving.
    PredictionCase(
        "vit checkpointing",
        "vit-b16",
        {"batch_size": 32},
        "4GiB",
        top_remedy="activation checkpointing",
    ),
)
