"""Optional framework integrations; each module imports its framework only when imported itself.

- :mod:`oomkit.interfaces.integrations.lightning`: ``OomkitCallback`` for PyTorch Lightning
  (``pip install oomkit[lightning]``).
- :mod:`oomkit.interfaces.integrations.huggingface`: ``OomkitTrainerCallback`` and ``apply_batch_size`` for
  the ``transformers`` Trainer (``pip install oomkit[hf]``).

Nothing is imported here, so ``import oomkit.interfaces.integrations`` needs neither framework.
"""

from __future__ import annotations

__all__: list[str] = []
