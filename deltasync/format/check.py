"""Checking a whole file by the digests its own header lists.

A manifest may reference an object by its header alone (algorithm
``blake3-entries``, docs/PROTOCOL.md): the digest it gives is the BLAKE3 of the
length prefix and JSON header, and that header carries a BLAKE3 of every
tensor's bytes. The chain manifest -> header -> tensors covers every byte of
the file once three things hold, and :func:`intact_by_entries` checks all
three: the header matches its digest, the entries tile the data area (no byte
outside an entry, none in two), and each tensor's entries match the digest the
header lists for them. A writer then hashes every byte once instead of twice,
and a reader still hashes every byte it uses.
"""

from __future__ import annotations

import numpy as np

from ..errors import DeltaFormatError
from . import digests
from .header import Header, entry_groups, header_of, header_ref, raw_header, tiled_spans

__all__ = ["covered_by_entries", "intact_by_entries", "verified_header"]


def intact_by_entries(data: bytes | bytearray | memoryview, header: tuple[int, str]) -> bool:
    """Whether every byte of ``data`` is covered by its header's per-tensor digests and the header by
    ``header``, its ``(size, BLAKE3 hex)`` from the manifest.

    A malformed header that matches its digest (a writer's bug, not damage in transit) is not intact
    either: the caller refuses the object the same way.
    """
    return verified_header(data, header) is not None


def verified_header(data: bytes | bytearray | memoryview, header: tuple[int, str]) -> Header | None:
    """``data``'s parsed header (its layout kept) where :func:`intact_by_entries` holds, else ``None``: a
    reader that checked an object this way need not parse its header again, a real cost for an anchor part of
    a thousand tensors. Any object that passes for one ``header`` has exactly that header's bytes."""
    view = memoryview(data).cast("B")
    size, digest = header
    if len(view) < size or not digests.matches([view[:size]], "blake3", digest):
        return None
    cover = _cover(view)
    if cover is None or cover[0] != size:
        return None
    _, parsed, expected, spans = cover
    body = np.frombuffer(view, dtype=np.uint8)[size:]
    for name, keys in spans.items():
        h = digests.hasher("blake3", sum(stop - start for start, stop in keys))
        for start, stop in keys:
            h.update(body[start:stop])
        if h.hexdigest() != expected[name]:
            return None
    return parsed


def covered_by_entries(data: bytes | bytearray | memoryview) -> tuple[int, str] | None:
    """``(size, BLAKE3 hex)`` of ``data``'s header where that header's per-tensor BLAKE3 digests cover every
    byte after it (what :func:`intact_by_entries` then checks against), else ``None`` (the file is checked
    whole). Only the header is hashed: the entries' digests are the writer's, checked by the reader."""
    view = memoryview(data).cast("B")
    if _cover(view) is None:
        return None
    return header_ref(view, "blake3")


def _cover(view: memoryview) -> tuple[int, Header, dict[str, str], dict[str, list[tuple[int, int]]]] | None:
    """The header's size, the header parsed, each tensor's BLAKE3, and its entries' byte ranges in the data
    area, where the entries tile the data area and each belongs to a tensor with a BLAKE3 digest; else
    ``None``."""
    try:
        layout = raw_header(view)
        size = 8 + int.from_bytes(view[:8], "little")
        parsed = header_of(layout)
        spans = tiled_spans(layout, len(view) - size)
    except DeltaFormatError:
        return None
    groups = entry_groups(parsed, layout)
    if groups.keys() != parsed.tensors.keys():
        return None  # an entry no tensor owns, or a tensor without entries: bytes no digest covers
    expected: dict[str, str] = {}
    for name in groups:
        digest = parsed.tensors[name].digest
        if digest is None or digest[0] != "blake3":
            return None
        expected[name] = digest[1]
    return size, parsed, expected, {name: [spans[key] for key in keys] for name, keys in groups.items()}
