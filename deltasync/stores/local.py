"""Local filesystem store: the embedded default (a plain path or ``file://`` URL).

Every write goes to a temporary file in the destination directory, is fsynced,
and then renamed into place, so readers in other processes see either the old
object or the new one, never a partial file. ``mode="create"`` uses ``link``
(atomic, fails if the name exists); ``if_match`` compare-and-swap holds an
advisory ``flock`` on the root while it checks and renames, which serialises
deltasync writers on one machine (network filesystems without ``flock`` only get
the create-only guarantee).

The etag is ``inode-mtime-size``: each write creates a new inode, so it changes
on every write without hashing the content.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlparse

from ..errors import ObjectNotFound, PreconditionFailed, StoreError
from .base import ObjectInfo, PutMode, Store, check_key

_TMP = ".tmp-"
_LOCK = ".deltasync-lock"


class LocalStore(Store):
    """Objects as files under a root directory.

    Args:
        root (`str` or `Path`): the directory (created if missing).
    """

    scheme = "file"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        super().__init__(self.root.as_uri())
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_url(cls, url: str) -> LocalStore:
        """``file:///abs/path`` or a plain path."""
        if url.startswith("file://"):
            return cls(unquote(urlparse(url).path))
        return cls(url)

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _info(self, key: str, path: Path) -> ObjectInfo:
        try:
            st = path.stat()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key, backend="file") from None
        return ObjectInfo(key, st.st_size, f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}", st.st_mtime)

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f"{_TMP}{uuid.uuid4().hex}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                with self._locked(if_match is not None):
                    self._commit(key, tmp, path, mode, if_match)
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(path.parent)
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            raise StoreError(f"writing {key!r} to {self.url} failed: {exc}", key=key, backend="file") from exc
        return self._info(key, path)

    def _commit(self, key: str, tmp: Path, path: Path, mode: PutMode, if_match: str | None) -> None:
        if if_match is not None:
            try:
                current = self._info(key, path).etag
            except ObjectNotFound:
                current = None
            if current != if_match:
                raise PreconditionFailed(
                    f"{key!r} changed since it was read (etag {current} != {if_match})",
                    key=key,
                    backend="file",
                )
        if mode == "create":
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise PreconditionFailed(f"{key!r} already exists", key=key, backend="file") from None
        else:
            os.replace(tmp, path)

    @contextlib.contextmanager
    def _locked(self, needed: bool) -> Iterator[None]:
        if not needed:
            yield
            return
        with open(self.root / _LOCK, "a+b") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key, backend="file") from None
        except OSError as exc:
            raise StoreError(f"reading {key!r} failed: {exc}", key=key, backend="file") from exc

    def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                return f.read(max(0, end - start))
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key, backend="file") from None

    def head(self, key: str) -> ObjectInfo:
        return self._info(key, self._path(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            for name in sorted(filenames):
                if name.startswith(_TMP) or name == _LOCK:
                    continue
                key = Path(dirpath, name).relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(ObjectNotFound):  # deleted while listing
                        yield self._info(key, Path(dirpath, name))

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    # Make the rename itself durable; some filesystems refuse to open directories.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
