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
    from .vllm_follower import VLLMFollower

__all__ = ["TorchModuleApplier", "CheckpointDirApplier", "VLLMFollower"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointDirApplier":
        from .checkpoint import CheckpointDirApplier

        return CheckpointDirApplier
    if name == "VLLMFollower":  # vLLM replicas (worker extension: deltasync.appliers.vllm)
        from .vllm_follower import VLLMFollower

        return VLLMFollower
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
