"""Content digests: the one place that knows which hash a writer uses and which a reader accepts.

Every object in the manifest, every object's header and every tensor entry
carries a digest, named by its algorithm (``{"blake3": "<hex>"}``). Writers use
BLAKE3 (format version 2, manifest schema 2): it is a cryptographic hash like
SHA-256 and several times faster on one core, even against SHA-256 in hardware,
which is what lets anchors move at memory speed. Readers also accept SHA-256,
the digest of format 1, so files of that format stay readable. Both give
32-byte digests, written as 64 lowercase hex digits.

An object reference may instead name :data:`BY_ENTRIES` (manifest schema 3):
its digest is the BLAKE3 of the object's header alone, and the header lists
the BLAKE3 of every tensor's bytes, so a reader checks the whole object by its
parts. A writer then hashes each byte once, not twice (the tensors, then the
whole file), which is most of what publishing an anchor costs.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

WRITE = "blake3"
"""The algorithm writers use."""
ALGORITHMS = ("blake3", "sha256")
"""Every algorithm a reader accepts for a run of bytes, by its JSON key."""
BY_ENTRIES = "blake3-entries"
"""An object reference's algorithm for an object checked by its parts: the digest is
the BLAKE3 of the object's header, whose entries carry the BLAKE3 of every tensor."""
OBJECT_ALGORITHMS = (*ALGORITHMS, BY_ENTRIES)
"""Every algorithm an object reference in a manifest may name."""


class Hash(Protocol):
    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...


THREADED_BYTES = 1 << 20
"""BLAKE3 hashes on several threads from this many bytes on. Below, waking the threads costs more than they
save, which an anchor of thousands of small tensors, each checked by its digest, pays once per tensor; at this
size the two are even, and larger objects hash faster on all threads."""


def hasher(algorithm: str = WRITE, size: int | None = None) -> Hash:
    """A fresh incremental hash of ``algorithm`` (one of :data:`OBJECT_ALGORITHMS`;
    :data:`BY_ENTRIES` hashes with BLAKE3) for ``size`` bytes, where the caller knows.

    BLAKE3 hashes on several threads (the digest is the same) unless ``size`` is known to be below
    :data:`THREADED_BYTES`: one large object verifies at several GB/s, and many small tensors do
    not each pay for waking the threads.
    """
    if algorithm in ("blake3", BY_ENTRIES):
        import blake3

        threaded = size is None or size >= THREADED_BYTES
        return blake3.blake3(max_threads=blake3.blake3.AUTO if threaded else 1)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r}; expected one of {OBJECT_ALGORITHMS}")


def hexdigest(buffers: Iterable[Any], algorithm: str = WRITE) -> str:
    """Hex digest of ``buffers`` (bytes-like) one after another."""
    views = [memoryview(buffer) for buffer in buffers]
    h = hasher(algorithm, sum(view.nbytes for view in views))
    for view in views:
        h.update(view)
    return h.hexdigest()


def matches(buffers: Iterable[Any], algorithm: str, expected: str) -> bool:
    """Whether ``buffers`` hash to ``expected`` under ``algorithm``."""
    return hexdigest(buffers, algorithm) == expected


_HEX64 = re.compile(r"[0-9a-f]{64}")


def is_hex(value: object) -> bool:
    """A digest's spelling: 64 lowercase hex digits."""
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def read(
    raw: Mapping[str, Any], what: str, error: type[Exception], names: tuple[str, ...] = ALGORITHMS
) -> tuple[str, Any] | None:
    """``(algorithm, value)`` of the one digest key among ``names`` in ``raw`` (a JSON object describing
    ``what``); ``None`` when it has none.

    Raises:
        ``error``: two digests for one thing (a writer names exactly one).
    """
    found = [(name, raw[name]) for name in names if name in raw]
    if len(found) > 1:
        raise error(f"{what}: two digests ({', '.join(name for name, _ in found)}) where one is expected")
    return found[0] if found else None
