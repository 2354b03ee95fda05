"""Committing to a run prefix: ownership, the manifest write, retention and garbage.

The manifest is the one commit point (invariant 3): version objects are
uploaded first, then :class:`ManifestWriter` writes the manifest that names
them. It owns everything about that write:

- Ownership. One writer owns a run prefix: the manifest records the writer and
  a lease. Opening a prefix refuses another model's manifest, and a live lease
  of another writer unless ``takeover=True``; the lease fails closed (it is
  free only once it has provably ended). A takeover sweeps the orphans of the
  previous writer's interrupted publishes.
- The write. Compare-and-swap where the backend supports it; elsewhere (HF
  buckets) the writer re-reads the manifest before and after writing. A write
  whose call failed but which landed is treated as committed; when even that
  cannot be told, :attr:`ManifestWriter.resync` asks the caller to re-anchor.
- Retention. Every write retires versions older than the ``keep_anchors``-th
  newest anchor and deletes retired objects once their grace period is over.
- Cleanup. The uploads of a version that surely did not commit are deleted.

The rules an operator's ``deltasync gc`` applies from outside (which retired
objects are due, when the manifest may be edited, which objects are orphans)
live here too, so the publisher and gc never disagree.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from ..errors import ConflictError, DeltaSyncError, FingerprintMismatch, ObjectNotFound, PreconditionFailed, StoreError
from .keys import ACKS, MANIFEST_KEY, VERSION_PREFIXES
from .manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ObjectRef,
    Span,
    VersionEntry,
    deletable,
    new_manifest,
    plan_retention,
)
from .retired import RetiredLog, named_keys

if TYPE_CHECKING:
    from ..stores import ObjectInfo, Store

__all__ = [
    "ManifestWriter",
    "ORPHAN_GRACE_S",
    "RetiredCleanup",
    "classify_orphans",
    "cleanup_blocked",
    "find_orphans",
    "sweep_orphans",
    "orphan_grace",
    "plan_retired_cleanup",
]

# The publisher's commits: its users configure one logger for all of it.
logger = logging.getLogger("deltasync.publisher")

ORPHAN_GRACE_S = 3600.0  # an object this old that no manifest names was left by a crashed publish
WRITE_ATTEMPTS = 3  # manifest writes retried after a foreign edit (an operator's gc) before giving up


class ManifestWriter:
    """Commits versions to one run prefix on behalf of one writer.

    Args:
        store (`Store`): the run prefix.
        writer (`str`): this writer's id, recorded in the manifest it writes.
        lease_s (`float`): how long each write holds the prefix for this writer.
        keep_anchors (`int`): anchors (and the versions after them) retention keeps.
        retire_grace_s (`float`): how long objects dropped by retention stay in the store.
        takeover (`bool`, *optional*, defaults to `False`): take the prefix over even if another
            writer's lease is live.

    Example:
        ```python
        >>> commits = ManifestWriter(store, writer="a1b2", lease_s=600.0, keep_anchors=2, retire_grace_s=300.0)
        >>> commits.open(fingerprint=fp, numel=numel)
        >>> commits.commit_version(VersionEntry(0, nnz=numel, anchor=refs), refs)
        >>> commits.release()
        ```
    """

    def __init__(
        self, store: Store, *, writer: str, lease_s: float, keep_anchors: int, retire_grace_s: float,
        takeover: bool = False,
    ) -> None:
        self.store = store
        self.writer = writer
        self.lease_s, self.keep_anchors, self.retire_grace_s = lease_s, keep_anchors, retire_grace_s
        self.takeover = takeover
        self.manifest: Manifest | None = None
        """The manifest as this writer last read or wrote it; ``None`` before :meth:`open`."""
        self.etag: str | None = None
        """The stored manifest's etag, for compare-and-swap; ``None`` while the prefix has none."""
        self.resync = False
        """Set when the stored manifest is uncertain: the caller starts over with a fresh anchor."""
        self._retired: RetiredLog | None = None  # the retired list, read on the first write

    # ------------------------------------------------------------------ ownership

    def open(self, *, fingerprint: str, numel: int) -> Manifest:
        """Read the prefix's manifest and take ownership, or refuse.

        An existing version chain is continued (the caller publishes a fresh anchor
        first: its weights are not the old snapshot).

        Returns:
            `Manifest`: what this writer continues from (not yet written).

        Raises:
            `FingerprintMismatch`: the prefix holds another model. `ConflictError`: another
            writer's lease is live and ``takeover`` is off. `StoreError`: the read failed.
        """
        try:
            got = self.store.get_if_changed(MANIFEST_KEY, None, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFound:
            got = None
        now = time.time()
        if got is None:
            self.manifest = new_manifest(
                run_id=uuid.uuid4().hex, fingerprint=fingerprint, numel=numel, writer=self.writer, lease_s=self.lease_s
            )
            self.etag = None
            if self.store.conditional_writes:
                # Claim the empty prefix (create-only write) before sweeping what an earlier writer, killed
                # before its first commit, left there: a rival starting at the same moment loses the claim.
                self.write(self.manifest)
                self._sweep(self.manifest, now, grace=0.0)
            return self.manifest
        data, info = got
        current = Manifest.from_bytes(data)
        self._refuse_foreign(current, fingerprint, now)
        self.manifest = replace(current, writer=self.writer)
        self.etag = info.etag
        grace = ORPHAN_GRACE_S
        if current.writer != self.writer and self.store.conditional_writes:
            # Claim the prefix first (compare-and-swap on the manifest just read): a rival that opened
            # at the same moment loses here, so no writer is uploading beside this one, and every
            # earlier writer is gone (its lease ended, or it is taken over). What they uploaded and
            # never committed, and their unfinished writes, are garbage now: reclaim them at once.
            self.write(self.manifest)
            grace = 0.0
        self._sweep(self.manifest, now, grace=grace)
        return self.manifest

    def _sweep(self, manifest: Manifest, now: float, *, grace: float) -> None:
        removed = sweep_orphans(self.store, manifest, now=now, grace=grace)
        if removed:
            logger.info(
                "removed %d objects an interrupted publish left on %s (uncommitted uploads, unfinished writes)",
                len(removed), self.store.url,
            )

    def check(self, *, fingerprint: str) -> None:
        """Refuse at once what :meth:`open` would refuse: another model's prefix, another writer's live lease.

        A cheap read, before a publisher copies the model for its first version.

        Raises:
            `FingerprintMismatch`, `ConflictError`: as :meth:`open`. `StoreError`: the read failed.
        """
        try:
            got = self.store.get_if_changed(MANIFEST_KEY, None, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFound:
            return
        if got is None:
            return
        self._refuse_foreign(Manifest.from_bytes(got[0]), fingerprint, time.time())

    def _refuse_foreign(self, current: Manifest, fingerprint: str, now: float) -> None:
        """Raise if the stored manifest is another model's, or another writer's with a live lease."""
        if current.fingerprint != fingerprint:
            raise FingerprintMismatch(
                f"{self.store.url} holds versions of another model ({current.fingerprint}); publish to a new prefix",
                expected=fingerprint,
                found=current.fingerprint,
            )
        self._check_lease(current, now)

    def _check_lease(self, current: Manifest, now: float) -> None:
        # Fails closed: a lease is free only once it has provably ended.
        leased = not current.lease_until <= now
        if current.writer != self.writer and leased and not self.takeover:
            left = current.lease_until - now
            raise ConflictError(
                f"{self.store.url} is owned by writer {current.writer[:8]}, whose lease runs {left:.0f} s more "
                f"(until {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(current.lease_until))}): another "
                "trainer is publishing here. Use another prefix, wait for the lease to end, or pass "
                "takeover=True if that trainer is gone",
                writer=current.writer,
                lease_left_s=left,
            )

    def release(self) -> None:
        """Let the next writer on this prefix start without ``takeover=True`` (best effort).

        Does nothing before this writer's first manifest write (its claim of the prefix, or its first version).
        """
        if self.manifest is None or self.etag is None:
            return
        try:
            self.write(self.manifest, lease_s=0.0)
        except DeltaSyncError as exc:
            logger.warning("could not release the lease on %s: %s", self.store.url, exc)

    # ------------------------------------------------------------------ commits

    def commit_version(self, entry: VersionEntry, uploaded: tuple[ObjectRef, ...] = ()) -> None:
        """Commit ``entry`` as the next version, renewing the lease (see :meth:`commit`)."""
        assert self.manifest is not None, "open() first"
        self.commit(self.manifest.with_version(entry, now=time.time(), lease_s=self.lease_s), uploaded)

    def attach_anchor(self, version: int, refs: tuple[ObjectRef, ...]) -> None:
        """Add anchor objects to the already committed ``version`` (one manifest write)."""
        self._amend(version, refs, lambda entry: replace(entry, anchor=refs))

    def attach_spans(self, version: int, spans: tuple[Span, ...]) -> None:
        """Add catch-up spans to the already committed ``version`` (one manifest write)."""
        refs = tuple(o for span in spans for o in span.objects)
        self._amend(version, refs, lambda entry: entry.with_spans(spans))

    def _amend(self, version: int, refs: tuple[ObjectRef, ...], change: Callable[[VersionEntry], VersionEntry]) -> None:
        assert self.manifest is not None and self.manifest.entry(version) is not None
        self.commit(self.manifest.amended(version, change), refs)

    def commit(self, manifest: Manifest, uploaded: tuple[ObjectRef, ...] = ()) -> None:
        """Write ``manifest``; if it surely did not land, delete the objects ``uploaded`` for it.

        A version that is not committed is never visible, and its objects would only take
        space (a full disk fills further with each failed attempt). When the store cannot
        say whether the write landed, they stay: replicas may already read them.
        """
        try:
            self.write(manifest)
        except StoreError:
            if not self.resync:
                self.discard(uploaded)
            raise

    def discard(self, refs: tuple[ObjectRef, ...] | list[ObjectRef]) -> None:
        """Delete objects of a version that will not be committed (best effort; gc sweeps the rest)."""
        for ref in refs:
            try:
                self.store.delete(ref.key)
            except DeltaSyncError as exc:
                logger.warning("could not delete uncommitted %s: %s", ref.key, exc)

    def write(self, manifest: Manifest, *, lease_s: float | None = None) -> None:
        """Apply retention to ``manifest``, write it, then delete retired objects past their grace.

        Args:
            manifest (`Manifest`): the next state of the prefix.
            lease_s (`float`, *optional*, defaults to this writer's): the lease the write takes.

        Raises:
            `ConflictError`: another writer owns the prefix now. `StoreError`: the write failed
            (with :attr:`resync` set when it is unknown whether it landed).
        """
        now = time.time()
        retained = plan_retention(manifest, keep_anchors=self.keep_anchors, now=now)
        if self._retired is None or self._retired.run_id != retained.run_id:
            self._retired = RetiredLog(self.store, retained.run_id)
        # Dropped objects are listed beside the manifest (retired.json) before it stops naming them.
        due = self._retired.before_commit(retained.retired, now=now, grace=self.retire_grace_s)
        lease = self.lease_s if lease_s is None else lease_s
        retained = replace(retained, retired=(), updated=now, lease_until=now + lease)
        for _ in range(WRITE_ATTEMPTS):
            try:
                info = self._put(retained)
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
        self.manifest, self.etag = retained, info.etag
        deleted = []
        for key in due:
            try:
                self.store.delete(key)
                deleted.append(key)
            except DeltaSyncError as exc:  # committed regardless; gc or the next takeover sweeps it
                logger.warning("could not delete retired %s: %s", key, exc)
        try:
            self._retired.after_delete(deleted)
        except DeltaSyncError as exc:
            logger.warning("could not update %s after deleting retired objects: %s", self.store.url, exc)

    def _put(self, manifest: Manifest) -> ObjectInfo:
        data = manifest.to_bytes()
        if self.store.conditional_writes:
            if self.etag is None:
                return self.store.put(MANIFEST_KEY, data, mode="create")
            return self.store.put(MANIFEST_KEY, data, if_match=self.etag)
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
            got = self.store.get_if_changed(MANIFEST_KEY, None, max_bytes=MAX_MANIFEST_BYTES)
        except DeltaSyncError:
            self.resync = True
            return None
        if got is not None and got[0] == attempted.to_bytes():
            logger.warning("manifest write reported a failure but landed; treating v%s as committed", attempted.latest)
            return got[1]
        return None

    def _merge_foreign_edit(self, ours: Manifest) -> Manifest:
        try:
            data, info = self.store.get_if_changed(MANIFEST_KEY, None, max_bytes=MAX_MANIFEST_BYTES) or (b"", None)
            theirs = Manifest.from_bytes(data)
        except ObjectNotFound:
            theirs = None
        if theirs is None or theirs.writer != self.writer or info is None:
            raise ConflictError(
                f"another writer changed {self.store.url}/{MANIFEST_KEY}: this publisher lost the prefix "
                "(a second trainer, or a takeover); stop one of them",
            )
        if self.manifest is not None and theirs.versions != self.manifest.versions:
            # Our own id wrote versions we do not know about (a write we believed failed):
            # never overwrite them; start over from the stored manifest with an anchor.
            self.resync = True
            raise StoreError(
                f"{self.store.url}/{MANIFEST_KEY} holds versions this publisher did not confirm; "
                "the next publish re-anchors",
                key=MANIFEST_KEY,
            )
        # Only retired keys may differ (gc deleted some): keep ours minus what is already gone.
        gone = {k for k, _ in (self.manifest.retired if self.manifest else ())} - {k for k, _ in theirs.retired}
        self.etag = info.etag
        return replace(ours, retired=tuple((k, t) for k, t in ours.retired if k not in gone))

    def _check_owner_best_effort(self, *, after_write: bool = False) -> None:
        """Without conditional writes: refuse to write over, or to keep, another writer's manifest.

        Read before the write catches a takeover; read after the write catches
        two writers racing to create the prefix (the later write wins the store,
        the earlier writer sees it and stops).
        """
        try:
            current = Manifest.from_bytes(self.store.get(MANIFEST_KEY, max_bytes=MAX_MANIFEST_BYTES))
        except ObjectNotFound:
            return
        if current.writer != self.writer and (after_write or self.etag is not None):
            raise ConflictError(
                f"writer {current.writer[:8]} owns {self.store.url}: another trainer is publishing here; "
                "stop one of them or use another prefix",
                writer=current.writer,
            )


# ---------------------------------------------------------------------- rules for gc from outside


@dataclass(frozen=True, slots=True)
class RetiredCleanup:
    """What may be deleted of a manifest's retired objects by someone other than its writer."""

    due: tuple[str, ...]
    """Retired keys whose grace period is over."""
    manifest: Manifest
    """The manifest without them: written by compare-and-swap before any of them is deleted."""
    blocked: Literal["no-cas", "lease"] | None
    """Why the manifest must be left alone: ``"no-cas"`` (the store cannot compare-and-swap, or
    the manifest's etag is unknown) or ``"lease"`` (a writer's lease is live: the write would
    change the etag under it, and its next commit would fail). ``None``: go ahead."""


def plan_retired_cleanup(manifest: Manifest, *, now: float, grace: float, compare_and_swap: bool) -> RetiredCleanup:
    """Plan the deletion of retired objects past ``grace`` from outside the writer (pure).

    Args:
        manifest (`Manifest`): the stored manifest.
        now (`float`): the current time, epoch seconds.
        grace (`float`): minimum age of a retired object that is deleted.
        compare_and_swap (`bool`): whether the manifest can be rewritten conditionally on its etag.
    """
    due, remaining = deletable(manifest, now=now, grace=grace)
    blocked = cleanup_blocked(manifest, now=now, compare_and_swap=compare_and_swap)
    return RetiredCleanup(tuple(due), replace(remaining, updated=now), blocked)


def cleanup_blocked(manifest: Manifest, *, now: float, compare_and_swap: bool) -> Literal["no-cas", "lease"] | None:
    """Why someone other than the writer must leave retired objects alone (see :attr:`RetiredCleanup.blocked`)."""
    if not compare_and_swap:
        return "no-cas"
    if manifest.lease_until > now:
        return "lease"
    return None


def orphan_grace(manifest: Manifest, grace: float, *, now: float) -> float:
    """The grace an orphan sweep may use: ``grace``, but never below :data:`ORPHAN_GRACE_S`
    while a writer's lease is live (its uploads are unnamed until its manifest write, so they
    look like orphans)."""
    if manifest.lease_until > now and grace < ORPHAN_GRACE_S:
        return ORPHAN_GRACE_S
    return grace


def find_orphans(store: Store, manifest: Manifest, *, now: float, grace: float = ORPHAN_GRACE_S) -> list[ObjectInfo]:
    """Version objects that no manifest names, and unfinished writes, older than ``grace``.

    Such objects come from a publish that crashed between its uploads and its
    manifest write, or in the middle of writing a file (the local store's
    ``.tmp-*``, :meth:`~deltasync.stores.Store.temporaries`); readers never saw
    them. An object whose age the store does not report is kept, as are young
    ones: they may belong to a publish in progress. Unfinished writes under
    ``acks/`` (replicas write there) are due only after :data:`ORPHAN_GRACE_S`.
    """
    return classify_orphans(store, manifest, now=now, grace=grace)[0]


def classify_orphans(
    store: Store, manifest: Manifest, *, now: float, grace: float = ORPHAN_GRACE_S
) -> tuple[list[ObjectInfo], list[ObjectInfo]]:
    """What :func:`find_orphans` finds, split into ``(due, kept)``: kept ones are too young (or ageless)."""
    referenced = named_keys(store, manifest)
    found = [(info, grace) for prefix in VERSION_PREFIXES for info in store.list(prefix) if info.key not in referenced]
    for info in store.temporaries(""):
        found.append((info, max(grace, ORPHAN_GRACE_S) if info.key.startswith(ACKS) else grace))
    due, kept = [], []
    for info, wait in found:
        (due if info.modified is not None and now - info.modified >= wait else kept).append(info)
    return due, kept


def sweep_orphans(store: Store, manifest: Manifest, *, now: float, grace: float = ORPHAN_GRACE_S) -> list[str]:
    """Delete the objects :func:`find_orphans` names.

    Returns:
        `list[str]`: the deleted keys.
    """
    removed = []
    for info in find_orphans(store, manifest, now=now, grace=grace):
        store.delete(info.key)
        removed.append(info.key)
    return removed
