"""deltasync: exact sparse bf16 weight sync for asynchronous RL, through object storage."""

from __future__ import annotations

from .appliers import TorchModuleApplier
from .errors import DeltaSyncError

__version__ = "0.1.0"

__all__ = ["DeltaSyncError", "TorchModuleApplier", "__version__"]
