"""A tiny dataset for the HF Trainer tests: 64 rows of 4 features and a 0/1 label."""

from __future__ import annotations

import torch


class RowDataset(torch.utils.data.Dataset):
    """Row i is ``{"x": [i, i, i, i], "labels": i % 2}``, as floats."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "labels": torch.tensor(float(i % 2))}
