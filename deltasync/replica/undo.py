"""The values a replica's applies overwrote: to put them back when an apply fails midway, or later, on request.

Before a version's patches are written, :meth:`UndoLog.capture` reads the bit patterns they will overwrite
(:meth:`~deltasync.replica.applier.Applier.lookup` at the same positions; on the weights' accelerator for
patches rebuilt there, without a wait for the host). If a write then fails between the
first tensor and the last, the subscriber writes them back and the replica is again exactly at the version it
held (an apply is all or nothing). Once the apply succeeds the entry is kept, newest first, within
``max_bytes``, so :meth:`~deltasync.replica.subscriber.Subscriber.undo` can step back through the last
applies without the store.

An anchor's patches overwrite whole tensors: their entry is the whole model, taken only within ``max_bytes``;
beyond it, a failed anchor write leaves the replica needing another anchor, and it says so.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from ..codec import Decoded
from ..tensors import bits_dtype
from .applier import Applier

__all__ = ["UNDO_BYTES", "UndoEntry", "UndoLog"]

UNDO_BYTES = 64 << 20
"""Default bytes of overwritten values kept for :meth:`~deltasync.replica.subscriber.Subscriber.undo` (the
entry of the apply in progress is taken whatever its size when it is a delta's)."""


@dataclass(frozen=True, slots=True)
class UndoEntry:
    """What one apply overwrote: writing :attr:`patches` takes the weights back from ``version`` to ``previous``."""

    run_id: str | None
    previous: int | None
    version: int
    patches: dict[str, Decoded]

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(p) for p in self.patches.values())


def _nbytes(patch: Decoded) -> int:
    size = int(getattr(patch.values, "nbytes", 0))
    return size + (int(getattr(patch.indices, "nbytes", 0)) if patch.indices is not None else 0)


class UndoLog:
    """The entries of the last applies, newest last, within ``max_bytes``."""

    def __init__(self, max_bytes: int = UNDO_BYTES) -> None:
        self.max_bytes = max_bytes
        self.entries: deque[UndoEntry] = deque()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def capture(
        self, applier: Applier, decoded: Mapping[str, Decoded], *, run_id: str | None, previous: int | None,
        version: int,
    ) -> UndoEntry | None:
        """The values ``decoded`` will overwrite, read now (``None``: the replica holds no version of the run
        yet, so there is nothing to go back to, or whole tensors beyond ``max_bytes``)."""
        if previous is None:
            return None
        whole = sum(applier.specs[n].numel * applier.specs[n].torch_dtype.itemsize
                    for n, p in decoded.items() if p.indices is None)
        if whole > self.max_bytes:
            return None
        patches = {}
        reader = applier.on_device
        for name, patch in decoded.items():
            if reader is not None:  # weights on an accelerator: read there, kept there, no wait for the host
                device, spec = reader.device_of(name), applier.specs[name]
                indices = torch.arange(spec.numel, device=device) if patch.indices is None else (
                    torch.as_tensor(patch.indices).to(device=device, dtype=torch.int64))
                old = torch.empty(indices.numel(), dtype=bits_dtype(spec.torch_dtype), device=device)
                reader.gather_into([(name, indices)], old)
                patches[name] = Decoded(None if patch.indices is None else indices, old)
            elif patch.indices is None:  # a whole tensor: all of it is overwritten
                everything = np.arange(applier.specs[name].numel, dtype=np.int64)
                patches[name] = Decoded(None, applier.lookup(name, everything))
            else:
                indices = patch.indices if isinstance(patch.indices, np.ndarray) else patch.indices.cpu().numpy()
                patches[name] = Decoded(indices, applier.lookup(name, indices))
        return UndoEntry(run_id, previous, version, patches)

    def keep(self, entry: UndoEntry) -> None:
        """Keep ``entry`` (an apply that succeeded); the oldest go first beyond ``max_bytes``."""
        self.entries.append(entry)
        total = self.nbytes
        while self.entries and total > self.max_bytes:
            total -= self.entries.popleft().nbytes

    def pop(self) -> UndoEntry | None:
        """The newest entry, taken out (``None``: none kept)."""
        return self.entries.pop() if self.entries else None

    def clear(self) -> None:
        self.entries.clear()
