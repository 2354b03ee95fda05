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

One writer owns a run prefix: the manifest records the writer and a lease.
Manifest writes are compare-and-swap where the backend supports it; elsewhere
(HF buckets) the writer re-reads the manifest before writing. A second
publisher on a live prefix gets :class:`~deltasync.errors.ConflictError`.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .codec import DEFAULT_CODEC, codec_names
from .diff import DEFAULT_CHUNK, ChangeSet, Snapshot, diff
from .errors import (
    ConfigError,
    ConflictError,
    DeltaSyncError,
    FingerprintMismatch,
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
)
from .format import DEFAULT_LEVEL, encode_anchor, encode_delta
from .manifest import (
    MANIFEST_KEY,
    RETIRE_GRACE_S,
    Manifest,
    ObjectRef,
    VersionEntry,
    deletable,
    new_manifest,
    plan_retention,
    referenced_keys,
    replace_manifest,
)
from .stores import ObjectInfo, Store, open_store
from .tensors import TensorSpec, dtype_name, fingerprint, published_tensors

__all__ = ["Publisher", "PublishInfo", "PublisherStats"]

logger = logging.getLogger("deltasync.publisher")

ANCHOR_EVERY = 100  # versions; the public TRL prototype anchors every 10 syncs, adaptive anchors cover drift
ANCHOR_RATIO = 1.0  # deltas since the last anchor may add up to one anchor: catch-up <= 2 anchors of bytes
KEEP_ANCHORS = 2  # the newest anchor and the one before, so a replica mid-catch-up is never stranded
PART_BYTES = 256 << 20  # anchor part size: large enough for throughput, small enough to pipeline
LEASE_S = 600.0  # a writer that stops publishing for this long can be taken over
MAX_ERRORS_KEPT = 20  # recent failure messages kept in stats during an outage
# The first publish waits this long for the prefix to be opened in the background, so a
# second trainer or another model's prefix is refused at once, while a store that is down
# at start-up costs training at most this much (the worker keeps trying).
OPEN_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class PublishInfo:
    """What one committed version cost."""

    version: int
    step: int | None
    kind: str
    """``"delta"`` or ``"anchor"`` (an anchor added to an already committed delta is reported separately)."""
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

    @property
    def sparsity(self) -> float:
        return 1.0 - self.nnz / self.numel if self.numel else 1.0

    @property
    def dense_bytes(self) -> int:
        return 2 * self.numel


@dataclass(slots=True)
class PublisherStats:
    """Running totals, for logs and status."""

    published: int = 0
    coalesced: int = 0
    failed: int = 0
    bytes: int = 0
    last: PublishInfo | None = None
    errors: list[str] = field(default_factory=list)


