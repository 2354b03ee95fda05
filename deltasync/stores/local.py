"""Local filesystem store: the embedded default (a plain path or ``file:`` URL).

Every write goes to a temporary file in the destination directory, is fsynced,
and then renamed into place, so readers in other processes see either the old
object or the new one, never a partial file. ``mode="create"`` uses ``link``
(atomic, fails if the name exists); ``if_match`` compare-and-swap holds an
advisory ``flock`` on the root while it checks and renames, which serialises
deltasync writers on one machine (network filesystems without ``flock`` only get
the create-only guarantee).

The etag is ``inode-mtime-size``: each write creates a new inode, so it changes
on every write without hashing the content.

Hostile trees: the store only ever reads regular files inside its root. Paths are
walked from the root one directory at a time with ``O_NOFOLLOW``, so no symlink is
followed, neither at the key nor in a directory above it; files are opened with
``O_NONBLOCK`` (a FIFO cannot block the open) and ``fstat``-ed. A symlink, FIFO,
device, socket or directory at a key raises :class:`~deltasync.errors.StoreError`
("not a regular file inside the store root ... refused"); ``list`` skips such
entries and does not descend into symlinked directories.

Large reads: :meth:`LocalStore.get_buffer` maps an object of :data:`MAP_BYTES` or
more (a private mapping, so a decoder writing into it never writes the file)
where the root is on a local filesystem, instead of copying it into fresh memory:
an anchor's parts are hashed and written into the replica straight from the page
cache, faster than from a copy. Network and unknown filesystems are read by copying, into
memory in huge pages (:mod:`deltasync.stores.buffers`); :mod:`deltasync.stores.mounts` says why.

Full disks: a write that fails (``ENOSPC`` from ``write`` or ``fsync``) removes its
temporary file and raises :class:`~deltasync.errors.StoreError` saying the disk is
full and which filesystem; the key keeps its previous object.

Limitations: POSIX only (``openat``-style ``dir_fd`` calls, ``flock``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import uuid
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from ..errors import ConfigError, ObjectNotFound, PreconditionFailed, StoreError
from .base import URL_FORMS, ObjectInfo, PutMode, Store, check_key, check_limit, check_size
from .buffers import fresh_buffer
from .mounts import filesystem_of, mappable

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"  # a file still being written: never listed, never read
_LOCK = ".deltasync-lock"

# Directories on a key's path are opened without following symlinks (a symlink fails with ENOTDIR).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
MAP_BYTES = 1 << 20  # objects this large or larger are mapped where the filesystem allows (get_buffer)
MAX_MAPPED = 256  # mappings alive at once per process (each holds a descriptor: Python's mmap keeps one); more are read
_live_maps = [0]  # mappings alive now, under _maps_lock
_maps_lock = threading.Lock()
WRITE_CHUNK = 1 << 30  # bytes per write(2) call: Linux moves at most 2 GiB - 4 KiB per call anyway
_FULL = {errno.ENOSPC: "the disk is full: no space left on {}", errno.EDQUOT: "the disk quota is exceeded on {}"}
_KINDS = (
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class LocalStore(Store):
    """Objects as regular files under a root directory.

    Args:
        root (`str` or `Path`): the directory (created if missing).
        map_reads (`bool`, *optional*, defaults to `True`): map large objects where the filesystem allows
            (:meth:`get_buffer`); ``False`` always copies them into memory.
    """

    scheme = "file"

    def __init__(self, root: str | os.PathLike[str], *, map_reads: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        super().__init__(self.root.as_uri())
        # Created by the first write, not here: a replica that only reads never creates a directory.
        self._maps: bool | None = None if map_reads else False  # None: judged at the first large read

    @classmethod
    def from_url(cls, url: str, *, map_reads: bool = True) -> LocalStore:
        """Open a plain path, ``file:///abs/path``, ``file://localhost/abs/path``, ``file:/abs/path`` or
        ``file:relative/path`` (``map_reads``: see the class).

        Raises:
            `ConfigError`: an empty URL, a ``file://`` URL naming another host (``file://run1`` reads
            ``run1`` as a host), or one with a query or fragment.
        """
        return cls(local_path(url), map_reads=map_reads)

    # ------------------------------------------------------------------ reads

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        check_limit(max_bytes)
        with self._errors("reading", key):
            fd, st = self.open_regular(key)
            return self._read(key, fd, st, max_bytes)

    def get_buffer(self, key: str, *, max_bytes: int | None = None) -> memoryview:
        """:meth:`get` as writable memory of the file's size.

        A file of :data:`MAP_BYTES` or more on a local filesystem is mapped, privately
        (a write to the memory never reaches the file): its bytes are read from the page
        cache where they are used, with no new memory faulted in first
        (:mod:`deltasync.stores.mounts` says when that is safe). Others are read into
        fresh memory, in huge pages where it is large (:mod:`deltasync.stores.buffers`),
        and not copied again (``readinto`` releases the GIL while the kernel fills it),
        so parts of an anchor read side by side.
        """
        return self.buffer_with_stat(key, max_bytes=max_bytes)[0]

    def buffer_with_stat(self, key: str, *, max_bytes: int | None = None) -> tuple[memoryview, os.stat_result]:
        """:meth:`get_buffer` that also returns the file's ``fstat`` (for callers that track inodes)."""
        check_limit(max_bytes)
        with self._errors("reading", key):
            fd, st = self.open_regular(key)
            return self._buffer(key, fd, st, max_bytes), st

    def _buffer(self, key: str, fd: int, st: os.stat_result, max_bytes: int | None) -> memoryview:
        """The open file ``fd`` (closed here) as writable memory: mapped, or read into memory."""
        with os.fdopen(fd, "rb", buffering=0) as f:
            check_size(key, st.st_size, max_bytes, where=self.url, backend="file")
            if st.st_size >= MAP_BYTES and self._mappable():
                mapped = _map(f.fileno(), st.st_size, key)
                if mapped is not None:
                    return mapped
            view = fresh_buffer(st.st_size)
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            grew = got == len(view) and f.read(1)
        if grew:  # since fstat: refused over max_bytes, else read whole
            return memoryview(bytearray(self.get(key, max_bytes=max_bytes)))
        return view[:got]

    def _mappable(self) -> bool:
        if self._maps is None:
            self._maps = mappable(self.root)
        return self._maps

    def get_range(self, key: str, start: int, end: int) -> bytes:
        with self._errors("reading", key):
            fd, _ = self.open_regular(key)
            with os.fdopen(fd, "rb") as f:
                f.seek(start)
                return f.read(max(0, end - start))

    def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, ObjectInfo] | None:
        """Read ``key`` unless its etag still equals ``etag``; etag and bytes come from one open file."""
        check_limit(max_bytes)
        with self._errors("reading", key):
            fd, st = self.open_regular(key)
            info = _info(key, st)
            if etag is not None and info.etag == etag:
                os.close(fd)
                return None
            return self._read(key, fd, st, max_bytes), info

    def head(self, key: str) -> ObjectInfo:
        with self._errors("looking up", key):
            with self._dir(key) as (dfd, name):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise self._refused(key, _kind(st.st_mode))
            return _info(key, st)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._walk(prefix, temporary=False)

    def temporaries(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """``.tmp-*`` files under ``prefix``: writes that a killed process never finished (or one in progress)."""
        return self._walk(prefix, temporary=True)

    def _walk(self, prefix: str, *, temporary: bool) -> Iterator[ObjectInfo]:
        # os.walk does not enter symlinked directories (followlinks=False); lstat skips the rest.
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.startswith(TMP_PREFIX) != temporary or name == _LOCK:
                    continue
                path = os.path.join(dirpath, name)
                key = Path(path).relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.lstat(path)
                except FileNotFoundError:  # deleted while listing
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield _info(key, st)

    # ------------------------------------------------------------------ writes

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        """Write ``data`` at ``key`` through a fsynced temporary file renamed into place.

        Raises:
            `PreconditionFailed`: a condition did not hold. `StoreError`: the write failed (the message
            says when the disk is full); the key keeps its previous object and no temporary file stays.
        """
        return self.put_parts(key, [data], mode=mode, if_match=if_match)

    def put_parts(
        self, key: str, parts: Iterable[Any], *, mode: PutMode = "overwrite", if_match: str | None = None
    ) -> ObjectInfo:
        """:meth:`put` of ``parts`` written one after another into the temporary file, never joined."""
        with self._errors("writing", key):
            with self._dir(key, create=True) as (dfd, name):
                tmp = f"{TMP_PREFIX}{uuid.uuid4().hex}"
                _write_new(dfd, tmp, parts)
                try:
                    with self._locked(if_match is not None):
                        self._commit(key, dfd, tmp, name, mode, if_match)
                finally:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp, dir_fd=dfd)
                with contextlib.suppress(OSError):  # make the rename durable; some filesystems refuse
                    os.fsync(dfd)
                return _info(key, os.stat(name, dir_fd=dfd, follow_symlinks=False))

    def _commit(self, key: str, dfd: int, tmp: str, name: str, mode: PutMode, if_match: str | None) -> None:
        if if_match is not None:
            try:
                current: str | None = _info(key, os.stat(name, dir_fd=dfd, follow_symlinks=False)).etag
            except FileNotFoundError:
                current = None
            if current != if_match:
                raise PreconditionFailed(
                    f"{key!r} changed since it was read (etag {current} != {if_match})",
                    key=key,
                    backend="file",
                )
        if mode == "create":
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                raise PreconditionFailed(f"{key!r} already exists", key=key, backend="file") from None
        else:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)

    @contextlib.contextmanager
    def _locked(self, needed: bool) -> Iterator[None]:
        if not needed:
            yield
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        """Remove ``key`` (a symlink at the key is removed, never what it points to)."""
        with self._errors("deleting", key):
            self.unlink(key)

    def unlink(self, key: str) -> bool:
        """Unlink whatever is at ``key`` without following symlinks above it; whether something was there.

        Raises:
            `OSError`: the unlink failed, or a directory on the key's path is refused.
        """
        try:
            with self._dir(key) as (dfd, name):
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:  # ObjectNotFound is one too
            return False
        return True

    # ------------------------------------------------------------------ paths, safely

    @contextlib.contextmanager
    def _dir(self, key: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
        """The open directory holding ``key``, reached from the root without following symlinks,
        and the key's last segment.

        Raises:
            `ObjectNotFound`: a directory on the way is missing (and ``create`` is false), or is a file.
            `StoreError`: a directory on the way is a symlink or special file (refused).
        """
        *parents, name = check_key(key).split("/")
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r}: {self.url} does not exist (yet)", key=key, backend="file") from None
        try:
            for part in parents:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, dir_fd=fd)
                try:
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise self._not_there(key, fd, part, exc, on_path=True) from None
                os.close(fd)
                fd = child
            yield fd, name
        finally:
            os.close(fd)

    def open_regular(self, key: str) -> tuple[int, os.stat_result]:
        """A read-only descriptor of the regular file at ``key``, and its ``fstat``.

        Raises:
            `ObjectNotFound`: nothing is at ``key``. `StoreError`: something other than a regular file
            inside the root is (refused).
        """
        with self._dir(key) as (dfd, name):
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
            except OSError as exc:
                raise self._not_there(key, dfd, name, exc, on_path=False) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._refused(key, _kind(st.st_mode))
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def _read(self, key: str, fd: int, st: os.stat_result, max_bytes: int | None) -> bytes:
        """The bytes of the open file ``fd`` (closed here), at most ``max_bytes + 1`` of them read."""
        with os.fdopen(fd, "rb") as f:
            check_size(key, st.st_size, max_bytes, where=self.url, backend="file")
            data = f.read() if max_bytes is None else f.read(max_bytes + 1)
        check_size(key, len(data), max_bytes, where=self.url, backend="file", at_least=True)  # grew since fstat
        return data

    def read_with_stat(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, os.stat_result]:
        """:meth:`get` that also returns the file's ``fstat`` (for callers that track inodes)."""
        check_limit(max_bytes)
        with self._errors("reading", key):
            fd, st = self.open_regular(key)
            return self._read(key, fd, st, max_bytes), st

    def _not_there(self, key: str, dfd: int, name: str, exc: OSError, *, on_path: bool) -> OSError:
        """Explain a failed ``open`` of ``name``: say what is there instead of a regular file."""
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            return exc
        try:
            mode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
        except OSError:
            return exc
        if on_path and stat.S_ISREG(mode):  # a file where a directory would be: nothing is at the key
            return ObjectNotFound(f"no object {key!r} in {self.url}", key=key, backend="file")
        return self._refused(key, f"{_kind(mode)} on its path" if on_path else _kind(mode))

    def _refused(self, key: str, what: str) -> StoreError:
        return StoreError(
            f"{key!r} in {self.url} is not a regular file inside the store root ({what}); refused",
            key=key,
            backend="file",
            refused=what,
        )

    @contextlib.contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        """Translate ``OSError`` into the store's errors (ours pass through unchanged)."""
        try:
            yield
        except StoreError:
            raise
        except OSError as exc:
            raise self._error(op, key, exc) from exc

    def _error(self, op: str, key: str, exc: OSError) -> StoreError:
        if isinstance(exc, FileNotFoundError) and op != "writing":
            return ObjectNotFound(f"no object {key!r} in {self.url}", key=key, backend="file")
        full = _FULL.get(exc.errno or 0)
        if full is not None:
            return StoreError(
                f"{op} {key!r} in {self.url} failed: {full.format(filesystem_of(self.root))}; "
                "free space there or move the store",
                key=key,
                backend="file",
                errno=exc.errno,
            )
        return StoreError(f"{op} {key!r} in {self.url} failed: {exc}", key=key, backend="file", errno=exc.errno)


