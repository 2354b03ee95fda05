"""A store wrapper that injects failures and stalls into any real backend."""

from __future__ import annotations

import threading

from deltasync.errors import StoreError
from deltasync.stores import ObjectInfo, Store
from deltasync.stores.base import PutMode
from deltasync.stores.wrap import DelegatingStore


class FaultyStore(DelegatingStore):
    """Delegates to ``inner``; fails or blocks operations on request.

    ``fail_puts[prefix] = n`` fails the next ``n`` puts of keys with that prefix;
    ``gate`` (an Event), when set to a cleared Event, blocks puts until it is set;
    ``corrupt[prefix] = fn`` rewrites bytes returned by ``get``.
    """

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.fail_puts: dict[str, int] = {}
        self.gate: threading.Event | None = None
        self.corrupt: dict[str, object] = {}
        self.puts: list[str] = []

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        if self.gate is not None:
            self.gate.wait(30)
        for prefix, remaining in self.fail_puts.items():
            if key.startswith(prefix) and remaining > 0:
                self.fail_puts[prefix] = remaining - 1
                raise StoreError(f"injected failure writing {key}", key=key, backend="faulty")
        self.puts.append(key)
        return self.inner.put(key, data, mode=mode, if_match=if_match)

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        for prefix, fn in self.corrupt.items():
            if key.startswith(prefix):
                return fn(data)  # type: ignore[operator]
        return data
