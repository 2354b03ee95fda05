"""In-process store (``memory://name``) for tests and single-process experiments.

Stores opened with the same name in one process share their objects, so a
publisher and a subscriber in one test see each other. Conditional writes are
exact (one lock guards every namespace).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

from ..errors import ConfigError, ObjectNotFound, PreconditionFailed
from .base import ObjectInfo, PutMode, Store, check_key, check_limit, check_size

_LOCK = threading.Lock()
_SPACES: dict[str, dict[str, tuple[bytes, ObjectInfo]]] = {}
_ETAGS = itertools.count(1)


class MemoryStore(Store):
    """Objects in a process-wide dict keyed by the store name."""

    scheme = "memory"

    def __init__(self, name: str = "default") -> None:
        super().__init__(f"memory://{name}")
        with _LOCK:
            self._objects = _SPACES.setdefault(name, {})

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        """``memory://name`` (``memory://`` alone is the namespace ``"default"``).

        Raises:
            `ConfigError`: the URL does not start with ``memory://``.
        """
        if not isinstance(url, str) or not url.startswith("memory://"):
            raise ConfigError(f"not a memory store URL: {url!r}; expected 'memory://name'", argument="url")
        return cls(url.removeprefix("memory://") or "default")

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        check_key(key)
        with _LOCK:
            current = self._objects.get(key)
            if mode == "create" and current is not None:
                raise PreconditionFailed(f"{key!r} already exists", key=key, backend="memory")
            if if_match is not None and (current is None or current[1].etag != if_match):
                raise PreconditionFailed(f"{key!r} changed since it was read", key=key, backend="memory")
            info = ObjectInfo(key, len(data), str(next(_ETAGS)), time.time())
            self._objects[key] = (bytes(data), info)
            return info

    def _entry(self, key: str) -> tuple[bytes, ObjectInfo]:
        check_key(key)
        with _LOCK:
            entry = self._objects.get(key)
        if entry is None:
            raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key, backend="memory")
        return entry

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        check_limit(max_bytes)
        data, info = self._entry(key)
        check_size(key, info.size, max_bytes, where=self.url, backend="memory")
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._entry(key)[0][start:end]

    def head(self, key: str) -> ObjectInfo:
        return self._entry(key)[1]

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with _LOCK:
            infos = [info for key, (_, info) in sorted(self._objects.items()) if key.startswith(prefix)]
        yield from infos

    def delete(self, key: str) -> None:
        check_key(key)
        with _LOCK:
            self._objects.pop(key, None)

    @staticmethod
    def reset(name: str | None = None) -> None:
        """Drop one namespace (or all): test isolation."""
        with _LOCK:
            if name is None:
                _SPACES.clear()
            else:
                _SPACES.pop(name, None)
