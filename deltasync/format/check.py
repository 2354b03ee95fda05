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

from .. import digests
from ..errors import DeltaFormatError
from .header import entry_groups, header_of, raw_header, tiled_spans

__all__ = ["intact_by_entries"]


def intact_by_entries(data: bytes | bytearray | memoryview, header: tuple[int, str]) -> bool:
    """Whether every byte of ``data`` is covered by its header's per-tensor digests and the header by
    ``header``, its ``(size, BLAKE3 hex)`` from the manifest.

    A malformed header that matches its digest (a writer's bug, not damage in transit) is not intact
    either: the caller refuses the object the same way.
    """
    view = memoryview(data).cast("B")
    size, digest = header
    if len(view) < size or not digests.matches([view[:size]], "blake3", digest):
        return False
    try:
        layout = raw_header(view[:size])
        if size != 8 + int.from_bytes(view[:8], "little"):
            return False
        parsed = header_of(layout)
        spans = tiled_spans(layout, len(view) - size)
    except DeltaFormatError:
        return False
    groups = entry_groups(parsed, layout)
    if groups.keys() != parsed.tensors.keys():
        return False  # an entry no tensor owns, or a tensor without entries: bytes no digest covers
    body = np.frombuffer(view, dtype=np.uint8)[size:]
    for name, keys in groups.items():
        expected = parsed.tensors[name].digest
        if expected is None or expected[0] != "blake3":
            return False
        h = digests.hasher("blake3")
        for key in keys:
            start, stop = spans[key]
            h.update(body[start:stop])
        if h.hexdigest() != expected[1]:
            return False
    return True
