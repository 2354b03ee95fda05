"""vLLM replicas: the worker extension, the follower that drives it, and the map from checkpoint to engine.

By role:

- mapping: :mod:`.mapping` (an :class:`~deltasync.appliers.mapping.IndexMap` probed from vLLM's weight
  loaders), :mod:`.recorded` (the loaders of parameters quantized layers re-created), :mod:`.cpu_experts`
  (vLLM's CPU MoE prepacking, a registered parameter layout), :mod:`.quantized` (whether the engine's
  quantization is the run's).
- decode: :mod:`.rank_decode` (a version's files decoded by the rank that holds every element).
- transport: :mod:`.wire` (what the follower and the workers send each other), :mod:`.rpc` (an in-process
  engine or a server), :mod:`.prefetch` (downloaded deltas seen early), :mod:`.file_drop` (files handed to an
  engine on the same machine), :mod:`.cpu_hooks` (the CPU backend's packing hooks).
- the two ends: :mod:`.worker` (the worker extension, in every engine worker), :mod:`.follower` (the
  :class:`VLLMFollower` applier beside the engine), :mod:`.lora` (a LoRA run's adapter, served by vLLM).

Nothing here is imported with the package: ``import deltasync.appliers.vllm.worker`` installs the CPU
backend's hooks, which only the engine's workers want.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .follower import VLLMFollower

__all__ = ["VLLMFollower"]


def __getattr__(name: str) -> Any:
    if name == "VLLMFollower":
        from .follower import VLLMFollower

        return VLLMFollower
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
