"""Transport, node side: see a version's downloaded deltas early, to fetch all its base values in one call.

The ``compact`` codec decodes values against the engine's current bits at
the changed indices. Asking the workers once per tensor would cost one
``collective_rpc`` per tensor; instead the follower's store is wrapped in a
:class:`TapStore` that hands every downloaded delta to a :class:`TapBuffer`,
and :func:`changed_indices` decodes just the index parts of a version's files
so the follower can look up every base value of the version in one call.

Limitations:

- Only ``compact``-coded tensors that need a base are prefetched; anything
  the prefetch cannot read (an unknown file, a malformed part) is skipped,
  and the real decode reports it or looks it up on its own.
- At most :data:`TAP_KEEP` downloaded deltas are held, in memory, until their
  version is decoded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ...codec import get_codec
from ...codec.compact import CompactCodec, decode_indices
from ...errors import DeltaSyncError
from ...format import Header, file_entries, read_header
from ...replica.ranged import Fetched
from ...stores import Store
from ...stores.wrap import DelegatingStore

__all__ = ["TAP_KEEP", "TapStore", "TapBuffer", "changed_indices", "indices_of"]

TAP_KEEP = 8  # downloaded deltas kept for index prefetch until their version is decoded


class TapStore(DelegatingStore):
    """Delegates to ``inner``; hands every downloaded delta to ``seen`` (read only).

    Args:
        inner (`Store`): the store the subscriber reads.
        seen (`Callable[[str, bytes], None]`): called with each downloaded object's key and bytes
            (manifests and other ``.json`` objects excepted).
    """

    def __init__(self, inner: Store, seen: Callable[[str, bytes], None]) -> None:
        super().__init__(inner)
        self._seen = seen

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        data = self.inner.get(key, max_bytes=max_bytes)
        if not key.endswith(".json"):
            self._seen(key, data)
        return data


class TapBuffer:
    """The last :data:`TAP_KEEP` downloaded deltas by key, until their version is decoded (thread-safe)."""

    def __init__(self, keep: int = TAP_KEEP) -> None:
        self._keep = keep
        self._tapped: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, key: str, data: bytes) -> None:
        """Hold ``data``, dropping the oldest beyond the limit."""
        with self._lock:
            self._tapped[key] = data
            while len(self._tapped) > self._keep:
                self._tapped.popitem(last=False)

    def take(self, header: Header) -> bytes | None:
        """The held file whose header is ``header`` (no longer held after this), or ``None``."""
        with self._lock:
            items = list(self._tapped.items())
        for key, blob in items:
            try:
                if read_header(blob) == header:
                    with self._lock:
                        self._tapped.pop(key, None)
                    return blob
            except DeltaSyncError:
                continue
        return None


def changed_indices(headers: Iterable[Header], tapped: TapBuffer) -> dict[str, list[np.ndarray]]:
    """Per tensor, the changed flat indices (in the full tensor) of each tapped file of ``headers`` needing a base.

    One array per file that carries the tensor (several when a sharded trainer
    wrote it in slices), ordered by first index.
    """
    found = [(header, blob) for header in headers if (blob := tapped.take(header)) is not None]
    return indices_of([h for h, _ in found], [b for _, b in found])


def indices_of(
    headers: Sequence[Header], blobs: Sequence[bytes | memoryview | Fetched]
) -> dict[str, list[np.ndarray]]:
    """:func:`changed_indices` of files in hand: ``blobs[k]`` is the file whose header is ``headers[k]``, or the
    tensors range-read from it (those alone)."""
    pieces: dict[str, list[np.ndarray]] = {}
    for header, blob in zip(headers, blobs):
        entries: dict[str, Any] | None = None
        names = blob.names if isinstance(blob, Fetched) else header.tensors
        for name in names:
            entry = header.tensors[name]
            if type(get_codec(entry.codec)) is not CompactCodec:  # its index stream holds the positions read
                continue
            if entries is None:
                entries = _load_entries(blob.entries if isinstance(blob, Fetched) else blob) or {}
            part = entries.get(f"{name}::idx")
            if part is None:
                continue
            try:
                local = decode_indices(part, entry.params, entry.local_spec, entry.nnz)
            except DeltaSyncError:
                continue  # the real decode reports it
            if local.size:  # flat in the full tensor, as the decoder will ask for them
                pieces.setdefault(name, []).append(local + entry.offset)
    for found in pieces.values():
        found.sort(key=lambda idx: int(idx[0]))  # shards hold disjoint rows: ascending when joined
    return pieces


def _load_entries(blob: bytes | memoryview | Mapping[str, torch.Tensor]) -> dict[str, np.ndarray] | None:
    """The file's uint8 entries (index blobs), or ``None`` if unreadable (the real decode reports it); ``blob``
    may be entries already read (a range read's)."""
    try:
        found = blob if isinstance(blob, Mapping) else file_entries(blob)
        return {k: v.numpy() for k, v in found.items() if v.dtype == torch.uint8}
    except Exception:
        return None
