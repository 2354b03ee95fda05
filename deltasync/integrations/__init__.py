"""Integrations with training frameworks, imported lazily so ``import deltasync`` needs none of them.

- :class:`DeltaSyncCallback` (transformers ``TrainerCallback``; extra ``trl``)
- :class:`DeltaSyncGRPOTrainer` (TRL ``GRPOTrainer`` whose vLLM server-mode weight sync goes through a store)
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeltaSyncCallback", "DeltaSyncGRPOTrainer", "ReplicaTimeout"]


def __getattr__(name: str) -> Any:
    if name in ("DeltaSyncCallback", "ReplicaTimeout"):
        from . import trl

        return getattr(trl, name)
    if name == "DeltaSyncGRPOTrainer":
        from ._trl_patch import DeltaSyncGRPOTrainer

        return DeltaSyncGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
