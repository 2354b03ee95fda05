"""Appliers write validated patches where the weights live.

- :class:`~deltasync.appliers.torch_module.TorchModuleApplier`: any ``nn.Module`` or tensor mapping.
- :class:`~deltasync.appliers.checkpoint.CheckpointDirApplier`: a safetensors checkpoint directory on disk,
  patched in place through memory maps (imported on first use).
- :class:`~deltasync.appliers.vllm.VLLMFollower`: a vLLM engine, through its worker extension (imported on
  first use).

The engine-agnostic layers every engine builds on:

- :mod:`.mapping`: checkpoint tensor name and flat indices -> (runtime parameter, positions) on this rank;
  index maps, boxes, tables, and the registry of parameter layouts.
- :mod:`.verify`: the proof of a map against what the engine holds, before the first write.
- :mod:`.apply`: check every entry, then write (``check_header``, ``plan_patches``, ``write_patches``).

One subpackage per engine that needs several modules: :mod:`.vllm`, :mod:`.checkpoint`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .torch_module import TorchModuleApplier

if TYPE_CHECKING:
    from .checkpoint import CheckpointDirApplier
    from .vllm import VLLMFollower

__all__ = ["TorchModuleApplier", "CheckpointDirApplier", "VLLMFollower"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointDirApplier":
        from .checkpoint import CheckpointDirApplier

        return CheckpointDirApplier
    if name == "VLLMFollower":  # vLLM replicas (worker extension: deltasync.appliers.vllm.worker)
        from .vllm import VLLMFollower

        return VLLMFollower
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