class Publisher:
    """Publishes a model's weights into a store as exact sparse versions.

    Args:
        model (`nn.Module` or `Mapping[str, Tensor]`): the trainer's weights (any device, fp32 or bf16).
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
        model: torch.nn.Module | Mapping[str, torch.Tensor],
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
        chunk: int = DEFAULT_CHUNK,
        on_publish: Callable[[PublishInfo], None] | None = None,
        **store_options: Any,
    ) -> None:
        _check_options(
            codec=codec, level=level, dtype=dtype, anchor_every=anchor_every, anchor_ratio=anchor_ratio,
            keep_anchors=keep_anchors, part_bytes=part_bytes, lease_s=lease_s, retire_grace_s=retire_grace_s,
            chunk=chunk, on_publish=on_publish,
        )
        if not isinstance(model, (torch.nn.Module, Mapping)):
            raise ConfigError(
                f"model must be an nn.Module or a mapping of name -> tensor, not {type(model).__name__}",
                argument="model",
            )
        self.model = model
        self.store = open_store(store, **store_options)
        self.codec, self.level, self.dtype, self.chunk = codec, level, dtype, chunk
        self.anchor_every, self.anchor_ratio, self.keep_anchors = anchor_every, anchor_ratio, keep_anchors
        self.part_bytes, self.lease_s, self.retire_grace_s = part_bytes, lease_s, retire_grace_s
        self.on_publish = on_publish
        self.writer = uuid.uuid4().hex
        self.stats = PublisherStats()
        self._snapshot: Snapshot | None = None
        self._manifest: Manifest | None = None
        self._etag: str | None = None
        self._takeover = takeover
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-publish")
        self._uploads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="deltasync-upload")
        self._inflight: Any = None
        self._pending_step: int | None = None
        self._dirty = False
        self._fatal: DeltaSyncError | None = None
        self._last_error: BaseException | None = None
        self._resync = False
        self._coalesced_now = 0
        self._anchor_version = 0
        self._since_anchor = 0
        self._closed = False
        self._opened = threading.Event()  # set by the worker once the first open has finished
        # What the model is, read now: the worker opens the prefix later, when the caller's tensors
        # may be sharded again (FSDP1 gathers them only around each publish).
        self._model_specs = tuple(TensorSpec.of(n, t, dtype) for n, t in published_tensors(model))
        # Set by ShardedPublisher: this rank's slice of a larger model.
        self._specs: tuple[TensorSpec, ...] | None = None  # the full model, when sharded
        self._rows: dict[str, tuple[int, int]] | None = None  # dim-0 rows this rank carries
        self._rank: int | None = None

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int | None:
        """The newest committed version, or ``None`` before the first commit."""
        return self._manifest.latest if self._manifest else None

    def publish(self, step: int | None = None, *, block: bool = False) -> bool:
        """Publish the current weights as the next version.

        Diffs on the calling thread and returns; encoding and upload run in the
        background. If the previous publish is still uploading, this one is
        coalesced into the next (returns ``False``) unless ``block=True``, which
        waits for it first.

        Returns:
            `bool`: whether a version was started.

        Upload failures do not raise here (the trainer keeps training; the next
        version covers the changes); they are logged, counted in ``stats`` and
        raised by :meth:`flush` / :meth:`close`.

        Raises:
            `ConflictError`: another writer owns the prefix. `RuntimeError`: closed.
        """
        if self._closed:
            raise RuntimeError("publisher is closed; create a new Publisher")
        if self._fatal is not None:
            raise self._fatal
        if self._inflight is not None and not self._inflight.done():
            if not block:
                self.stats.coalesced += 1
                self._dirty, self._pending_step = True, step
                return False
            self._inflight.result()
        started = time.perf_counter()
        if self._resync:  # the store's state is uncertain: re-read it and re-anchor
            self._snapshot, self._resync = None, False
        first = self._snapshot is None
        if first:
            snapshot = Snapshot.capture(self.model, dtype=self.dtype)
            t_diff = time.perf_counter() - started
            job = lambda: self._commit_first_anchor(snapshot, step, started, t_diff)  # noqa: E731
        else:
            changes = diff(self._snapshot, self.model, chunk=self.chunk)
            t_diff = time.perf_counter() - started
            if changes.nnz == 0:
                self._dirty = False
                return False  # the latest version already holds these weights
            job = lambda: self._commit_delta(changes, step, started, t_diff)  # noqa: E731
        coalesced, self.stats.coalesced = self.stats.coalesced, 0
        self._dirty, self._pending_step = False, None
        self._inflight = self._pool.submit(self._guard, job, coalesced)
        if first:
            # Ownership and model errors surface here in the common case; a slow store costs at most this.
            self._opened.wait(OPEN_WAIT_S)
            if self._fatal is not None:
                raise self._fatal
        return True

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the upload in flight; publish coalesced weights; raise background errors."""
        if self._inflight is not None:
            self._inflight.result(timeout=timeout)
        if self._dirty and self._fatal is None:
            self.publish(self._pending_step, block=True)
            self._inflight.result(timeout=timeout)
        if self._fatal is not None:
            raise self._fatal
        self._raise_worker_error()

    def close(self) -> None:
        """Flush, then release the worker threads and the store."""
        if self._closed:
            return
        try:
            self.flush()
            self._release_lease()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._uploads.shutdown(wait=True)
            self.store.close()

    def _release_lease(self) -> None:
        """Let the next trainer on this prefix start without ``takeover=True``."""
        if self._manifest is None or self._manifest.latest is None or self._fatal is not None:
            return
        try:
            self._write_manifest(self._manifest, lease_s=0.0)
        except DeltaSyncError as exc:
            logger.warning("could not release the lease on %s: %s", self.store.url, exc)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ ownership

    def _open(self) -> None:
        """Read the prefix's manifest and take ownership, or refuse."""
        live = self._specs or self._model_specs
        fp, numel = fingerprint(live), sum(s.numel for s in live)
        try:
            got = self.store.get_if_changed(MANIFEST_KEY, None)
        except ObjectNotFound:
            got = None
        now = time.time()
        if got is None:
            self._manifest = new_manifest(run_id=uuid.uuid4().hex, fingerprint=fp, numel=numel, writer=self.writer, lease_s=self.lease_s)
            self._etag = None
            return
        data, info = got
        current = Manifest.from_bytes(data)
        if current.fingerprint != fp:
            raise FingerprintMismatch(
                f"{self.store.url} holds versions of another model ({current.fingerprint}); "
                "publish to a new prefix",
                expected=fp,
                found=current.fingerprint,
            )
        # Fails closed: a lease is free only once it has provably ended.
        leased = not current.lease_until <= now
        if current.writer != self.writer and leased and not self._takeover:
            left = current.lease_until - now
            raise ConflictError(
                f"{self.store.url} is owned by writer {current.writer[:8]}, whose lease runs {left:.0f} s more "
                f"(until {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(current.lease_until))}): another "
                "trainer is publishing here. Use another prefix, wait for the lease to end, or pass "
                "takeover=True if that trainer is gone",
                writer=current.writer,
                lease_left_s=left,
            )
        # Continue the version chain with a fresh anchor: our weights are not the old snapshot.
        self._manifest = replace_manifest(current, writer=self.writer)
        self._etag = info.etag
        removed = sweep_orphans(self.store, current, now=now)
        if removed:
            logger.info("removed %d orphaned objects of an interrupted publish", len(removed))

    def _write_manifest(self, manifest: Manifest, *, lease_s: float | None = None) -> None:
        now = time.time()
        retained = plan_retention(manifest, keep_anchors=self.keep_anchors, now=now)
        due, retained = deletable(retained, now=now, grace=self.retire_grace_s)
        lease = self.lease_s if lease_s is None else lease_s
        retained = replace_manifest(retained, updated=now, lease_until=now + lease)
        for _ in range(3):
            try:
                info = self._put_manifest(retained)
                break
            except PreconditionFailed:
                # Someone else wrote the manifest: a rival writer (stop), or an operator's gc
                # that removed retired keys (merge and retry).
                retained = self._merge_foreign_edit(retained)
            except StoreError:
                # The write may have landed even though the call failed (a lost acknowledgement):
                # replicas could already hold it, so find out before anything else is written.
                landed = self._landed(retained)
                if landed is None:
                    raise
                info = landed
                break
        else:
            raise ConflictError(f"{self.store.url}/{MANIFEST_KEY} keeps changing under this publisher")
        self._manifest, self._etag = retained, info.etag
        for key in due:
            try:
                self.store.delete(key)
            except DeltaSyncError as exc:  # committed regardless; gc or the next takeover sweeps it
                logger.warning("could not delete retired %s: %s", key, exc)

    def _put_manifest(self, manifest: Manifest) -> ObjectInfo:
        data = manifest.to_bytes()
        if self.store.conditional_writes:
            if self._etag is None:
                return self.store.put(MANIFEST_KEY, data, mode="create")
            return self.store.put(MANIFEST_KEY, data, if_match=self._etag)
        self._check_owner_best_effort()
        info = self.store.put(MANIFEST_KEY, data)
        self._check_owner_best_effort(after_write=True)
        return info

    def _landed(self, attempted: Manifest) -> ObjectInfo | None:
        """The stored manifest's info if it is exactly ``attempted``; ``None`` if it is not.

        When even the read-back fails, the store's state is unknown: the next
        publish starts over from the stored manifest with a fresh anchor, which
        makes every replica exact whatever it applied.
        """
        try:
            got = self.store.get_if_changed(MANIFEST_KEY, None)
        except DeltaSyncError:
            self._resync = True
            return None
        if got is not None and got[0] == attempted.to_bytes():
            logger.warning("manifest write reported a failure but landed; treating v%s as committed", attempted.latest)
            return got[1]
        return None

    def _merge_foreign_edit(self, ours: Manifest) -> Manifest:
        try:
            data, info = self.store.get_if_changed(MANIFEST_KEY, None) or (b"", None)
            theirs = Manifest.from_bytes(data)
        except ObjectNotFound:
            theirs = None
        if theirs is None or theirs.writer != self.writer or info is None:
            raise ConflictError(
                f"another writer changed {self.store.url}/{MANIFEST_KEY}: this publisher lost the prefix "
                "(a second trainer, or a takeover); stop one of them",
            )
        if self._manifest is not None and theirs.versions != self._manifest.versions:
            # Our own id wrote versions we do not know about (a write we believed failed):
            # never overwrite them; start over from the stored manifest with an anchor.
            self._resync = True
            raise StoreError(
                f"{self.store.url}/{MANIFEST_KEY} holds versions this publisher did not confirm; "
                "the next publish re-anchors",
                key=MANIFEST_KEY,
            )
        # Only retired keys may differ (gc deleted some): keep ours minus what is already gone.
        gone = {k for k, _ in (self._manifest.retired if self._manifest else ())} - {k for k, _ in theirs.retired}
        self._etag = info.etag
        return replace_manifest(ours, retired=tuple((k, t) for k, t in ours.retired if k not in gone))

    def _check_owner_best_effort(self, *, after_write: bool = False) -> None:
        """Without conditional writes: refuse to write over, or to keep, another writer's manifest.

        Read before the write catches a takeover; read after the write catches
        two writers racing to create the prefix (the later write wins the store,
        the earlier writer sees it and stops).
        """
        try:
            current = Manifest.from_bytes(self.store.get(MANIFEST_KEY))
        except ObjectNotFound:
            return
        if current.writer != self.writer and (after_write or self._etag is not None):
            raise ConflictError(
                f"writer {current.writer[:8]} owns {self.store.url}: another trainer is publishing here; "
                "stop one of them or use another prefix",
                writer=current.writer,
            )

    # ------------------------------------------------------------------ worker

    def _guard(self, job: Callable[[], None], coalesced: int) -> None:
        self._coalesced_now = coalesced
        try:
            job()
        except (ConflictError, FingerprintMismatch) as exc:  # this prefix is not ours to write
            self._fatal = exc
            self.stats.failed += 1
            logger.error("%s", exc)
        except Exception as exc:  # the trainer keeps training; flush() re-raises
            self.stats.failed += 1
            self.stats.errors = [*self.stats.errors[-(MAX_ERRORS_KEPT - 1):], f"{type(exc).__name__}: {exc}"]
            logger.warning("publish failed, the next publish will cover these changes: %s", exc)
            self._last_error = exc

    def _raise_worker_error(self) -> None:
        error = self._last_error
        if error is not None:
            self._last_error = None
            raise error

    def _upload(self, prefix: str, data: bytes) -> ObjectRef:
        key = f"{prefix}.safetensors"
        self.store.put(key, data, mode="create" if self.store.conditional_writes else "overwrite")
        return ObjectRef(key, len(data), hashlib.sha256(data).hexdigest(), self._rank)

    def _key(self, kind: str, version: int) -> str:
        rank = "" if self._rank is None else f"-r{self._rank:05d}"
        return f"{kind}/{version:010d}-{uuid.uuid4().hex[:8]}{rank}"

    def _encode_delta(self, changes: ChangeSet, version: int) -> bytes:
        return encode_delta(
            changes, version=version, base_version=version - 1, codec=self.codec, level=self.level,
            model=self._specs, rows=self._rows,
        )

    def _commit_first_anchor(self, snapshot: Snapshot, step: int | None, started: float, t_diff: float) -> None:
        try:
            self._open()  # in the worker: a store that is down at start-up does not hold training
        except (ConflictError, FingerprintMismatch) as exc:
            self._fatal = exc  # before the waiting publish() wakes up
            raise
        finally:
            self._opened.set()
        assert self._manifest is not None
        version = 0 if self._manifest.latest is None else self._manifest.latest + 1
        t0 = time.perf_counter()
        refs, t_encode = self._upload_anchor(snapshot, version)
        entry = VersionEntry(version, step=step, time=time.time(), nnz=sum(s.numel for s in snapshot.specs), anchor=refs)
        self._commit(self._manifest.with_version(entry, now=time.time(), lease_s=self.lease_s), refs)
        self._snapshot = snapshot
        self._anchor_version, self._since_anchor = version, 0
        self._report(version, step, "anchor", entry.nnz, refs, t_diff, t_encode, time.perf_counter() - t0 - t_encode, started)

    def _commit_delta(self, changes: ChangeSet, step: int | None, started: float, t_diff: float) -> None:
        assert self._manifest is not None and self._snapshot is not None
        version = self._manifest.latest + 1  # type: ignore[operator]
        t0 = time.perf_counter()
        data = self._encode_delta(changes, version)
        t_encode = time.perf_counter() - t0
        ref = self._upload(self._key("deltas", version), data)
        entry = VersionEntry(version, step=step, time=time.time(), nnz=changes.nnz, delta=(ref,))
        self._commit(self._manifest.with_version(entry, now=time.time(), lease_s=self.lease_s), (ref,))
        self._snapshot.advance(changes)
        self._since_anchor += ref.size
        self._report(version, step, "delta", changes.nnz, (ref,), t_diff, t_encode, time.perf_counter() - t0 - t_encode, started)
        if self._anchor_due(version):
            self._commit_anchor(version, step)

    def _anchor_due(self, version: int) -> bool:
        assert self._manifest is not None
        last = self._manifest.entry(self._anchor_version)
        anchor_bytes = last.anchor_bytes if last is not None and last.anchor else None
        if version - self._anchor_version >= self.anchor_every:
            return True
        return anchor_bytes is not None and self._since_anchor > self.anchor_ratio * anchor_bytes

    def _commit_anchor(self, version: int, step: int | None) -> None:
        assert self._manifest is not None and self._snapshot is not None
        t0 = time.perf_counter()
        refs, t_encode = self._upload_anchor(self._snapshot, version)
        self._attach_anchor(version, refs)
        self._anchor_version, self._since_anchor = version, 0
        numel = sum(s.numel for s in self._snapshot.specs)
        self._report(version, step, "anchor", numel, refs, 0.0, t_encode, time.perf_counter() - t0 - t_encode, t0)

    def _attach_anchor(self, version: int, refs: tuple[ObjectRef, ...]) -> None:
        """Add anchor objects to the already committed ``version`` (one manifest write)."""
        assert self._manifest is not None and self._manifest.entry(version) is not None
        versions = tuple(
            VersionEntry(e.version, e.step, e.time, e.nnz, e.delta, refs) if e.version == version else e
            for e in self._manifest.versions
        )
        self._commit(replace_manifest(self._manifest, versions=versions), refs)

    def _commit(self, manifest: Manifest, uploaded: tuple[ObjectRef, ...]) -> None:
        """Write ``manifest``; if it surely did not land, delete the objects uploaded for it.

        A version that is not committed is never visible, and its objects would only take
        space (a full disk fills further with each failed attempt). When the store cannot
        say whether the write landed, they stay: replicas may already read them.
        """
        try:
            self._write_manifest(manifest)
        except StoreError:
            if not self._resync:
                self._discard(uploaded)
            raise

    def _discard(self, refs: tuple[ObjectRef, ...] | list[ObjectRef]) -> None:
        """Delete objects of a version that will not be committed (best effort; gc sweeps the rest)."""
        for ref in refs:
            try:
                self.store.delete(ref.key)
            except DeltaSyncError as exc:
                logger.warning("could not delete uncommitted %s: %s", ref.key, exc)

    def _upload_anchor(self, snapshot: Snapshot, version: int) -> tuple[tuple[ObjectRef, ...], float]:
        """Encode parts one after another while earlier parts upload."""
        prefix = self._key("anchors", version)
        groups: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in snapshot.items():
            nbytes = tensor.numel() * tensor.element_size()
            if groups[-1] and size + nbytes > self.part_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = tensor
            size += nbytes
        futures, t_encode = [], 0.0
        for i, group in enumerate(g for g in groups if g):  # a rank that holds nothing uploads nothing
            t0 = time.perf_counter()
            data = encode_anchor(group, version=version, model=self._specs or snapshot.specs, rows=self._rows)
            t_encode += time.perf_counter() - t0
            futures.append(self._uploads.submit(self._upload, f"{prefix}-part{i:04d}", data))
        refs, failure = [], None
        for future in futures:
            try:
                refs.append(future.result())
            except Exception as exc:  # wait for every part, then remove the ones that made it
                failure = failure or exc
        if failure is not None:
            self._discard(refs)
            raise failure
        return tuple(refs), t_encode

    def _report(
        self, version: int, step: int | None, kind: str, nnz: int, refs: tuple[ObjectRef, ...],
        t_diff: float, t_encode: float, t_upload: float, started: float,
    ) -> None:
        numel = self._manifest.numel if self._manifest else 0
        info = PublishInfo(
            version, step, kind, nnz, numel, sum(r.size for r in refs), t_diff, t_encode, t_upload,
            time.perf_counter() - started, self._coalesced_now if kind == "delta" else 0,
        )
        self.stats.published += 1
        self.stats.bytes += info.bytes
        self.stats.last = info
        logger.info(
            "published v%d (%s, step %s): %d changed (sparsity %.3f %%), %s bytes, diff %.0f ms, total %.0f ms",
            version, kind, step, nnz, 100 * info.sparsity, f"{info.bytes:,}", 1e3 * t_diff, 1e3 * info.t_total,
        )
        if self.on_publish is not None:
            try:
                self.on_publish(info)
            except Exception:  # the version is committed; a user's callback cannot undo that
                logger.exception("on_publish callback failed for v%d", version)


