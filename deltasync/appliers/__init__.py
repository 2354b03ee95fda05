"""Appliers write validated patches where the weights live.

- :class:`~deltasync.appliers.torch.TorchModuleApplier`: any ``nn.Module`` or tensor mapping.
"""

from __future__ import annotations

from .torch import TorchModuleApplier

__all__ = ["TorchModuleApplier"]
