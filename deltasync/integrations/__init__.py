"""Integrations with training frameworks, imported lazily so ``import deltasync`` needs none of them.

- :mod:`.trl`: :class:`DeltaSyncCallback` (a transformers ``TrainerCallback``; extra ``trl``) and
  :class:`DeltaSyncGRPOTrainer` (TRL's ``GRPOTrainer`` whose vLLM server-mode weight sync goes through a store),
  :class:`DeltaSyncTransfer` (the ``weight_transfer`` of TRL's AsyncGRPOTrainer).
- :mod:`.vllm`: the plugin that registers the ``deltasync`` backend in vLLM, and vLLM's trainer-side engine.
- :mod:`.distributed`: what kind of distributed model a trainer hands over (DDP, FSDP1, FSDP2, ZeRO-3).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeltaSyncCallback", "DeltaSyncGRPOTrainer", "DeltaSyncTransfer", "ReplicaTimeout"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import trl

        return getattr(trl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
