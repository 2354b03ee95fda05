"""Integrations with training frameworks, imported lazily so ``import deltasync`` needs none of them.

- :class:`DeltaSyncCallback` (transformers ``TrainerCallback``; extra ``trl``)
- :class:`DeltaSyncGRPOTrainer` (TRL ``GRPOTrainer`` whose vLLM server-mode weight sync goes through a store)
"""

from __future__ import annotations

import warnings
from typing import Any

# TRL checks the vLLM version each time it asks whether vLLM is available (six times in one GRPO run)
# and warns each time that 0.32 is outside its list. deltasync's GRPO server mode is tested with vLLM
# 0.32 (the CPU build), through the OpenAI-compatible endpoints only: the integration says so once
# (``_trl_patch``) instead.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)

__all__ = ["DeltaSyncCallback", "DeltaSyncGRPOTrainer", "ReplicaTimeout"]


def __getattr__(name: str) -> Any:
    if name in ("DeltaSyncCallback", "ReplicaTimeout"):
        from . import trl

        return getattr(trl, name)
    if name == "DeltaSyncGRPOTrainer":
        from ._trl_patch import DeltaSyncGRPOTrainer

        return DeltaSyncGRPOTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
