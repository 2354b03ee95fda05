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
:class:`~deltasync.commit.ManifestWriter` takes the prefix, writes the
manifest (compare-and-swap where the backend supports it) and applies
retention; a second publisher on a live prefix gets
:class:`~deltasync.errors.ConflictError`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .codec import DEFAULT_CODEC
from .commit import ORPHAN_GRACE_S as ORPHAN_GRACE_S  # re-exported; defined with the commit rules
from .commit import ManifestWriter
from .commit import sweep_orphans as sweep_orphans  # re-exported; defined with the commit rules
from .diff import ChangeSet, Snapshot, diff
from .digests import BY_ENTRIES
from .errors import ConfigError, ConflictError, DeltaSyncError, FingerprintMismatch, StoreError
from .format import DEFAULT_LEVEL, FORMAT_VERSION, PACKED_VERSION, Window, encode_anchor_parts, encode_delta, header_ref
from .forms import Forms, smallest
from .keys import anchor_part_key, anchor_prefix, delta_key, writer_suffix
from .manifest import RETIRE_GRACE_S, Manifest, ObjectRef, VersionEntry
from .publish_options import ANCHOR_EVERY, ANCHOR_RATIO, KEEP_ANCHORS, LEASE_S, PART_BYTES, check_options
from .stores import Store, open_store
from .tensors import TensorSpec, fingerprint, published_dtype, published_tensors

