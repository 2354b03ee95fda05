"""A safetensors checkpoint directory on disk, kept at a run's latest version in place.

- :mod:`.applier`: :class:`CheckpointDirApplier`, the applier and its initialisation.
- :mod:`.files`: the directory's safetensors files, their index, memory maps and the writer's lock.
- :mod:`.state`: the state file ``deltasync.json`` that says which version the files hold.
"""

from __future__ import annotations

from .applier import CheckpointDirApplier

__all__ = ["CheckpointDirApplier"]
