"""transformers / TRL: the trainer callback, and the GRPO trainer whose server-mode sync goes through a store.

- :mod:`.callback`: :class:`DeltaSyncCallback`, a ``TrainerCallback`` that publishes every step (any TRL).
- :mod:`.grpo_server`: :class:`DeltaSyncGRPOTrainer`, every TRL internal deltasync touches, version-pinned.
- :mod:`.async_grpo`: :class:`DeltaSyncTransfer`, the ``weight_transfer`` of TRL's AsyncGRPOTrainer.
- :mod:`.metrics`: the ``deltasync/*`` figures both put in a trainer's logs.

Both are imported on first use, so importing this package needs neither transformers nor TRL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .async_grpo import DeltaSyncTransfer
    from .callback import DeltaSyncCallback, ReplicaTimeout
    from .grpo_server import DeltaSyncGRPOTrainer

__all__ = ["DeltaSyncCallback", "DeltaSyncGRPOTrainer", "DeltaSyncTransfer", "ReplicaTimeout"]


def __getattr__(name: str) -> Any:
    if name in ("DeltaSyncCallback", "ReplicaTimeout"):
        from . import callback

        return getattr(callback, name)
    if name == "DeltaSyncGRPOTrainer":
        from .grpo_server import DeltaSyncGRPOTrainer

        return DeltaSyncGRPOTrainer
    if name == "DeltaSyncTransfer":
        from .async_grpo import DeltaSyncTransfer

        return DeltaSyncTransfer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
