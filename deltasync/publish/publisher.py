"""Trainer side: diff, encode, upload in the background, commit by manifest.

:meth:`Publisher.publish` diffs the live weights against the last published
snapshot on the calling thread (it must see consistent weights) and hands the
change set to one background worker, which encodes it, uploads the objects and
then writes the manifest (invariant 3). Training continues meanwhile.

If the worker is still busy when the next ``publish`` comes, that publish is
*coalesced*: nothing is queued, the snapshot still equals the last committed
version, and the next publish's delta simply covers more steps (invariant 2).
So a slow or unreachable store costs the trainer no memory beyond one change
set in flight, and no time beyond the diff (invariant 7). ``flush()`` publishes
the newest weights if the last call was coalesced, and waits.

Anchors (full checkpoints, split in parts so encoding part k+1 overlaps
uploading part k) are written on the first publish, every ``anchor_every``
versions, and whenever the deltas since the last anchor add up to more than
``anchor_ratio`` of an anchor, which bounds what a new replica downloads. An
anchor is committed in its own manifest write right after the delta of the
same version, so existing replicas never wait for it.

The machinery (encoding, uploads, commits, the snapshot, the background worker) is
:mod:`deltasync.publish.engine`, shared with the sharded publisher; this class drives it for one process.

One writer owns a run prefix: the manifest records the writer and a lease.
:class:`~deltasync.protocol.commit.ManifestWriter` takes the prefix, writes the
manifest (compare-and-swap where the backend supports it) and applies
retention; a second publisher on a live prefix gets
:class:`~deltasync.errors.ConflictError`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..codec import DEFAULT_CODEC
from ..errors import ConfigError, ConflictError, FingerprintMismatch
from ..format import DEFAULT_LEVEL, FORMAT_VERSION
from ..protocol.commit import ORPHAN_GRACE_S as ORPHAN_GRACE_S  # re-exported; defined with the commit rules
from ..protocol.commit import sweep_orphans as sweep_orphans  # re-exported; defined with the commit rules
from ..stores import Store
from ..tensors import ChangeSet, TensorSpec, published_dtype, published_tensors
from .diff import Snapshot, diff, diff_stream
from .engine import OPEN_WAIT_S, Background, PublisherStats, PublishInfo, VersionWriter, close_publisher
from .forms import Forms, smallest
from .fp8 import BlockFp8View
from .options import (
    ANCHOR_EVERY,
    ANCHOR_RATIO,
    KEEP_ANCHORS,
    LEASE_S,
    MAX_SPAN,
    PART_BYTES,
    RETIRE_GRACE_S,
    PublishOptions,
)

__all__ = ["Publisher", "PublishInfo", "PublisherStats", "ORPHAN_GRACE_S", "sweep_orphans"]


class PublisherView:
    """The read-only face a publisher shows of its :class:`~deltasync.publish.engine.VersionWriter`
    (:attr:`writer_engine`): its newest version, its id, its retention and lease settings, its stats."""

    writer_engine: VersionWriter

    @property
    def stats(self) -> PublisherStats:
        """Running totals: versions, bytes, coalesced and failed publishes."""
        return self.writer_engine.stats

    @property
    def version(self) -> int | None:
        """The newest committed version, or ``None`` before the first commit."""
        manifest = self.writer_engine.manifest
        return manifest.latest if manifest else None

    @property
    def run_id(self) -> str | None:
        """The run id of the prefix this publisher writes (``None`` before it took the prefix)."""
        manifest = self.writer_engine.manifest
        return manifest.run_id if manifest else None

    @property
    def writer(self) -> str:
        """This publisher's id, recorded in the manifest as the prefix's owner."""
        return self.writer_engine.commits.writer

    @property
    def lease_s(self) -> float:
        """How long each manifest write holds the prefix."""
        return self.writer_engine.commits.lease_s

    @property
    def keep_anchors(self) -> int:
        """Anchors (and the versions after them) kept by retention."""
        return self.writer_engine.commits.keep_anchors

    @property
    def retire_grace_s(self) -> float:
        """How long objects dropped by retention stay in the store."""
        return self.writer_engine.commits.retire_grace_s

    @property
    def snapshot(self) -> Snapshot | None:
        """The weights of the newest committed version as published (read only; ``None`` before the first)."""
        return self.writer_engine.snapshot

    @property
    def store(self) -> Store:
        """The run prefix published to."""
        return self.writer_engine.store

    @property
    def on_publish(self) -> Callable[[PublishInfo], None] | None:
        """Called with each committed version's :class:`PublishInfo`, on the worker thread."""
        return self.writer_engine.on_publish

    @on_publish.setter
    def on_publish(self, callback: Callable[[PublishInfo], None] | None) -> None:
        self.writer_engine.on_publish = callback


