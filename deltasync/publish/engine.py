"""The machinery every publisher shares: writing one rank's versions, and running that work in the background.

:class:`VersionWriter` turns a change set or a snapshot into uploaded objects and commits them through the
run's :class:`~deltasync.protocol.commit.ManifestWriter`: it encodes deltas, splits anchors in parts that
encode while earlier parts upload, decides when an anchor is due, keeps the snapshot of the last committed
version, and reports each committed version. :class:`Background` runs a publisher's jobs on one worker
thread, coalescing a publish that arrives while the previous one still runs (invariant 2), and keeps the
failures the trainer must see later instead of raising them on the training thread.

:class:`~deltasync.publish.publisher.Publisher` (one process) and
:class:`~deltasync.publish.sharded.ShardedPublisher` (one rank of many) are each a way of driving these
two through their public methods.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConflictError, DeltaSyncError, FingerprintMismatch, StoreError
from ..format import PACKED_VERSION, Window, encode_anchor_parts, encode_delta, header_ref
from ..format.digests import BY_ENTRIES
from ..protocol.commit import ManifestWriter
from ..protocol.keys import anchor_part_key, anchor_prefix, delta_key, span_key, writer_suffix
from ..protocol.manifest import Manifest, ObjectRef, Span, VersionEntry, plan_route
from ..stores import Store, open_store
from ..tensors import ChangeSet, TensorSpec, fingerprint
from .diff import Snapshot
from .options import PublishOptions
from .spans import SPAN_CODEC, Run, SpanLevels

__all__ = [
    "Background", "PublishInfo", "PublisherStats", "Shard", "VersionWriter", "MAX_ERRORS_KEPT", "OPEN_WAIT_S",
    "close_publisher",
]

logger = logging.getLogger("deltasync.publisher")

MAX_ERRORS_KEPT = 20  # recent failure messages kept in stats during an outage
# The first publish waits this long for the prefix to open in the background: a second trainer or another
# model's prefix is refused at once; a store down at start-up costs training at most this (the worker retries).
OPEN_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class PublishInfo:
    """What one committed version cost."""

    version: int
    step: int | None
    kind: str
    """``"delta"``, ``"anchor"`` or ``"span"`` (an anchor or the catch-up spans added to an already committed delta
    are reported separately)."""
    nnz: int
    numel: int
    bytes: int
    t_diff: float
    """Seconds the training thread spent (diff or snapshot capture)."""
    t_encode: float
    t_upload: float
    t_total: float
    """From ``publish()`` to the manifest commit."""
    coalesced: int
    """Publishes skipped since the previous commit (covered by this one)."""
    form: str | None = None
    """The form the version was published in, for sources with several (:mod:`deltasync.publish.forms`)."""
    model_bytes: int = 0
    """The whole model in its published dtypes (an fp8 view's elements count one byte); 0: not known."""

    @property
    def sparsity(self) -> float:
        return 1.0 - self.nnz / self.numel if self.numel else 1.0

    @property
    def dense_bytes(self) -> int:
        """What the version would cost sent whole: the model's bytes (two a parameter where not known)."""
        return self.model_bytes or 2 * self.numel


@dataclass(slots=True)
class PublisherStats:
    """Running totals, for logs and status."""

    published: int = 0
    coalesced: int = 0
    failed: int = 0
    bytes: int = 0
    last: PublishInfo | None = None
    errors: list[str] = field(default_factory=list)
    failing: bool = False
    """Whether the newest publish failed (no version committed since): what a status display shows."""


@dataclass(frozen=True, slots=True)
class Shard:
    """What one rank of a sharded trainer publishes of the full model."""

    rank: int
    specs: tuple[TensorSpec, ...]
    """Every tensor of the full model: what the fingerprint and the file headers describe."""
    rows: dict[str, Window]
    """Tensors this rank carries, with the dim-0 rows (or flat elements) of the full tensor it holds."""


class VersionWriter:
    """Encodes, uploads and commits the versions of one rank's tensors, and keeps their snapshot.

    Args:
        store (`Store`): the run prefix.
        commits (`ManifestWriter`): the prefix's owner and manifest writer (only rank 0 of a sharded run commits).
        specs (`tuple[TensorSpec, ...]`): every tensor of the model, as published.
        shard (`Shard`, *optional*): this rank's part of a sharded model (``None``: the whole model).
        codec, level, format_version, part_bytes, anchor_every, anchor_ratio, max_span, on_publish: as for
            :class:`~deltasync.publish.publisher.Publisher` (a sharded writer publishes no spans).
    """

    def __init__(
        self,
        store: Store,
        commits: ManifestWriter,
        specs: tuple[TensorSpec, ...],
        *,
        codec: str,
        level: int,
        format_version: int,
        part_bytes: int,
        anchor_every: int,
        anchor_ratio: float,
        max_span: int = 0,
        on_publish: Callable[[PublishInfo], None] | None = None,
        shard: Shard | None = None,
    ) -> None:
        self.store, self.commits, self.specs, self.shard = store, commits, specs, shard
        self.codec, self.level, self.format_version, self.part_bytes = codec, level, format_version, part_bytes
        self.anchor_every, self.anchor_ratio = anchor_every, anchor_ratio
        self.on_publish = on_publish
        self.stats = PublisherStats()
        self.snapshot: Snapshot | None = None
        """The weights of the last committed version (``None`` before the first, or after a resync)."""
        self.anchor_version = 0
        """The version of the newest anchor this writer committed."""
        self.since_anchor = 0
        """Bytes of deltas committed since that anchor."""
        self.form: str | None = None
        """The form of the newest committed version (sources with several forms)."""
        self.spans = SpanLevels(0 if shard is not None else max_span, sum(s.numel for s in specs))
        """The runs the next catch-up spans are merged from."""
        self.uploads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="deltasync-upload")

    @classmethod
    def create(
        cls, store: str | Store, specs: tuple[TensorSpec, ...], options: PublishOptions, *,
        shard: Shard | None = None, **store_options: Any,
    ) -> VersionWriter:
        """Open ``store`` and take a fresh writer id on it: a writer of ``specs`` under ``options``."""
        opened = open_store(store, **store_options)
        commits = ManifestWriter(
            opened, writer=uuid.uuid4().hex, lease_s=options.lease_s, keep_anchors=options.keep_anchors,
            retire_grace_s=options.retire_grace_s, takeover=options.takeover,
        )
        return cls(
            opened, commits, specs, codec=options.codec, level=options.level, format_version=options.format_version,
            part_bytes=options.part_bytes, anchor_every=options.anchor_every, anchor_ratio=options.anchor_ratio,
            max_span=options.max_span, on_publish=options.on_publish, shard=shard,
        )

    @property
    def manifest(self) -> Manifest | None:
        """The newest manifest this writer wrote or read."""
        return self.commits.manifest

    @property
    def rank(self) -> int | None:
        return self.shard.rank if self.shard is not None else None

    @property
    def rows(self) -> dict[str, Window] | None:
        return self.shard.rows if self.shard is not None else None

    def fingerprint(self) -> str:
        return fingerprint(self.specs)

    def check_owner(self) -> None:
        """Refuse another writer's live prefix (or another model's) before the model is first copied.

        A store that is down or slow at start-up is let through (the worker keeps trying); it costs at
        most :data:`OPEN_WAIT_S`.

        Raises:
            `ConflictError`, `FingerprintMismatch`: the prefix is not this writer's to write.
        """
        check = self.uploads.submit(self.commits.check, fingerprint=self.fingerprint())
        try:
            check.result(timeout=OPEN_WAIT_S)
        except (StoreError, TimeoutError):
            return

    def open(self) -> None:
        """Take ownership of the prefix for this model (see :meth:`ManifestWriter.open`)."""
        self.commits.open(fingerprint=self.fingerprint(), numel=sum(s.numel for s in self.specs))

    def next_version(self) -> int:
        """The number the next version takes."""
        assert self.manifest is not None
        return 0 if self.manifest.latest is None else self.manifest.latest + 1

    def upload(self, key: str, data: bytes | list[Any], *, by_entries: bool = False) -> ObjectRef:
        """Write one object (bytes, or buffers written one after another) and reference it."""
        parts = [data] if isinstance(data, bytes) else data
        self.store.put_parts(key, parts, mode="create" if self.store.conditional_writes else "overwrite")
        head = header_ref(parts[0])
        if by_entries:  # an anchor, by its header (``blake3-entries``), which lists every tensor's digest
            return ObjectRef(key, sum(memoryview(b).nbytes for b in parts), head[1], self.rank, head, BY_ENTRIES)
        return ObjectRef.of(key, parts, self.rank, head)

    def upload_delta(self, changes: ChangeSet, version: int) -> tuple[ObjectRef, float]:
        """Encode and upload a version's delta; returns its reference and the seconds spent encoding."""
        t0 = time.perf_counter()
        data = encode_delta(
            changes, version=version, base_version=version - 1, codec=self.codec, level=self.level,
            model=self.specs if self.shard is not None else None, rows=self.rows,
            packed=self.format_version >= PACKED_VERSION,
        )
        t_encode = time.perf_counter() - t0
        key = delta_key(version, rank=self.rank, suffix=writer_suffix(self.commits.writer))
        return self.upload(key, data), t_encode

    def upload_anchor(self, snapshot: Snapshot, version: int) -> tuple[tuple[ObjectRef, ...], float]:
        """Upload ``snapshot`` as the anchor of ``version``, in parts that encode while earlier parts upload.

        Returns:
            The parts' references (none when this rank holds nothing) and the longest part's encoding seconds.
        """
        prefix = anchor_prefix(version, rank=self.rank, suffix=writer_suffix(self.commits.writer))
        groups: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in snapshot.items():
            nbytes = tensor.numel() * tensor.element_size()
            if groups[-1] and size + nbytes > self.part_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = tensor
            size += nbytes
        model = self.specs if self.shard is not None else snapshot.specs
        encode_s = [0.0] * len(groups)

        def encode_and_upload(i: int, group: dict[str, torch.Tensor]) -> ObjectRef:
            # Parts encode (tensor digests, a header; no copy) and upload side by side, viewing the snapshot.
            t0 = time.perf_counter()
            parts = encode_anchor_parts(group, version=version, model=model, rows=self.rows)
            encode_s[i] = time.perf_counter() - t0
            return self.upload(anchor_part_key(prefix, i), parts, by_entries=True)

        futures = [  # a rank that holds nothing uploads nothing
            self.uploads.submit(encode_and_upload, i, group) for i, group in enumerate(g for g in groups if g)
        ]
        refs, failure = [], None
        for future in futures:
            try:
                refs.append(future.result())
            except Exception as exc:  # wait for every part, then remove the ones that made it
                failure = failure or exc
        if failure is not None:
            self.commits.discard(refs)
            raise failure
        return tuple(refs), max(encode_s, default=0.0)

    def anchored(self, version: int) -> None:
        """Record that ``version`` now has an anchor: the next anchor is due counting from it."""
        self.anchor_version, self.since_anchor = version, 0

    def anchor_due(self, version: int) -> bool:
        """Whether ``version`` (a committed delta) should get an anchor: every ``anchor_every`` versions,
        or once the deltas since the last anchor add up to more than ``anchor_ratio`` of it."""
        assert self.manifest is not None
        last = self.manifest.entry(self.anchor_version)
        anchor_bytes = last.anchor_bytes if last is not None and last.anchor else None
        if version - self.anchor_version >= self.anchor_every:
            return True
        return anchor_bytes is not None and self.since_anchor > self.anchor_ratio * anchor_bytes

    def commit_first_anchor(
        self, snapshot: Snapshot, step: int | None, started: float, t_diff: float, form: str | None = None
    ) -> None:
        """Commit ``snapshot`` as an anchor, the first version of this writer (after :meth:`open`)."""
        version = self.next_version()
        t0 = time.perf_counter()
        refs, t_encode = self.upload_anchor(snapshot, version)
        numel = sum(s.numel for s in snapshot.specs)
        self.commits.commit_version(VersionEntry(version, step=step, time=time.time(), nnz=numel, anchor=refs), refs)
        self.snapshot = snapshot
        self.spans = SpanLevels(self.spans.max_span, numel)  # a new chain (and, from a stream, maybe new specs)
        self.anchored(version)
        self.form = form
        t_upload = time.perf_counter() - t0 - t_encode
        self.report(version, step, "anchor", numel, refs, t_diff, t_encode, t_upload, started, form)

    def commit_delta(
        self, changes: ChangeSet, step: int | None, started: float, t_diff: float, coalesced: int,
        form: str | None = None, restores: int | None = None,
    ) -> None:
        """Commit ``changes`` as the next version (a rollback's, with ``restores``), then an anchor of it when
        one is due."""
        assert self.manifest is not None and self.snapshot is not None
        version = self.next_version()
        t0 = time.perf_counter()
        ref, t_encode = self.upload_delta(changes, version)
        entry = VersionEntry(version, step=step, time=time.time(), nnz=changes.nnz, delta=(ref,), restores=restores)
        self.commits.commit_version(entry, (ref,))
        t_upload = time.perf_counter() - t0 - t_encode
        due = self.spans.record(changes, version)  # before the snapshot moves past the changes' old values
        self.snapshot.advance(changes)
        self.since_anchor += ref.size
        self.form = form
        self.report(version, step, "delta", changes.nnz, (ref,), t_diff, t_encode, t_upload, started, form, coalesced)
        if self.anchor_due(version):
            self.commit_anchor(version, step)
        if due:
            self.commit_spans(version, step, due)

    def commit_spans(self, version: int, step: int | None, runs: list[Run]) -> None:
        """Publish the catch-up spans of ``runs`` (all ending at the committed ``version``, shortest first) that
        pay: each smaller than the cheapest route already listed from its base and than the newest anchor.

        A span that fails is left out, with a warning: the version is committed, and the chain serves.
        """
        assert self.manifest is not None
        t0 = time.perf_counter()
        spans: list[Span] = []
        t_encode, nnz = 0.0, 0
        try:
            for run in runs:
                listed = self._with_spans(version, spans)
                if listed.entry(run.base) is None:  # retired meanwhile: a span from it could not be listed
                    continue
                t1 = time.perf_counter()
                data = encode_delta(
                    run.change_set(self.specs), version=version, base_version=run.base, codec=SPAN_CODEC,
                    level=self.level, packed=self.format_version >= PACKED_VERSION,
                )
                t_encode += time.perf_counter() - t1
                route = plan_route(listed, run.base, target=version)
                anchors = listed.anchors()
                costs = ([route.nbytes] if route is not None else []) + ([anchors[-1].anchor_bytes] if anchors else [])
                if costs and len(data) >= min(costs):
                    logger.debug("span v%d->v%d not published: %d bytes, the listed route or anchor costs %d",
                                 run.base, version, len(data), min(costs))
                    continue
                key = span_key(version, run.base, suffix=writer_suffix(self.commits.writer))
                spans.append(Span(run.base, (self.upload(key, data),)))
                nnz += run.nnz
            if spans:
                self.commits.attach_spans(version, tuple(spans))
        except (ConflictError, FingerprintMismatch):
            raise
        except Exception as exc:  # the version stands; replicas take the chain
            self.commits.discard([o for span in spans for o in span.objects])
            logger.warning("catch-up spans to v%d not published: %s", version, exc)
            return
        if spans:
            refs = tuple(o for span in spans for o in span.objects)
            t_upload = time.perf_counter() - t0 - t_encode
            self.report(version, step, "span", nnz, refs, 0.0, t_encode, t_upload, t0, self.form)

    def _with_spans(self, version: int, spans: list[Span]) -> Manifest:
        """The manifest as it would read with ``spans`` added to ``version``."""
        assert self.manifest is not None
        if not spans:
            return self.manifest
        return self.manifest.amended(version, lambda entry: entry.with_spans(tuple(spans)))

    def commit_anchor(self, version: int, step: int | None) -> None:
        """Add an anchor of the snapshot to the committed ``version``, in a manifest write of its own."""
        assert self.manifest is not None and self.snapshot is not None
        t0 = time.perf_counter()
        refs, t_encode = self.upload_anchor(self.snapshot, version)
        self.commits.attach_anchor(version, refs)
        self.anchored(version)
        numel = sum(s.numel for s in self.snapshot.specs)
        t_upload = time.perf_counter() - t0 - t_encode
        self.report(version, step, "anchor", numel, refs, 0.0, t_encode, t_upload, t0, self.form)

    def report(
        self, version: int, step: int | None, kind: str, nnz: int, refs: tuple[ObjectRef, ...],
        t_diff: float, t_encode: float, t_upload: float, started: float, form: str | None = None,
        coalesced: int = 0,
    ) -> None:
        """Count a committed version, log it, and hand it to ``on_publish``."""
        numel = self.manifest.numel if self.manifest else 0
        info = PublishInfo(
            version, step, kind, nnz, numel, sum(r.size for r in refs), t_diff, t_encode, t_upload,
            time.perf_counter() - started, coalesced if kind == "delta" else 0, form,
            sum(s.numel * s.torch_dtype.itemsize for s in self.specs),
        )
        self.stats.published += 1
        self.stats.failing = False
        self.stats.bytes += info.bytes
        self.stats.last = info
        logger.info(
            "published v%d (%s%s, step %s): %d changed (sparsity %.3f %%), %s bytes, diff %.0f ms, total %.0f ms",
            version, kind, f", {form} form" if form else "", step, nnz, 100 * info.sparsity, f"{info.bytes:,}",
            1e3 * t_diff, 1e3 * info.t_total,
        )
        if self.on_publish is not None:
            try:
                self.on_publish(info)
            except Exception:  # the version is committed; a user's callback cannot undo that
                logger.exception("on_publish callback failed for v%d", version)

    def close(self) -> None:
        """Stop the upload threads (after the uploads in flight) and close the store."""
        self.uploads.shutdown(wait=True)
        self.store.close()


