"""Appliers write validated patches where the weights live.

- :class:`~deltasync.appliers.torch.TorchModuleApplier`: any ``nn.Module`` or tensor mapping.
- :class:`~deltasync.appliers.checkpoint.CheckpointDirApplier`: a safetensors checkpoint
  directory on disk, patched in place through memory maps (imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .torch import TorchModuleApplier

if TYPE_CHECKING:
    from .checkpoint import CheckpointDirApplier

__all__ = ["TorchModuleApplier", "CheckpointDirApplier"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointDirApplier":
        from .checkpoint import CheckpointDirApplier

        return CheckpointDirApplier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