class Publisher(PublisherView):
    """Publishes a model's weights into a store as exact sparse versions.

    Args:
        model (`nn.Module`, `Mapping[str, Tensor]` or `None`): the trainer's weights (any device, fp32 or bf16);
            ``None`` when every version arrives as a stream of tensors (``publish(tensors=...)``); a
            :class:`~deltasync.publish.fp8.BlockFp8View` of them for replicas that serve block-fp8 weights.
        store (`str` or `Store`): where to publish, e.g. ``"./run1"`` or ``"s3://bucket/run1"``.
        codec (`str`, *optional*, defaults to ``"compact"``): codec for sparse tensors.
        level (`int`, *optional*): zstd level.
        dtype (`torch.dtype`, *optional*, defaults to bf16): published dtype (``None``: each tensor's own).
        anchor_every (`int`, *optional*): anchor at least every this many versions.
        anchor_ratio (`float`, *optional*): anchor when deltas since the last anchor exceed this fraction of it.
        keep_anchors (`int`, *optional*): anchors (and the versions after them) kept by retention.
        retire_grace_s (`float`, *optional*, defaults to 300): how long objects dropped by retention stay
            in the store, so replicas that read an older manifest finish their downloads.
        takeover (`bool`, *optional*): take the prefix over even if another writer's lease is live.
        chunk (`int`, *optional*): elements the diff compares per step, which bounds its scratch memory
            (``None``: 4 Mi elements for weights on the CPU, 32 Mi for weights on an accelerator).
        format_version (`int`, *optional*, defaults to 4): the file format of deltas; 3 (the plain header)
            keeps a fleet whose replicas are not yet upgraded reading them (docs/FORMAT.md, "Versions").
        max_span (`int`, *optional*, defaults to 64): the longest catch-up span, in versions: at each version
            ``v``, for every power of two ``2**j`` up to it that divides ``v``, one delta from ``v - 2**j`` where
            it is smaller than the route it replaces (:mod:`deltasync.publish.spans`); 0 writes none.
        store_options: passed to :func:`open_store` when ``store`` is a URL.

    Example:
        ```python
        >>> publisher = Publisher(model, "./run1")
        >>> for step in range(steps):
        ...     train_step()
        ...     publisher.publish(step)      # returns at once; uploads in the background
        >>> publisher.close()                # publishes the newest weights and waits
        ```
    """

    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
        store: str | Store,
        *,
        codec: str = DEFAULT_CODEC,
        level: int = DEFAULT_LEVEL,
        dtype: torch.dtype | None = torch.bfloat16,
        anchor_every: int = ANCHOR_EVERY,
        anchor_ratio: float = ANCHOR_RATIO,
        keep_anchors: int = KEEP_ANCHORS,
        part_bytes: int = PART_BYTES,
        lease_s: float = LEASE_S,
        retire_grace_s: float = RETIRE_GRACE_S,
        takeover: bool = False,
        chunk: int | None = None,
        format_version: int = FORMAT_VERSION,
        max_span: int = MAX_SPAN,
        on_publish: Callable[[PublishInfo], None] | None = None,
        **store_options: Any,
    ) -> None:
        options = PublishOptions(
            codec=codec, level=level, dtype=dtype, anchor_every=anchor_every, anchor_ratio=anchor_ratio,
            keep_anchors=keep_anchors, part_bytes=part_bytes, lease_s=lease_s, retire_grace_s=retire_grace_s,
            takeover=takeover, chunk=chunk, format_version=format_version, max_span=max_span,
            on_publish=on_publish,
        )
        if model is not None and not isinstance(model, (torch.nn.Module, Mapping)):
            raise ConfigError(
                f"model must be an nn.Module or a mapping of name -> tensor, not {type(model).__name__}",
                argument="model",
            )
        self.model = model
        self.dtype, self.chunk = dtype, chunk
        # What the model is, read now: the worker opens the prefix later, when the caller's tensors
        # may be sharded again (FSDP1 gathers them only around each publish).
        if isinstance(model, BlockFp8View):
            if dtype not in (None, torch.bfloat16):
                raise ConfigError("a BlockFp8View publishes e4m3 and bf16 tensors: leave dtype at bf16",
                                  argument="dtype")
            specs = model.specs()
        else:
            specs = () if model is None else tuple(
                TensorSpec.of(n, t, published_dtype(model, n, t, dtype)) for n, t in published_tensors(model)
            )
        self.writer_engine = VersionWriter.create(store, specs, options, **store_options)
        self.background = Background(self.writer_engine.stats)
        self._opened = threading.Event()  # set by the worker once the first open has finished

    # ------------------------------------------------------------------ public API

    def publish(
        self, step: int | None = None, *, block: bool = False,
        tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> bool:
        """Publish the current weights as the next version.

        Diffs on the calling thread and returns; encoding and upload run in the
        background. If the previous publish is still uploading, this one is
        coalesced into the next (returns ``False``) unless ``block=True``, which
        waits for it first.

        Args:
            step (`int`, *optional*): the trainer's step, recorded with the version.
            block (`bool`, *optional*): wait for the previous upload instead of coalescing.
            tensors (`Iterable[tuple[str, Tensor]]`, *optional*): this version's weights as a stream of
                ``(name, tensor)`` pairs (a trainer that gathers one tensor at a time), instead of the model's:
                each is diffed as it arrives and let go, so memory stays the published snapshot plus the tensor in
                hand. A stream is always consumed whole, and waits for the previous upload (it cannot be coalesced:
                it would not be there to publish later).

        Returns:
            `bool`: whether a version was started.

        Upload failures do not raise here (the trainer keeps training; the next
        version covers the changes); they are logged, counted in ``stats`` and
        raised by :meth:`flush` / :meth:`close`.

        Raises:
            `ConflictError`: another writer owns the prefix. `RuntimeError`: closed.
        """
        if self.background.closed:
            raise RuntimeError("publisher is closed; create a new Publisher")
        background, writer = self.background, self.writer_engine
        if background.fatal is not None:
            raise background.fatal
        if tensors is None and self.model is None:
            raise ConfigError("this publisher has no model: pass each version as publish(tensors=...)",
                              argument="tensors")
        if background.busy:
            if not block and tensors is None:
                background.coalesce(step)
                return False
            background.wait()
        started = time.perf_counter()
        if writer.commits.resync:  # the store's state is uncertain: re-read it and re-anchor
            writer.snapshot, writer.commits.resync = None, False
        first = writer.snapshot is None
        if first:
            if tensors is not None:
                snapshot = Snapshot.capture_stream(tensors, dtype=self.dtype)
                writer.specs = snapshot.specs
            if writer.manifest is None:
                self._refuse_early()
            if tensors is None and isinstance(self.model, BlockFp8View):  # a tensor at a time, in its dtypes
                snapshot = Snapshot.capture_stream(self.model.items(), dtype=None)
            elif tensors is None:
                snapshot = Snapshot.capture(self.model, dtype=self.dtype)
            t_diff = time.perf_counter() - started
            background.submit(lambda coalesced: self._first_anchor(snapshot, step, started, t_diff))
            # Ownership and model errors surface here in the common case; a slow store costs at most this.
            self._opened.wait(OPEN_WAIT_S)
            if background.fatal is not None:
                raise background.fatal
            return True
        form, changes = self._diff() if tensors is None else (None, self._diff_stream(tensors))
        t_diff = time.perf_counter() - started
        if changes.nnz == 0:
            background.dirty = False
            return False  # the latest version already holds these weights
        background.submit(lambda coalesced: writer.commit_delta(changes, step, started, t_diff, coalesced, form))
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the upload in flight; publish coalesced weights; raise background errors."""
        self.background.flush(lambda step: self.publish(step, block=True), timeout)

    def close(self) -> None:
        """Flush, then release the worker threads and the store."""
        close_publisher(self.background, self.writer_engine, lambda step: self.publish(step, block=True))

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refuse_early(self) -> None:
        """Refuse another writer's live prefix (or another model's) before copying the model for the first time."""
        try:
            self.writer_engine.check_owner()
        except (ConflictError, FingerprintMismatch) as exc:
            self.background.fatal = exc
            raise

    def _first_anchor(self, snapshot: Snapshot, step: int | None, started: float, t_diff: float) -> None:
        try:
            self.writer_engine.open()  # in the worker: a store that is down at start-up does not hold training
        except (ConflictError, FingerprintMismatch) as exc:
            self.background.fatal = exc  # before the waiting publish() wakes up
            raise
        finally:
            self._opened.set()
        # A source with several forms is captured as its first one (its mapping view).
        form = next(iter(self.model.forms()), None) if isinstance(self.model, Forms) else None
        self.writer_engine.commit_first_anchor(snapshot, step, started, t_diff, form)

    def _diff_stream(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> ChangeSet:
        snapshot = self.writer_engine.snapshot
        assert snapshot is not None
        return diff_stream(snapshot, tensors, chunk=self.chunk)

    def _diff(self) -> tuple[str | None, ChangeSet]:
        """The changes since the last version; of the smallest form when the model has several."""
        snapshot = self.writer_engine.snapshot
        assert snapshot is not None
        if isinstance(self.model, Forms):
            return smallest(snapshot, self.model, chunk=self.chunk, prefer=self.writer_engine.form)
        if isinstance(self.model, BlockFp8View):  # one tensor's fp8 copy at a time, never the model's
            return None, self._diff_stream(self.model.items())
        return None, diff(snapshot, self.model, chunk=self.chunk)