class Background:
    """A publisher's one worker thread: jobs run there in order, a publish made while one runs is coalesced.

    Failures never raise on the training thread: a prefix that is not ours (:class:`ConflictError`,
    :class:`FingerprintMismatch`) becomes :attr:`fatal` and refuses every later publish; any other error is
    counted in ``stats``, logged, and raised by the next :meth:`raise_errors` (``flush`` / ``close``).
    """

    def __init__(self, stats: PublisherStats) -> None:
        self.stats = stats
        self.fatal: DeltaSyncError | None = None
        """The error that ended this publisher (another writer owns the prefix, or another model's run)."""
        self.dirty = False
        """Whether the newest publish was coalesced and nothing has covered it yet."""
        self.pending_step: int | None = None
        """The step of that coalesced publish."""
        self.closed = False
        """Whether the publisher is closed (its worker stopped)."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-publish")
        self._inflight: Future[None] | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        """Whether a job is still running."""
        return self._inflight is not None and not self._inflight.done()

    def coalesce(self, step: int | None) -> None:
        """Skip a publish: the next version covers its changes."""
        self.stats.coalesced += 1
        self.dirty, self.pending_step = True, step

    def submit(self, job: Callable[[int], None]) -> None:
        """Run ``job(coalesced)`` on the worker; ``coalesced`` counts the publishes it covers."""
        coalesced, self.stats.coalesced = self.stats.coalesced, 0
        self.dirty, self.pending_step = False, None
        self._inflight = self._pool.submit(self._guard, job, coalesced)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the job in flight, if any."""
        if self._inflight is not None:
            self._inflight.result(timeout=timeout)

    def flush(self, publish: Callable[[int | None], Any], timeout: float | None = None) -> None:
        """Wait for the job in flight; ``publish(step)`` a coalesced version and wait for it; raise failures."""
        self.wait(timeout)
        if self.dirty and self.fatal is None:
            publish(self.pending_step)
            self.wait(timeout)
        self.raise_errors()

    def raise_errors(self) -> None:
        """Raise :attr:`fatal`, else the newest failure of a job not raised yet."""
        if self.fatal is not None:
            raise self.fatal
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the worker, after the job in flight."""
        self.closed = True
        self._pool.shutdown(wait=True)

    def _guard(self, job: Callable[[int], None], coalesced: int) -> None:
        try:
            job(coalesced)
        except (ConflictError, FingerprintMismatch) as exc:  # this prefix is not ours to write
            self.fatal = exc
            self.stats.failed += 1
            self.stats.failing = True
            logger.error("%s", exc)
        except Exception as exc:  # the trainer keeps training; flush() re-raises
            self.stats.failed += 1
            self.stats.failing = True
            self.stats.errors = [*self.stats.errors[-(MAX_ERRORS_KEPT - 1):], f"{type(exc).__name__}: {exc}"]
            logger.warning("publish failed, the next publish will cover these changes: %s", exc)
            self._error = exc


def close_publisher(background: Background, writer: VersionWriter, publish: Callable[[int | None], Any]) -> None:
    """A publisher's close: flush (``publish(step)`` a coalesced version), release the prefix when it is still
    ours, and on every path stop the worker and upload threads and close the store. Closing twice is a no-op."""
    if background.closed:
        return
    try:
        background.flush(publish)
        if background.fatal is None:  # let the next trainer on this prefix start without takeover=True
            writer.commits.release()
    finally:
        background.close()
        writer.close()
