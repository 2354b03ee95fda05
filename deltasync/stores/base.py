"""The store protocol: a handful of object operations every backend provides.

Keys are ``/``-separated paths relative to the store's root (the run prefix);
:func:`check_key` refuses anything that could escape it. Backends translate
their client's errors into :class:`~deltasync.errors.StoreError` and its
children, so callers handle one error tree whatever the backend.

Conditional writes are how two writers are kept apart: ``put(mode="create")``
fails with :class:`~deltasync.errors.PreconditionFailed` if the key exists, and
``put(if_match=etag)`` fails if the object changed since it was read. Backends
without them set ``conditional_writes = False`` and callers take a lease instead.
"""

from __future__ import annotations

import logging
import random
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from ..errors import DeltaSyncError, IntegrityError, ManifestError, StoreError

__all__ = [
    "ObjectInfo", "Store", "ChangeFeed", "HostCheck", "PutMode", "check_key", "check_limit", "check_prefix", "check_size",
    "retry",
]

logger = logging.getLogger("deltasync.stores")

PutMode = Literal["overwrite", "create"]
T = TypeVar("T")

URL_FORMS = (
    "a path, 'file:///abs/path', 'memory://name', 's3://bucket/prefix' or 'hf://buckets/namespace/name/prefix'"
)
"""The store URLs :func:`~deltasync.stores.open_store` accepts, for error messages."""


_SEGMENT = re.compile(r"^[A-Za-z0-9._=+@,-]+$")


def check_key(key: str) -> str:
    """Validate a key: relative, ``/``-separated, no ``..``, ``.`` or empty segments.

    Raises:
        `ManifestError`: the key is unsafe (path traversal, absolute, URL, odd characters).
    """
    if not isinstance(key, str) or not key or len(key) > 1024:
        raise ManifestError(f"invalid object key {key!r}", key=key)
    for segment in key.split("/"):
        if segment in ("", ".", "..") or not _SEGMENT.fullmatch(segment):
            raise ManifestError(
                f"unsafe object key {key!r}: keys are relative paths of [A-Za-z0-9._=+@,-] segments",
                key=key,
            )
    return key


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a store knows about one object."""

    key: str
    """Key relative to the store root."""
    size: int
    """Size in bytes."""
    etag: str | None = None
    """Opaque version tag for conditional reads and writes (``None`` where unsupported)."""
    modified: float | None = None
    """Last modification, seconds since the epoch, where the backend reports it."""


def check_limit(max_bytes: int | None) -> int | None:
    """Validate a read limit (``None``: unlimited).

    Raises:
        `ValueError`: ``max_bytes`` is not a non-negative integer.
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes must be a non-negative int or None, not {max_bytes!r}")
    return max_bytes


def check_size(
    key: str, size: int, max_bytes: int | None, *, where: str, backend: str, at_least: bool = False
) -> None:
    """Refuse an object of ``size`` bytes when it is larger than ``max_bytes``.

    Args:
        key (`str`): the object's key (for the message and the error's context).
        size (`int`): its size, from metadata or counted while reading.
        max_bytes (`int`, *optional*): the caller's limit; ``None`` accepts any size.
        where (`str`): the store's URL, for the message.
        backend (`str`): the store's scheme, for the error's context.
        at_least (`bool`, *optional*, defaults to `False`): ``size`` is a count of bytes read so far, not
            the whole object's size.

    Raises:
        `IntegrityError`: ``size > max_bytes`` (context: ``key``, ``limit``, ``size``, ``backend``).
    """
    if max_bytes is not None and size > max_bytes:
        raise IntegrityError(
            f"{key!r} in {where} is {'at least ' if at_least else ''}{size} bytes, more than the "
            f"{max_bytes} bytes this read allows; refused",
            key=key,
            limit=max_bytes,
            size=size,
            backend=backend,
        )


