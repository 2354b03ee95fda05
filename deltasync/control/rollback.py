"""Rollback of live weights: publish a new version whose weights equal an earlier version's, bit for bit.

History is never rewritten and version numbers only grow. A rollback of a run at version ``N`` to version
``r`` publishes ``N + 1``: an ordinary delta from ``N`` carrying, for every element that differs between the
two, its value at ``r``; its manifest entry says ``restores: r``, which marks ``r + 1`` to ``N`` retracted
(docs/PROTOCOL.md, "Rollback"). Every replica reaches ``N + 1`` by the routes it already takes (the delta
from ``N``, a span, an anchor and the chain), so live and late replicas alike land on ``r``'s weights.

The weights of ``r`` and of ``N`` are folded forward from anchors in the store, through a replica's own
verified route (:class:`~deltasync.replica.subscriber.Subscriber`), so a rollback trusts nothing the store
holds without checking it. The version is written by the prefix's owner:

- a live :class:`~deltasync.publish.publisher.Publisher` (the trainer): its snapshot is ``N`` already, and
  the new version takes its place in the trainer's sequence; the trainer then loads ``r``'s weights (the
  returned :attr:`Rollback.weights`, or its own checkpoint of that step) before it publishes again;
- otherwise a writer of its own on the store (``deltasync rollback URL --to r``), which refuses a prefix
  whose trainer's lease is live unless told to take it over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..appliers import TorchModuleApplier
from ..appliers.checkpoint.applier import anchor_layout
from ..errors import VersionError
from ..protocol.keys import MANIFEST_KEY
from ..protocol.manifest import MAX_MANIFEST_BYTES, Manifest
from ..publish.diff import Snapshot, diff
from ..publish.engine import PublishInfo, VersionWriter
from ..publish.options import PublishOptions
from ..publish.publisher import Publisher
from ..replica.pins import check_version
from ..replica.subscriber import Subscriber
from ..stores import Store, open_store
from ..stores.wrap import DelegatingStore
from ..tensors import TensorSpec

__all__ = ["Rollback", "rollback", "weights_at"]

logger = logging.getLogger("deltasync.publisher")


@dataclass(frozen=True, slots=True)
class Rollback:
    """What a rollback published."""

    version: int
    """The new version, whose weights equal :attr:`restores`'s."""
    restores: int
    retracted: tuple[int, int]
    """The first and last version it takes back."""
    info: PublishInfo | None
    """The new version's cost, as ``on_publish`` reports it (``None`` where it was not reported)."""
    weights: dict[str, torch.Tensor]
    """The weights of :attr:`restores` (published dtype): what a trainer that rolls back resumes from."""


class _Lent(DelegatingStore):
    """A store lent to a subscriber: closing the subscriber leaves it open for its owner."""

    def close(self) -> None:
        pass


def weights_at(store: Store, version: int, specs: list[TensorSpec] | None = None) -> dict[str, torch.Tensor]:
    """The published weights of ``version``, folded forward from an anchor at or before it and verified as any
    replica's are.

    Raises:
        `VersionError`: ``version`` is not listed (the message names the versions a fold can reach).
    """
    manifest = Manifest.from_bytes(store.get(MANIFEST_KEY, max_bytes=MAX_MANIFEST_BYTES))
    _check_reachable(manifest, version, store.url)
    specs = specs if specs is not None else anchor_layout(store, manifest)
    held = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in specs}
    with Subscriber(_Lent(store), TorchModuleApplier(held, dtype=None), ack=False, undo_bytes=0) as sub:
        sub.update(version=version)
    return held


def _check_reachable(manifest: Manifest, version: int, url: str) -> None:
    if manifest.latest is None or not manifest.versions:
        raise VersionError(f"nothing is published at {url}: there is no version to roll back to", latest=None)
    oldest = manifest.versions[0].version
    if manifest.entry(version) is None:
        raise VersionError(
            f"version {version} is not listed at {url}: a rollback can reach v{oldest} (the oldest version "
            f"retention keeps) to v{manifest.latest}", current=manifest.latest, latest=manifest.latest,
        )


def rollback(
    target: Publisher | str | Store, to: int, *, step: int | None = None, takeover: bool = False,
    **options: Any,
) -> Rollback:
    """Publish a version whose weights equal version ``to``'s, bit for bit, retracting the versions after it.

    Args:
        target (`Publisher`, `str` or `Store`): the trainer's live publisher (it writes the version and its
            snapshot moves to ``to``), or the run prefix (a writer of its own writes it).
        to (`int`): the version to restore; listed, and below the newest.
        step (`int`, *optional*): the trainer step recorded with the new version.
        takeover (`bool`, *optional*): with a prefix, write even while another writer's lease is live.
        **options: with a prefix, the publisher's options (``codec``...) and the store's.

    Raises:
        `VersionError`: ``to`` is not listed, or is the newest version. `ConflictError`: the trainer's lease is
            live (roll back through its publisher, or stop it and pass ``takeover=True``).
    """
    check_version("to", to, optional=False)
    if isinstance(target, Publisher):  # the trainer's own writer: between two of its publishes
        target.flush()
        return _commit(target.writer_engine, to, step, lambda: None)
    store = open_store(target, **{k: v for k, v in options.items() if k not in PublishOptions.__dataclass_fields__})
    publish_options = {k: v for k, v in options.items() if k in PublishOptions.__dataclass_fields__}
    manifest = Manifest.from_bytes(store.get(MANIFEST_KEY, max_bytes=MAX_MANIFEST_BYTES))
    _check_reachable(manifest, to, store.url)
    specs = anchor_layout(store, manifest)
    lent = _Lent(store) if isinstance(target, Store) else store  # a caller's store stays open for the caller
    writer = VersionWriter.create(lent, tuple(specs), PublishOptions(takeover=takeover, **publish_options))
    try:
        writer.open()  # the lease: refuses a live trainer's prefix unless told to take it over
        latest = writer.manifest.latest if writer.manifest is not None else None
        assert latest is not None
        writer.snapshot = Snapshot.capture(weights_at(store, latest, specs), dtype=None)
        return _commit(writer, to, step, writer.commits.release)
    finally:
        writer.close()


def _commit(writer: VersionWriter, to: int, step: int | None, done: Any) -> Rollback:
    """Diff ``writer``'s snapshot (the newest version) against ``to``'s weights and commit it as a rollback."""
    manifest = writer.manifest
    assert manifest is not None and writer.snapshot is not None
    latest = manifest.latest
    assert latest is not None
    if to == latest:
        raise VersionError(f"v{to} is the newest version at {writer.store.url}: nothing to roll back",
                           current=latest, latest=latest)
    started = time.perf_counter()
    weights = weights_at(writer.store, to, list(writer.specs))
    snapshot = writer.snapshot
    changes = diff(snapshot, {n: t.to(snapshot[n].device) for n, t in weights.items()})  # where the snapshot lives
    t_diff = time.perf_counter() - started
    reports: list[PublishInfo] = []
    on_publish = writer.on_publish

    def report(info: PublishInfo) -> None:
        reports.append(info)
        if on_publish is not None:
            on_publish(info)

    writer.on_publish = report
    try:
        writer.commit_delta(changes, step, started, t_diff, 0, writer.form, restores=to)
    finally:
        writer.on_publish = on_publish
    done()
    version = latest + 1
    logger.info("v%d restores v%d (v%d to v%d retracted): %d elements", version, to, to + 1, latest, changes.nnz)
    info = next((i for i in reports if i.version == version and i.kind == "delta"), None)
    return Rollback(version, to, (to + 1, latest), info, weights)