__all__ = ["Publisher", "PublishInfo", "PublisherStats", "ORPHAN_GRACE_S", "sweep_orphans"]

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
    form: str | None = None
    """The form the version was published in, for sources with several (:mod:`deltasync.forms`)."""

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
    failing: bool = False
    """Whether the newest publish failed (no version committed since): what a status display shows."""


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
        chunk (`int`, *optional*): elements the diff compares per step, which bounds its scratch memory
            (``None``: 4 Mi elements for weights on the CPU, 32 Mi for weights on an accelerator).
        format_version (`int`, *optional*, defaults to 4): the file format of deltas; 3 (the plain header)
            keeps a fleet whose replicas are not yet upgraded reading them (docs/FORMAT.md, "Versions").
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
        chunk: int | None = None,
        format_version: int = FORMAT_VERSION,
        on_publish: Callable[[PublishInfo], None] | None = None,
        **store_options: Any,
    ) -> None:
        check_options(
            codec=codec, level=level, dtype=dtype, anchor_every=anchor_every, anchor_ratio=anchor_ratio,
            keep_anchors=keep_anchors, part_bytes=part_bytes, lease_s=lease_s, retire_grace_s=retire_grace_s,
            chunk=chunk, on_publish=on_publish, format_version=format_version,
        )
        if not isinstance(model, (torch.nn.Module, Mapping)):
            raise ConfigError(
                f"model must be an nn.Module or a mapping of name -> tensor, not {type(model).__name__}",
                argument="model",
            )
        self.model = model
        self.store = open_store(store, **store_options)
        self.codec, self.level, self.dtype, self.chunk, self.format_version = codec, level, dtype, chunk, format_version
        self.anchor_every, self.anchor_ratio, self.part_bytes = anchor_every, anchor_ratio, part_bytes
        self.on_publish = on_publish
        self.stats = PublisherStats()
        self._commits = ManifestWriter(
            self.store, writer=uuid.uuid4().hex, lease_s=lease_s, keep_anchors=keep_anchors,
            retire_grace_s=retire_grace_s, takeover=takeover,
        )
        self._snapshot: Snapshot | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-publish")
        self._uploads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="deltasync-upload")
        self._inflight: Any = None
        self._pending_step: int | None = None
        self._dirty = self._closed = False
        self._fatal: DeltaSyncError | None = None
        self._last_error: BaseException | None = None
        self._coalesced_now = self._anchor_version = self._since_anchor = 0
        self._form: str | None = None  # the form of the newest committed version (sources with several)
        self._opened = threading.Event()  # set by the worker once the first open has finished
        # What the model is, read now: the worker opens the prefix later, when the caller's tensors
        # may be sharded again (FSDP1 gathers them only around each publish).
        self._model_specs = tuple(
            TensorSpec.of(n, t, published_dtype(model, n, t, dtype)) for n, t in published_tensors(model)
        )
        # Set by ShardedPublisher: this rank's slice of a larger model.
        self._specs: tuple[TensorSpec, ...] | None = None  # the full model, when sharded
        self._rows: dict[str, Window] | None = None  # dim-0 rows (or flat elements) this rank carries
        self._rank: int | None = None

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int | None:
        """The newest committed version, or ``None`` before the first commit."""
        return self._manifest.latest if self._manifest else None

    @property
    def writer(self) -> str:
        """This publisher's id, recorded in the manifest as the prefix's owner."""
        return self._commits.writer

    @property
    def lease_s(self) -> float:
        """How long each manifest write holds the prefix."""
        return self._commits.lease_s

    @property
    def keep_anchors(self) -> int:
        """Anchors (and the versions after them) kept by retention."""
        return self._commits.keep_anchors

    @property
    def retire_grace_s(self) -> float:
        """How long objects dropped by retention stay in the store."""
        return self._commits.retire_grace_s

    @property
    def _manifest(self) -> Manifest | None:
        return self._commits.manifest

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
        if self._commits.resync:  # the store's state is uncertain: re-read it and re-anchor
            self._snapshot, self._commits.resync = None, False
        first = self._snapshot is None
        if first:
            if self._manifest is None:
                self._refuse_early()
            snapshot = Snapshot.capture(self.model, dtype=self.dtype)
            t_diff = time.perf_counter() - started
            job = lambda: self._commit_first_anchor(snapshot, step, started, t_diff)  # noqa: E731
        else:
            form, changes = self._diff()
            t_diff = time.perf_counter() - started
            if changes.nnz == 0:
                self._dirty = False
                return False  # the latest version already holds these weights
            job = lambda: self._commit_delta(changes, step, started, t_diff, form)  # noqa: E731
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
            if self._fatal is None:  # let the next trainer on this prefix start without takeover=True
                self._commits.release()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._uploads.shutdown(wait=True)
            self.store.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refuse_early(self) -> None:
        """Refuse another writer's live prefix (or another model's) before copying the model for the first time."""
        live = self._specs or self._model_specs
        check = self._uploads.submit(self._commits.check, fingerprint=fingerprint(live))
        try:
            check.result(timeout=OPEN_WAIT_S)  # a stalled store costs training at most this, once
        except (StoreError, TimeoutError):
            return  # a store that is down or slow at start-up: the worker keeps trying, training goes on
        except (ConflictError, FingerprintMismatch) as exc:
            self._fatal = exc
            raise

    def _open(self) -> None:
        """Take ownership of the prefix for this model (see :meth:`ManifestWriter.open`)."""
        live = self._specs or self._model_specs
        self._commits.open(fingerprint=fingerprint(live), numel=sum(s.numel for s in live))

    # ------------------------------------------------------------------ worker

    def _guard(self, job: Callable[[], None], coalesced: int) -> None:
        self._coalesced_now = coalesced
        try:
            job()
        except (ConflictError, FingerprintMismatch) as exc:  # this prefix is not ours to write
            self._fatal = exc
            self.stats.failed += 1
            self.stats.failing = True
            logger.error("%s", exc)
        except Exception as exc:  # the trainer keeps training; flush() re-raises
            self.stats.failed += 1
            self.stats.failing = True
            self.stats.errors = [*self.stats.errors[-(MAX_ERRORS_KEPT - 1):], f"{type(exc).__name__}: {exc}"]
            logger.warning("publish failed, the next publish will cover these changes: %s", exc)
            self._last_error = exc

    def _raise_worker_error(self) -> None:
        error = self._last_error
        if error is not None:
            self._last_error = None
            raise error

    def _upload(self, key: str, data: bytes | list[Any], *, by_entries: bool = False) -> ObjectRef:
        """Write one object (bytes, or buffers written one after another) and reference it."""
        parts = [data] if isinstance(data, bytes) else data
        self.store.put_parts(key, parts, mode="create" if self.store.conditional_writes else "overwrite")
        head = header_ref(parts[0])
        if by_entries:  # an anchor, by its header (``blake3-entries``), which lists every tensor's digest
            return ObjectRef(key, sum(memoryview(b).nbytes for b in parts), head[1], self._rank, head, BY_ENTRIES)
        return ObjectRef.of(key, parts, self._rank, head)

    def _diff(self) -> tuple[str | None, ChangeSet]:
        """The changes since the last version; of the smallest form when the model has several."""
        assert self._snapshot is not None
        if isinstance(self.model, Forms):
            return smallest(self._snapshot, self.model, chunk=self.chunk, prefer=self._form)
        return None, diff(self._snapshot, self.model, chunk=self.chunk)

    def _encode_delta(self, changes: ChangeSet, version: int) -> bytes:
        return encode_delta(
            changes, version=version, base_version=version - 1, codec=self.codec, level=self.level,
            model=self._specs, rows=self._rows, packed=self.format_version >= PACKED_VERSION,
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
        numel = sum(s.numel for s in snapshot.specs)
        self._commits.commit_version(VersionEntry(version, step=step, time=time.time(), nnz=numel, anchor=refs), refs)
        self._snapshot = snapshot
        self._anchor_version, self._since_anchor = version, 0
        # A source with several forms is captured as its first one (its mapping view).
        self._form = next(iter(self.model.forms()), None) if isinstance(self.model, Forms) else None
        t_upload = time.perf_counter() - t0 - t_encode
        self._report(version, step, "anchor", numel, refs, t_diff, t_encode, t_upload, started, self._form)

    def _commit_delta(
        self, changes: ChangeSet, step: int | None, started: float, t_diff: float, form: str | None = None
    ) -> None:
        assert self._manifest is not None and self._snapshot is not None
        version = self._manifest.latest + 1  # type: ignore[operator]
        t0 = time.perf_counter()
        data = self._encode_delta(changes, version)
        t_encode = time.perf_counter() - t0
        ref = self._upload(delta_key(version, rank=self._rank, suffix=writer_suffix(self.writer)), data)
        entry = VersionEntry(version, step=step, time=time.time(), nnz=changes.nnz, delta=(ref,))
        self._commits.commit_version(entry, (ref,))
        self._snapshot.advance(changes)
        self._since_anchor += ref.size
        self._form = form
        t_upload = time.perf_counter() - t0 - t_encode
        self._report(version, step, "delta", changes.nnz, (ref,), t_diff, t_encode, t_upload, started, form)
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
        self._commits.attach_anchor(version, refs)
        self._anchor_version, self._since_anchor = version, 0
        numel = sum(s.numel for s in self._snapshot.specs)
        t_upload = time.perf_counter() - t0 - t_encode
        self._report(version, step, "anchor", numel, refs, 0.0, t_encode, t_upload, t0, self._form)

    def _upload_anchor(self, snapshot: Snapshot, version: int) -> tuple[tuple[ObjectRef, ...], float]:
        """Encode parts one after another while earlier parts upload."""
        prefix = anchor_prefix(version, rank=self._rank, suffix=writer_suffix(self.writer))
        groups: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in snapshot.items():
            nbytes = tensor.numel() * tensor.element_size()
            if groups[-1] and size + nbytes > self.part_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = tensor
            size += nbytes
        model = self._specs or snapshot.specs
        encode_s = [0.0] * len(groups)

        def encode_and_upload(i: int, group: dict[str, torch.Tensor]) -> ObjectRef:
            # Parts encode (tensor digests, a header; no copy) and upload side by side, viewing the snapshot.
            t0 = time.perf_counter()
            parts = encode_anchor_parts(group, version=version, model=model, rows=self._rows)
            encode_s[i] = time.perf_counter() - t0
            return self._upload(anchor_part_key(prefix, i), parts, by_entries=True)

        futures = [  # a rank that holds nothing uploads nothing
            self._uploads.submit(encode_and_upload, i, group) for i, group in enumerate(g for g in groups if g)
        ]
        refs, failure = [], None
        for future in futures:
            try:
                refs.append(future.result())
            except Exception as exc:  # wait for every part, then remove the ones that made it
                failure = failure or exc
        if failure is not None:
            self._commits.discard(refs)
            raise failure
        return tuple(refs), max(encode_s, default=0.0)

    def _report(
        self, version: int, step: int | None, kind: str, nnz: int, refs: tuple[ObjectRef, ...],
        t_diff: float, t_encode: float, t_upload: float, started: float, form: str | None = None,
    ) -> None:
        numel = self._manifest.numel if self._manifest else 0
        info = PublishInfo(
            version, step, kind, nnz, numel, sum(r.size for r in refs), t_diff, t_encode, t_upload,
            time.perf_counter() - started, self._coalesced_now if kind == "delta" else 0, form,
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