def check_prefix(prefix: str, *, invalid: Callable[[str], Exception]) -> str:
    """Validate the folder a URL roots a store in: a key, or ``""`` for the bucket's root.

    Args:
        prefix (`str`): the prefix as the URL spells it; trailing ``/`` are dropped.
        invalid (`Callable[[str], Exception]`): builds the error for an unsafe prefix (each backend
            words it for its own URLs).

    Returns:
        `str`: the prefix without trailing ``/``.

    Raises:
        What ``invalid`` returns: the prefix is not a valid key (see :func:`check_key`).
    """
    prefix = prefix.rstrip("/")
    if prefix:
        try:
            check_key(prefix)
        except DeltaSyncError:
            raise invalid(prefix) from None
    return prefix


class Store(ABC):
    """A flat namespace of immutable-ish objects under one root."""

    scheme: ClassVar[str]
    """URL scheme the backend registers under."""
    conditional_writes: ClassVar[bool] = True
    """Whether ``put(mode="create")`` and ``put(if_match=...)`` are enforced atomically."""

    def __init__(self, url: str) -> None:
        self.url = url

    @abstractmethod
    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        """Write ``data`` at ``key`` atomically (readers see all or nothing).

        Args:
            mode (`"overwrite"` or `"create"`): ``"create"`` fails if the key exists.
            if_match (`str`, *optional*): fail unless the current etag equals this.

        Raises:
            `PreconditionFailed`: a condition did not hold. `StoreError`: the write failed.
        """

    def put_parts(
        self, key: str, parts: Iterable[Any], *, mode: PutMode = "overwrite", if_match: str | None = None
    ) -> ObjectInfo:
        """:meth:`put` of the bytes of ``parts`` (bytes-like buffers) one after another.

        ``parts`` is iterated once. Backends that can write buffers in sequence skip
        joining them (an anchor's parts are views of the weights); the default joins
        them and calls :meth:`put`.
        """
        return self.put(key, b"".join(parts), mode=mode, if_match=if_match)

    @abstractmethod
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Read a whole object.

        Args:
            key (`str`): the object's key.
            max_bytes (`int`, *optional*): the largest object the caller accepts (e.g. the size a manifest
                declares). A larger object is refused after reading at most ``max_bytes + 1`` bytes of it
                (backends that know the size up front read none). ``None`` reads any size.

        Raises:
            `ObjectNotFound`: the key is missing. `IntegrityError`: the object is larger than ``max_bytes``.
            `StoreError`: the read failed.
        """

    def get_buffer(self, key: str, *, max_bytes: int | None = None) -> bytes | memoryview:
        """:meth:`get`, into a writable buffer where the backend reads into one (a local file does).

        A writable buffer lets an anchor's tensors be viewed instead of copied
        (:func:`deltasync.format.file_entries`); the default returns :meth:`get`'s bytes.
        """
        return self.get(key, max_bytes=max_bytes)

    @abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Read bytes ``[start, end)`` of an object."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size and etag of an object. Raises `ObjectNotFound` if missing."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object; removing a missing object is not an error."""

    def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, ObjectInfo] | None:
        """Read ``key`` unless its etag still equals ``etag`` (then return ``None``).

        Backends with conditional GET override this to save the transfer.

        Args:
            key (`str`): the object's key.
            etag (`str`, *optional*): the etag of the copy the caller holds; ``None`` always reads.
            max_bytes (`int`, *optional*): the largest object the caller accepts, as for :meth:`get`.

        Returns:
            `tuple[bytes, ObjectInfo]` or `None`: the bytes and what describes them, or ``None`` if unchanged.

        Raises:
            `ObjectNotFound`: the key is missing. `IntegrityError`: the object is larger than ``max_bytes``.
        """
        check_limit(max_bytes)
        info = self.head(key)
        if etag is not None and info.etag == etag:
            return None
        check_size(key, info.size, max_bytes, where=self.url, backend=self.scheme)
        data = self.get(key, max_bytes=max_bytes)
        return data, ObjectInfo(key, len(data), info.etag, info.modified)

    def temporaries(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Unfinished writes under ``prefix`` that the backend keeps out of :meth:`list`, with their age.

        A process killed while writing can leave them behind (the local store's
        ``.tmp-*`` files); orphan sweeps and ``deltasync gc`` reclaim them like
        orphaned objects, and ``deltasync status`` counts them. :meth:`delete`
        removes one by its key. The default (object stores, whose unfinished
        uploads are not objects) yields nothing.
        """
        return iter(())

    def change_feed(self) -> ChangeFeed | None:
        """A push notification source for changed keys, where the backend has one.

        ``None`` (the default) means readers poll. A backend with a feed (HF
        buckets' server-sent events) returns a :class:`ChangeFeed`; readers then
        block on it between polls instead of sleeping.
        """
        return None

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""
        from ..errors import ObjectNotFound

        try:
            self.head(key)
        except ObjectNotFound:
            return False
        return True

    def close(self) -> None:
        """Release clients and connections."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class ChangeFeed(ABC):
    """Push notifications of changed keys from a backend (see :meth:`Store.change_feed`)."""

    @abstractmethod
    def wait(self, key: str, timeout: float) -> bool:
        """Block until ``key`` may have changed since the last call (``True``) or ``timeout`` passes.

        Spurious ``True`` is allowed (the reader then polls once); a feed that
        dropped (network, reset) must return ``True`` so the reader re-reads.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop following."""


# Retry policy for transient store failures, after huggingface_hub's http_backoff:
# capped exponential backoff with jitter.
RETRY_ATTEMPTS = 5
RETRY_BASE_DELAY = 0.25
RETRY_MAX_DELAY = 8.0


def retry(
    fn: Callable[[], T],
    *,
    what: str,
    transient: Callable[[BaseException], bool],
    attempts: int = RETRY_ATTEMPTS,
    base_delay: float = RETRY_BASE_DELAY,
    max_delay: float = RETRY_MAX_DELAY,
    retry_after: Callable[[BaseException], float | None] = lambda exc: None,
) -> T:
    """Call ``fn``, retrying transient failures with capped exponential backoff.

    ``retry_after`` may extract a server's Retry-After hint from an error, which
    then replaces the computed delay (still capped). Non-transient errors and the
    last failure propagate unchanged.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == attempts or not transient(exc):
                raise
            delay = retry_after(exc) or min(max_delay, base_delay * 2 ** (attempt - 1))
            delay = min(max_delay, delay) * (0.5 + random.random() / 2)
            logger.warning("%s failed (%s); retry %d/%d in %.2fs", what, exc, attempt, attempts - 1, delay)
            time.sleep(delay)
    raise StoreError(f"{what}: retries exhausted")  # unreachable; keeps type checkers content


class HostCheck:
    """Fail at once when a store's host name does not resolve (no network, no DNS), instead of retrying.

    A client's retries are for a server that answers badly; a name that does not resolve will not resolve
    on the next attempt either, and a user offline would otherwise wait out every backoff (about 25 s on
    the Hub). A success is remembered for :attr:`ttl` seconds, so the check costs one lookup a minute.
    """

    ttl = 60.0

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        self.host = urlsplit(url).hostname
        self._until = 0.0

    def __call__(self, what: str, *, key: str | None = None, backend: str | None = None, hint: str = "") -> None:
        """Raise :class:`StoreError` if the host name does not resolve now."""
        import socket

        now = time.monotonic()
        if self.host is None or now < self._until:
            return
        try:
            socket.getaddrinfo(self.host, None)
        except socket.gaierror as exc:
            raise StoreError(
                f"{what} failed: cannot resolve {self.host} ({exc.strerror}): no network, or no DNS here?{hint}",
                key=key, backend=backend,
            ) from None
        self._until = now + self.ttl
