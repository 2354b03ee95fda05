"""Appliers write validated patches where the weights live.

- :class:`~deltasync.appliers.torch.TorchModuleApplier`: any ``nn.Module`` or tensor mapping.
- :class:`~deltasync.appliers.checkpoint.CheckpointDirApplier`: a safetensors checkpoint
  directory on disk, patched in place through memory maps (imported on first use).
- :class:`~deltasync.appliers.vllm_follower.VLLMFollower`: a vLLM engine, through its
  worker extension (imported on first use).

Modules by layer (each imports only its own layer and those below):

- mapping: checkpoint tensor name and flat indices -> (runtime parameter,
  positions) on this rank. ``mapping`` (engine-agnostic index maps, boxes,
  tables, and the registry of parameter layouts), ``vllm_mapping`` (probing
  vLLM's weight loaders).
- apply: ``apply`` (check every entry, then write; ``check_header``), ``worker_decode`` (a version's
  files decoded by the rank that holds every element, against its own weights).
- transport: ``wire`` (RPC encoding), ``vllm_rpc`` (in-process vs server
  engine), ``vllm_prefetch`` (downloaded deltas seen early), ``file_drop`` (files handed
  to a server on the same machine by path), ``vllm_follower``
  (the follower loop and its command line), ``vllm`` (the worker extension),
  ``cpu_hooks`` (vLLM CPU-backend packing hooks).
- the other engines, each on the apply layer: ``torch``; ``checkpoint``
  (the applier and initialisation), ``checkpoint_files`` (files, index, maps,
  lock), ``checkpoint_state`` (the state file).
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