def local_path(url: str) -> str:
    """The directory a plain path or ``file:`` URL names (see :meth:`LocalStore.from_url`).

    Raises:
        `ConfigError`: the URL cannot name a local directory; the message shows the accepted forms.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(f"store URL must be a non-empty string, not {url!r}; use {URL_FORMS}", argument="url")
    if not url.startswith("file:"):
        return url
    rest = url[len("file:") :]
    if "?" in rest or "#" in rest:
        raise ConfigError(f"file URL {url!r} has a query or fragment; use {URL_FORMS}", argument="url")
    if rest.startswith("//"):
        host, slash, path = rest[2:].partition("/")
        if host not in ("", "localhost"):
            relative = f"{host}{slash}{path}"
            raise ConfigError(
                f"in {url!r}, {host!r} was read as a host name (file://HOST/path): write "
                f"'file:{relative}' or './{relative}' for a relative path, or 'file:///abs/path'",
                argument="url",
            )
        rest = f"/{path}" if slash else ""
    if not rest:
        raise ConfigError(f"file URL {url!r} names no path; use {URL_FORMS}", argument="url")
    return unquote(rest)


def _map(fd: int, size: int, key: str) -> memoryview | None:
    """A private, writable mapping of ``size`` bytes of ``fd`` (closing ``fd`` leaves it mapped: the mapping
    keeps a descriptor of its own), or ``None`` where it is better read: :data:`MAX_MAPPED` mappings are
    alive (a replica holding every part of a large anchor must not run out of descriptors), or the kernel
    refuses (out of mappings under ``vm.max_map_count``, or a file it will not map)."""
    with _maps_lock:
        if _live_maps[0] >= MAX_MAPPED:
            return None
        _live_maps[0] += 1
    try:
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        _unmapped()
        logger.debug("cannot map %s (%s); reading it", key, exc)
        return None
    weakref.finalize(mapped, _unmapped)
    return memoryview(mapped)


def _unmapped() -> None:
    with _maps_lock:
        _live_maps[0] -= 1


def _write_new(dfd: int, name: str, parts: Iterable[Any]) -> None:
    """Write ``parts`` to a new file ``name`` in ``dfd`` and fsync it; on any failure the file is removed."""
    fd = os.open(name, _WRITE_FLAGS, 0o666, dir_fd=dfd)
    try:
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    written = os.write(fd, view[:WRITE_CHUNK])
                    if written <= 0:
                        raise OSError(errno.EIO, "write(2) made no progress")
                    view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dfd)
        raise


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(key, st.st_size, f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}", st.st_mtime)


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")
