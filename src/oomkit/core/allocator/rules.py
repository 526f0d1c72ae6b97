"""The simulator's names for the one per-release record of ``oomkit.core.allocator.versions``.

``rules_for`` *is* ``behaviour_for`` and ``AllocatorRules`` *is* ``TorchBehaviour``: there is one
frozen record per PyTorch ``major.minor``, built in one place, with every field explicit. These
names stay because the simulator's modules import them.
"""

from __future__ import annotations

from oomkit.core.allocator.versions import OomMessageVariant, TorchBehaviour, behaviour_for

__all__ = ["AllocatorRules", "OomMessageVariant", "rules_for"]

AllocatorRules = TorchBehaviour
rules_for = behaviour_for