ZSTD_MIN_LEVEL, ZSTD_MAX_LEVEL = -(1 << 17), 22  # zstd's own bounds (ZSTD_minCLevel, ZSTD_maxCLevel)


def _check_options(
    *, codec: str, level: int, dtype: torch.dtype | None, anchor_every: int, anchor_ratio: float,
    keep_anchors: int, part_bytes: int, lease_s: float, retire_grace_s: float, chunk: int,
    on_publish: Callable[[PublishInfo], None] | None,
) -> None:
    """Refuse options that cannot work, naming the argument, before anything is read or written."""
    if codec not in codec_names() or codec == "dense":
        sparse = [c for c in codec_names() if c != "dense"]
        raise ConfigError(f"unknown codec {codec!r}; choose one of {sparse}", argument="codec")
    if dtype is not None:
        dtype_name(dtype)  # bf16, fp16 or fp32
    integers = {"level": (level, ZSTD_MIN_LEVEL, ZSTD_MAX_LEVEL), "anchor_every": (anchor_every, 1, None), "keep_anchors": (keep_anchors, 1, None),
                "part_bytes": (part_bytes, 1, None), "chunk": (chunk, 1, None)}
    for name, (value, low, high) in integers.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(f"{name} must be an integer {span}, got {value!r}", argument=name)
    reals = {"anchor_ratio": (anchor_ratio, False), "lease_s": (lease_s, False), "retire_grace_s": (retire_grace_s, True)}
    for name, (value, zero_ok) in reals.items():
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (value == 0 and not zero_ok):
            raise ConfigError(f"{name} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {value!r}", argument=name)
    if on_publish is not None and not callable(on_publish):
        raise ConfigError(f"on_publish must be callable, got {type(on_publish).__name__}", argument="on_publish")


ORPHAN_GRACE_S = 3600.0  # an object this old that no manifest names was left by a crashed publish


def sweep_orphans(store: Store, manifest: Manifest, *, now: float, grace: float = ORPHAN_GRACE_S) -> list[str]:
    """Delete version objects that no manifest names and that are older than ``grace``.

    Such objects come from a publish that crashed between its uploads and its
    manifest write; readers never saw them. The grace period protects the
    uploads of a publish in progress.
    """
    referenced = referenced_keys(manifest)
    removed = []
    for prefix in ("deltas/", "anchors/"):
        for info in store.list(prefix):
            if info.key in referenced:
                continue
            if info.modified is None or now - info.modified < grace:
                continue  # unknown or young: may belong to a publish in progress
            store.delete(info.key)
            removed.append(info.key)
    return removed
