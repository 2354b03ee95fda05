"""A store that forwards every operation to another: the base for wrappers.

Subclasses override the operations they observe or alter (fault injection in
tests, taps that see downloaded objects) and inherit the rest.
"""

from __future__ import annotations

from collections.abc import Iterator

from .base import ChangeFeed, ObjectInfo, PutMode, Store

__all__ = ["DelegatingStore"]


class DelegatingStore(Store):
    """Forwards everything to ``inner``, keeping its URL and write guarantees."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner.url)
        self.inner = inner
        self.scheme = inner.scheme  # type: ignore[misc]
        self.conditional_writes = inner.conditional_writes  # type: ignore[misc]

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        return self.inner.put(key, data, mode=mode, if_match=if_match)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return self.inner.get(key, max_bytes=max_bytes)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self.inner.get_range(key, start, end)

    def head(self, key: str) -> ObjectInfo:
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def temporaries(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.temporaries(prefix)

    def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, ObjectInfo] | None:
        return self.inner.get_if_changed(key, etag, max_bytes=max_bytes)

    def change_feed(self) -> ChangeFeed | None:
        return self.inner.change_feed()

    def close(self) -> None:
        self.inner.close()
