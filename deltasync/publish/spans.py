"""Catch-up spans: one delta from ``v - 2**j`` straight to ``v``, written beside the chain of single deltas.

A replica ``k`` versions behind reaches the newest version through O(log k) spans instead of ``k`` deltas
(docs/PROTOCOL.md, "Spans"). At version ``v`` a writer publishes, for each ``2**j`` (``j >= 1``) that divides
``v``, up to ``max_span``, the span from ``v - 2**j``: the union of the elements changed in between, each
coded against its value at ``v - 2**j`` (``compact``, whose value digest proves the replica's base) with its
value at ``v``. Elements that changed and came back are left out.

The span of ``2**j`` versions is the merge of the two spans of ``2**(j-1)`` that meet at its middle, both
already in hand, so nothing is read back from the store: :class:`SpanLevels` keeps, per length, the newest
:class:`Run` (indices, old and new bit patterns of its changed elements). A run whose union covers more than
:data:`MAX_DENSITY` of the model is not kept: its span would cost a sizeable share of an anchor, and holding it
would cost the trainer more memory than it saves replicas.

Whether a span is published is decided by its encoded size (:meth:`~deltasync.publish.engine.VersionWriter.
commit_spans`): it must be smaller than the cheapest route the manifest already lists from its base to its
version, and than the newest anchor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..tensors import ChangeSet, TensorChange, TensorSpec

__all__ = ["MAX_DENSITY", "MAX_SPAN", "SPAN_CODEC", "Run", "SpanLevels", "merge", "run_of"]

MAX_SPAN = 64
"""Default longest span, in versions: a replica up to 2 * 64 versions behind needs about 2 log2(k) objects;
further behind, an anchor is usually the cheaper route anyway."""
MAX_DENSITY = 0.125
"""The largest share of the model's elements a kept run may cover. A kept run costs the trainer about 8 bytes
a changed element (int32 positions, two bf16 values), so each span length holds at most one byte per parameter;
a span that dense is about a tenth of an anchor on the wire."""
SPAN_CODEC = "compact"
"""Spans are coded against the replica's values at their base, whatever the run's codec: the value digest
proves that base, and the common small steps cost a few bits."""

Triple = tuple[np.ndarray, np.ndarray, np.ndarray]  # sorted flat indices, old bit patterns, new bit patterns
SMALL_INDEX = 1 << 31  # tensors with fewer elements keep their positions as int32


@dataclass(frozen=True, slots=True)
class Run:
    """What changed from version ``base`` to version ``version``: per tensor, the changed elements' sorted flat
    indices with their bit patterns at ``base`` and at ``version``."""

    base: int
    version: int
    tensors: dict[str, Triple]

    @property
    def nnz(self) -> int:
        return sum(int(t[0].size) for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        """Memory the run holds."""
        return sum(sum(a.nbytes for a in t) for t in self.tensors.values())

    def change_set(self, specs: tuple[TensorSpec, ...]) -> ChangeSet:
        """This run as the change set of a delta from ``base`` to ``version``."""
        changes = []
        for spec in specs:
            if spec.name in self.tensors:
                indices, old, new = self.tensors[spec.name]
                changes.append(TensorChange(spec, torch.from_numpy(indices.astype(np.int64, copy=False)),
                                            torch.from_numpy(new), torch.from_numpy(old), int(indices.size)))
        return ChangeSet(tuple(changes), specs)


def run_of(changes: ChangeSet, version: int) -> Run:
    """One version's changes as a run from ``version - 1``; call it before the snapshot moves past them (a
    densely changed tensor is read against the snapshot's old values)."""
    tensors: dict[str, Triple] = {}
    for change in changes.changes:
        sparse = change.as_sparse() if change.dense else change
        assert sparse.indices is not None and sparse.base is not None
        if sparse.indices.numel():
            # Copies: a diff may hand out views of buffers it reuses.
            small = change.spec.numel < SMALL_INDEX
            tensors[change.spec.name] = (
                sparse.indices.cpu().numpy().astype(np.int32 if small else np.int64),
                np.array(sparse.base.cpu().numpy()), np.array(sparse.values.reshape(-1).cpu().numpy()),
            )
    return Run(version - 1, version, tensors)


def merge(earlier: Run, later: Run) -> Run:
    """The run from ``earlier.base`` to ``later.version`` (``later`` must start where ``earlier`` ends).

    Each element keeps its oldest old value and its newest new value; elements that came back to where they
    started are dropped.
    """
    if earlier.version != later.base:
        raise ValueError(f"runs {earlier.base}->{earlier.version} and {later.base}->{later.version} do not meet")
    tensors = dict(earlier.tensors)
    for name, (idx_b, old_b, new_b) in later.tensors.items():
        if name not in tensors:
            tensors[name] = (idx_b, old_b, new_b)
            continue
        idx_a, old_a, new_a = tensors[name]
        indices = np.union1d(idx_a, idx_b)
        at_a, at_b = np.searchsorted(indices, idx_a), np.searchsorted(indices, idx_b)
        old = np.empty(indices.size, old_a.dtype)
        new = np.empty(indices.size, new_a.dtype)
        old[at_b] = old_b  # unchanged before the middle: its old value is the middle's
        old[at_a] = old_a
        new[at_a] = new_a  # unchanged after the middle: its new value is the middle's
        new[at_b] = new_b
        moved = old != new
        if moved.all():
            tensors[name] = (indices, old, new)
        elif moved.any():
            tensors[name] = (indices[moved], old[moved], new[moved])
        else:
            del tensors[name]
    return Run(earlier.base, later.version, tensors)


class SpanLevels:
    """The newest run of each power-of-two length, and which spans a new version completes.

    Args:
        max_span (`int`): the longest span, in versions (a power of two; below 2: no spans).
        numel (`int`): elements in the model, for :data:`MAX_DENSITY`.
    """

    def __init__(self, max_span: int, numel: int) -> None:
        self.max_span, self.numel = max_span, numel
        self.levels: dict[int, Run] = {}

    @property
    def nbytes(self) -> int:
        """Memory the kept runs hold."""
        return sum(run.nbytes for run in self.levels.values())

    def record(self, changes: ChangeSet, version: int) -> list[Run]:
        """Take in the changes that made ``version`` (before the snapshot moves past them).

        Returns:
            `list[Run]`: the runs of 2, 4, ... versions that end at ``version``, shortest first: the spans due.
        """
        if self.max_span < 2:
            return []
        run, due, j = run_of(changes, version), [], 0
        while True:
            previous = self.levels.get(j)
            self.levels[j] = run
            length = 2 << j
            if length > self.max_span or version % length or previous is None or previous.version != run.base:
                break
            run = merge(previous, run)
            if run.nnz > MAX_DENSITY * self.numel:
                self.levels.pop(j + 1, None)
                break
            due.append(run)
            j += 1
        return due
