"""A shared read-through cache of version objects, for fleets of replicas on one node.

N replicas following one store each read every version object from it: N times
the egress and the store load. :class:`CachedStore` wraps any store and keeps
the objects a manifest names in a directory every replica on the node (or every
node on a shared filesystem) can read, e.g. ``/dev/shm/deltasync``. The first
replica to need an object reads it from the store; the others read the file.

    Subscriber("s3://bucket/run1", applier, cache_dir="/dev/shm/deltasync")
    CachedStore(open_store("s3://bucket/run1"), "/dev/shm/deltasync")

What is cached: only keys the last manifests read through this store name,
with the size and SHA-256 the manifest gives (objects are immutable once named,
invariant 3). The manifest itself, acks and anything else pass straight through,
so a mutable key is never served stale. Every cached read is checked against the
manifest's size and hash before it is returned: a truncated or corrupted file
raises :class:`~deltasync.errors.IntegrityError` internally, is deleted and
refetched from the store, and bytes the store returns with the wrong hash are
handed to the caller (whose own check refuses them) but never written to the
cache.

Concurrent fills: a filler takes a lock file (created atomically, like
``O_EXCL``) next to the cache; other processes poll for the finished file and
read the store themselves only once a size-scaled timeout passes, or break a
lock older than that (its holder died). So each object is read from the store
once per cache directory, except after a crashed or very slow filler. Files
appear by atomic rename, so no reader sees a partial one.

Bounded size: keys that leave the manifest (retention retired them) are dropped when the manifest is
read, and after each fill the oldest files (by mtime, refreshed on every hit)
go until the cache is under ``max_bytes``. Files of objects deleted from the
store are simply never asked for again and age out.

Full disks: a fill that cannot be written (the cache's filesystem is full) is
served uncached, with one warning until a later fill succeeds, and leaves no
temporary file. Cache files are read like :class:`~deltasync.stores.local.LocalStore`
reads objects: regular files only, no symlinks followed, at most the manifest's
size (plus one byte) read.

Layering: the cache reads manifests, so it sits above them, on the replica's side; the
stores package knows nothing of it.

Reads: :meth:`CachedStore.get_buffer` (what a replica downloads with) reads a hit
into writable memory that the decoder views rather than copies; cache files are
never mapped (:mod:`deltasync.stores.mounts`).

Limits: a hit hashes the file (the manifest's algorithm: BLAKE3, or SHA-256 for
objects of older formats) besides the reader's own check; range reads are served from the cache only for files this
process already verified, otherwise from the store (they are header reads). The
lock relies on hard links (local filesystems, tmpfs, NFS); where ``link`` is
refused, processes fill without a lock and a miss may read the store once per
process.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DeltaSyncError, IntegrityError, ObjectNotFound, PreconditionFailed, StoreError
from ..protocol.keys import ACKS, MANIFEST_KEY
from ..protocol.manifest import Manifest, ObjectRef
from ..stores import check_key, open_store
from ..stores.base import ObjectInfo, PutMode, Store, check_limit, check_size
from ..stores.local import TMP_PREFIX, LocalStore
from ..stores.wrap import DelegatingStore

__all__ = ["CachedStore", "CacheStats", "DEFAULT_MAX_BYTES", "open_cached"]

# Named under the stores' loggers, as log filters select it: a cache is a store to its users.
logger = logging.getLogger("deltasync.stores.cache")

DEFAULT_MAX_BYTES = 8 << 30  # room for a few anchors of a 1B-parameter model (2 GB each) and their deltas
LOW_WATER = 0.9  # eviction frees down to this fraction of max_bytes, so one fill does not evict at every miss
FILL_WAIT_S = 10.0  # how long waiters give a filler before reading the store themselves ...
FILL_MIN_RATE = 20e6  # ... plus the object's size at this rate (bytes/s): a slow store read is not a dead one
POLL_FIRST_S = 0.005  # waiters look for the finished file this often at first ...
POLL_MAX_S = 0.05  # ... backing off to this
_MUTABLE_PREFIXES = (ACKS,)  # replicas rewrite these; never cached even if a manifest names one
TMP_MAX_AGE_S = 3600.0  # temporary files of a filler that died mid-write are removed after this long
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a full disk (or quota): serve uncached, warn once


@dataclass(slots=True)
class CacheStats:
    """What this process's :class:`CachedStore` did (counts are per process, not per cache)."""

    hits: int = 0
    """Reads served from the cache."""
    misses: int = 0
    """Reads of a cacheable object from the store."""
    fills: int = 0
    """Objects written to the cache."""
    waits: int = 0
    """Misses that waited for another process's fill."""
    fallbacks: int = 0
    """Waits that timed out and read the store."""
    corrupt: int = 0
    """Cache files refused (wrong size or hash), deleted and refetched."""
    refused: int = 0
    """Store reads whose bytes did not match the manifest (returned, not cached)."""
    evicted: int = 0
    """Files removed by the size cap or because the manifest retired them."""
    store_bytes: int = 0
    """Bytes of cacheable objects read from the store."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class CachedStore(DelegatingStore):
    """Serves a manifest's immutable objects from a directory shared by processes.

    Args:
        inner (`Store`): the store to read through (any backend).
        cache_dir (`str` or `Path`): the shared directory (created if missing). Stores of different
            URLs keep their files apart in it.
        max_bytes (`int`, *optional*, defaults to 8 GiB): size cap; the least recently used files go first.
        fill_wait (`float`, *optional*): seconds waiters give another process's fill (plus the object's
            size at :data:`FILL_MIN_RATE`) before reading the store themselves.

    Example:
        ```python
        >>> store = CachedStore(open_store("s3://bucket/run1"), "/dev/shm/deltasync")
        >>> Subscriber(store, TorchModuleApplier(model)).start()
        ```
    """

    def __init__(
        self,
        inner: Store,
        cache_dir: str | os.PathLike[str],
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        fill_wait: float = FILL_WAIT_S,
    ) -> None:
        if max_bytes <= 0 or fill_wait < 0:
            raise ConfigError(
                f"max_bytes must be positive and fill_wait non-negative, not {max_bytes} and {fill_wait}",
                argument="max_bytes" if max_bytes <= 0 else "fill_wait",
            )
        super().__init__(inner)
        namespace = hashlib.sha256(inner.url.encode()).hexdigest()[:16]
        self.root = Path(cache_dir).expanduser().resolve() / namespace
        # Cache files are read into memory, never mapped: a hit is checked against damage done in place (a
        # stray process writing into the shared directory), and a mapping would let damage after the check through.
        self._objects = LocalStore(self.root / "objects", map_reads=False)
        self._locks = LocalStore(self.root / "locks")
        self.max_bytes, self.fill_wait = max_bytes, fill_wait
        self.stats = CacheStats()
        self._refs: dict[str, ObjectRef] = {}
        self._current: dict[str, ObjectRef] = {}
        self._verified: set[tuple[int, ...]] = set()  # identities (_identity) of files this process hashed
        self._lock = threading.Lock()
        self._linkless = False
        self._full = False  # the last fill found the cache's disk full (warned once)

    # ------------------------------------------------------------------ reads

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self._get(key, max_bytes, buffer=False)  # type: ignore[return-value]

    def get_buffer(self, key: str, *, max_bytes: int | None = None) -> bytes | memoryview:
        """:meth:`get`; a hit read into writable memory (:meth:`LocalStore.get_buffer`, never mapped), which a
        decoder views instead of copying."""
        return self._get(key, max_bytes, buffer=True)

    def _get(self, key: str, max_bytes: int | None, *, buffer: bool) -> bytes | memoryview:
        check_limit(max_bytes)
        ref = self._refs.get(key)
        if ref is None:
            data = self.inner.get(key, max_bytes=max_bytes)
            if key == MANIFEST_KEY:
                self._observe(data)
            return data
        check_size(key, ref.size, max_bytes, where=self.url, backend=self.scheme)  # cached copies are ref.size
        cached = self._read_cached(ref, buffer=buffer)
        if cached is not None:
            self._count("hits")
            return cached
        return self._fill(ref, max_bytes, buffer=buffer)

    def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, ObjectInfo] | None:
        got = self.inner.get_if_changed(key, etag, max_bytes=max_bytes)
        if got is not None and key == MANIFEST_KEY:
            self._observe(got[0])
        return got

    def get_range(self, key: str, start: int, end: int) -> bytes:
        ref = self._refs.get(key)
        if ref is not None:
            with contextlib.suppress(OSError):  # missing or refused: read the store
                # Served only from a file this process verified (same inode): no other file is trusted.
                fd, st = self._objects.open_regular(ref.key)  # never through a symlink; a FIFO cannot block
                with open(fd, "rb") as f:
                    if st.st_size == ref.size and _identity(st) in self._verified:
                        f.seek(start)
                        self._count("hits")
                        return f.read(max(0, min(end, ref.size) - start))
        return self.inner.get_range(key, start, end)

    # ------------------------------------------------------------------ writes drop the cached copy

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        info = self.inner.put(key, data, mode=mode, if_match=if_match)
        self.invalidate(key)
        return info

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        self.invalidate(key)

    def invalidate(self, key: str) -> None:
        """Remove the cached copy of ``key`` (for every process sharing the cache)."""
        with contextlib.suppress(DeltaSyncError):
            self._objects.delete(check_key(key))

    # ------------------------------------------------------------------ manifest

    def _observe(self, data: bytes) -> None:
        """Learn the cacheable keys (with size and hash) from a manifest read; drop retired ones."""
        try:
            manifest = Manifest.from_bytes(data)
        except DeltaSyncError:
            return  # the reader reports a bad manifest; nothing here becomes cacheable
        current = {
            ref.key: ref
            for entry in manifest.versions
            for ref in entry.objects()
            if ref.key != MANIFEST_KEY and not ref.key.startswith(_MUTABLE_PREFIXES)
        }
        # The previous manifest's objects stay cacheable: a route planned from it may still be fetching.
        # Their cached copies go, though, once retention dropped them (they left the manifest, or a manifest
        # that keeps its own ``retired`` field lists them).
        left = (self._current.keys() - current.keys()) | {key for key, _ in manifest.retired if key not in current}
        self._refs, self._current = {**self._current, **current}, current
        for key in left:
            if self._drop(key):
                self._count("evicted")

    # ------------------------------------------------------------------ the cache files

    def _path(self, key: str) -> Path:
        return self._objects.root / key

    def _read_cached(self, ref: ObjectRef, *, buffer: bool = False) -> bytes | memoryview | None:
        """The cached bytes of ``ref`` if present and intact (with ``buffer``, as :meth:`LocalStore.get_buffer`
        gives them); a bad file is deleted (``None``)."""
        path = self._path(ref.key)
        try:
            read = self._objects.buffer_with_stat if buffer else self._objects.read_with_stat
            data, st = read(ref.key, max_bytes=ref.size)
            _verify(ref, data, where=f"cached copy at {path}")
        except ObjectNotFound:
            return None
        except IntegrityError as exc:  # too long, or the wrong bytes
            logger.warning("%s; deleting it and reading the store", exc)
            self._count("corrupt")
            self._drop(ref.key)
            return None
        except StoreError as exc:  # not a regular file (a symlink, a FIFO), or unreadable
            logger.warning("cannot read cached %s (%s); reading the store", ref.key, exc)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: eviction takes the oldest mtime first
            touched = os.stat(path, follow_symlinks=False)
            if touched.st_ino == st.st_ino and touched.st_dev == st.st_dev:
                st = touched  # the same file, now with the times the touch gave it
        self._verified.add(_identity(st))
        return data

    def _fill(self, ref: ObjectRef, max_bytes: int | None = None, *, buffer: bool = False) -> bytes | memoryview:
        """Read ``ref`` from the store once for every process sharing the cache, and keep it (a hit found on the
        way comes back as :meth:`_read_cached` gives it)."""
        deadline = time.monotonic() + self._wait_budget(ref)
        delay, waited = POLL_FIRST_S, False
        while True:
            with self._filling(ref.key) as mine:
                if mine:
                    data = self._read_cached(ref, buffer=buffer)  # another process may have finished in between
                    if data is not None:
                        self._count("hits")
                        return data
                    return self._load(ref, max_bytes)
            if not waited:
                waited = True
                self._count("waits")
            time.sleep(delay)
            delay = min(POLL_MAX_S, delay * 2)
            data = self._read_cached(ref, buffer=buffer)
            if data is not None:
                self._count("hits")
                return data
            if time.monotonic() > deadline:
                self._count("fallbacks")
                return self._load(ref, max_bytes)

    def _load(self, ref: ObjectRef, max_bytes: int | None = None) -> bytes:
        data = self.inner.get(ref.key, max_bytes=max_bytes)
        self._count("misses")
        self._count("store_bytes", len(data))
        try:
            _verify(ref, data, where=f"{self.inner.url}/{ref.key}")
        except IntegrityError as exc:
            self._count("refused")
            logger.warning("%s; not caching it", exc)
            return data  # the reader's own check refuses it (and retries or avoids the object)
        try:
            self._objects.put(ref.key, data)
            st = os.stat(self._path(ref.key), follow_symlinks=False)
        except OSError as exc:  # StoreError included: a full cache must not fail the read
            self._not_cached(ref.key, exc)
            return data
        self._full = False
        self._verified.add(_identity(st))
        self._count("fills")
        self.evict(keep=ref.key)
        return data

    @contextlib.contextmanager
    def _filling(self, key: str) -> Iterator[bool]:
        """Hold the fill lock of ``key`` if nobody else does (yields whether this process fills)."""
        if self._linkless:
            yield True
            return
        try:
            self._locks.put(key, str(os.getpid()).encode(), mode="create")
        except PreconditionFailed:
            self._break_stale(key)
            yield False
            return
        except StoreError as exc:
            if getattr(exc, "errno", None) in _FULL_ERRNOS:  # a full disk, not a filesystem without links
                self._not_cached(key, exc)
                yield True
                return
            # No hard links here: fill without a lock (duplicates possible).
            logger.warning("no cache locks in %s (%s): concurrent misses may each read the store", self.root, exc)
            self._linkless = True
            yield True
            return
        try:
            yield True
        finally:
            with contextlib.suppress(DeltaSyncError):
                self._locks.delete(key)

    def _break_stale(self, key: str) -> None:
        """Remove a lock older than any fill could take: its holder died."""
        ref = self._refs.get(key)
        try:
            info = self._locks.head(key)
        except DeltaSyncError:
            return
        if ref is not None and info.modified is not None and time.time() - info.modified > self._wait_budget(ref):
            logger.warning("breaking stale cache lock of %s", key)
            with contextlib.suppress(DeltaSyncError):
                self._locks.delete(key)

    def _wait_budget(self, ref: ObjectRef) -> float:
        return self.fill_wait + ref.size / FILL_MIN_RATE

    def evict(self, keep: str | None = None) -> int:
        """Delete the least recently used files until the cache is under its cap; returns bytes freed.

        ``keep`` (the file just filled) is never deleted. Temporary files left by a
        filler that died are removed once older than :data:`TMP_MAX_AGE_S`.
        """
        files: list[tuple[float, int, Path]] = []
        now = time.time()
        for dirpath, _, names in os.walk(self._objects.root):
            for name in names:
                path = Path(dirpath, name)
                try:
                    st = path.lstat()
                except OSError:
                    continue
                if name.startswith(TMP_PREFIX):
                    if now - st.st_mtime > TMP_MAX_AGE_S:
                        self._discard(path)
                    continue
                files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files)
        if total <= self.max_bytes:
            return 0
        freed = 0
        keep_path = self._path(keep) if keep else None
        for _, size, path in sorted(files):
            if total - freed <= self.max_bytes * LOW_WATER:
                break
            if path != keep_path and self._discard(path):
                freed += size
                self._count("evicted")
        return freed

    def _not_cached(self, key: str, exc: OSError) -> None:
        """Log a fill that could not be written: a full disk once (until a fill succeeds), others each time."""
        if getattr(exc, "errno", None) not in _FULL_ERRNOS:
            logger.warning("cannot cache %s: %s", key, exc)
            return
        with self._lock:
            first, self._full = not self._full, True
        if first:
            logger.warning("cache %s is full; serving objects uncached until space frees: %s", self.root, exc)
        else:
            logger.debug("cannot cache %s: %s", key, exc)

    def _drop(self, key: str) -> bool:
        """Remove the cached copy of ``key`` (never following a symlink above it); whether one was there."""
        try:
            return self._objects.unlink(key)
        except (DeltaSyncError, OSError):
            return False

    @staticmethod
    def _discard(path: Path) -> bool:
        try:
            path.unlink()
        except OSError:
            return False
        return True

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def __repr__(self) -> str:
        return f"CachedStore({self.inner!r}, cache_dir={str(self.root.parent)!r})"


def _verify(ref: ObjectRef, data: bytes | memoryview, *, where: str) -> None:
    """Raise :class:`IntegrityError` unless ``data`` has the manifest's size and digest."""
    if not ref.verify(data):
        raise IntegrityError(
            f"{where}: {len(data)} bytes that do not match the manifest "
            f"({ref.size} bytes, {ref.algorithm} {ref.digest[:12]}...)",
            key=ref.key,
        )


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """Which file this is, as far as trusting a hash of it goes.

    Device and inode alone are not enough: a file deleted and rewritten (a refill, or
    damage) often gets the freed inode number back. Its change time cannot match.
    """
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def open_cached(
    store: str | os.PathLike[str] | Store, cache_dir: str | os.PathLike[str] | None, *,
    max_bytes: int | None = None, **options: Any,
) -> Store:
    """Open ``store`` (:func:`~deltasync.stores.open_store`), read through a cache in ``cache_dir`` when one is given.

    A store that is already a :class:`CachedStore` is returned as it is.

    Raises:
        `ConfigError`: ``max_bytes`` without ``cache_dir``, or what :func:`~deltasync.stores.open_store` refuses.
    """
    if cache_dir is None:
        if max_bytes is not None:
            raise ConfigError("cache_max_bytes needs cache_dir (the directory to cache in)", argument="cache_max_bytes")
        return open_store(store, **options)
    inner = open_store(store, **options)
    if isinstance(inner, CachedStore):
        return inner
    return CachedStore(inner, cache_dir, **({"max_bytes": max_bytes} if max_bytes else {}))
