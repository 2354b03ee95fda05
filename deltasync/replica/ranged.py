"""Replica side: read only some tensors of a delta or anchor, by byte range, verified end to end.

A replica rank that holds part of a model (an expert-parallel rank holds only
its experts) needs only part of each version. Every file is one safetensors
file whose header gives each entry's byte range, and since per-expert
tensors are separate entries (``docs/FORMAT.md``), a rank can fetch exactly
the tensors it holds:

1. the header: ``[0, size)`` with ``(size, digest)`` from the manifest's
   reference (:attr:`~deltasync.protocol.manifest.ObjectRef.header`), checked against it;
2. the entries of the wanted tensors, as few range requests as their layout
   allows (neighbours closer than ``gap`` bytes are read as one request);
3. each tensor's bytes checked against the digest its header entry lists.

The chain manifest -> header -> tensor is what makes a partial read as
trustworthy as a whole-object hash. What comes back are the verified entries,
decoded later with :func:`~deltasync.format.decode_entries` (base-relative
codecs decode only once the previous version is applied).

Limitations:

- Objects without per-tensor digests (older formats), or referenced without a
  header hash, cannot be read partially: :func:`can_read_ranges` says so, and the
  caller downloads them whole.
- A tensor is the unit: a rank that holds a slice of one tensor (a
  tensor-parallel shard) reads the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import DeltaFormatError, IntegrityError
from ..format import SAFETENSORS_DTYPES, Header, digests, entry_groups, entry_span, header_of, raw_header
from ..protocol.manifest import ObjectRef
from ..stores import Store

__all__ = ["RANGE_GAP", "Fetched", "can_read_ranges", "fetch_tensors"]

RANGE_GAP = 256 << 10  # entries closer than this are fetched in one request (a request costs more than 256 KiB)
RANGE_WORKERS = 8  # range requests in flight per object


@dataclass(frozen=True, slots=True)
class Fetched:
    """Verified entries of some tensors of one object."""

    header: Header
    """The whole file's header (every tensor it carries)."""
    names: tuple[str, ...]
    """The tensors fetched."""
    entries: dict[str, torch.Tensor]
    """Their safetensors entries (``T`` or ``T::part``), checked against the header's digests."""
    bytes_read: int
    """Bytes transferred, header included."""
    requests: int
    """Range requests made, header included."""


def can_read_ranges(ref: ObjectRef) -> bool:
    """Whether ``ref`` can be read partially: the manifest lists its header's size and hash."""
    return ref.header is not None


def fetch_tensors(store: Store, ref: ObjectRef, wanted: Callable[[str], bool], *, gap: int = RANGE_GAP) -> Fetched:
    """Fetch and verify the entries of the tensors of ``ref`` that ``wanted`` selects.

    Raises:
        `IntegrityError`: the header or a tensor's bytes differ from their hashes.
        `DeltaFormatError`: the header is malformed, an entry's range is impossible,
            or the file lists no digest for a wanted tensor.
        `ValueError`: ``ref`` has no header reference (see :func:`can_read_ranges`).
    """
    if ref.header is None:
        raise ValueError(f"{ref.key}: the manifest lists no header hash; download the object whole")
    size, digest = ref.header
    head = store.get_range(ref.key, 0, size)
    if len(head) != size or not digests.matches([head], ref.algorithm, digest):
        raise IntegrityError(f"{ref.key}: header bytes differ from the manifest's hash", key=ref.key)
    layout = raw_header(head)
    if size != 8 + int.from_bytes(head[:8], "little"):  # the data area starts right after the JSON
        raise DeltaFormatError(f"{ref.key}: the manifest's header size {size} is not 8 + the JSON length", key=ref.key)
    header = header_of(layout)
    names = tuple(name for name in header.tensors if wanted(name))
    keys = _entry_keys(header, layout, names, ref.key)
    spans = {key: entry_span(layout[key], ref.size - size, key, ref.key) for ks in keys.values() for key in ks}
    chunks, requests, body_read = _read_spans(store, ref.key, size, sorted(spans.values()), gap)
    entries: dict[str, torch.Tensor] = {}
    for name in names:
        expected = header.tensors[name].digest
        if expected is None:
            raise DeltaFormatError(f"{ref.key}: no digest for {name}; download the object whole", key=ref.key)
        raws = {key: chunks[spans[key]] for key in sorted(keys[name])}
        if not digests.matches(raws.values(), *expected):
            raise IntegrityError(f"{ref.key}: bytes of {name} differ from the header's hash", key=ref.key, name=name)
        entries.update((key, _tensor(raw, layout[key])) for key, raw in raws.items())
    return Fetched(header, names, entries, size + body_read, requests + 1)


def _entry_keys(header: Header, layout: dict, names: tuple[str, ...], key: str) -> dict[str, list[str]]:
    """Per wanted tensor, the safetensors entries that carry it."""
    groups = entry_groups(header, layout)
    keys = {name: groups.get(name, []) for name in names}
    empty = [name for name, found in keys.items() if not found]
    if empty:
        raise DeltaFormatError(f"{key}: no entries for {empty[:5]}", key=key)
    return keys


def _merge(spans: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, stop in spans:
        if merged and start - merged[-1][1] <= gap:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _read_spans(
    store: Store, key: str, base: int, spans: list[tuple[int, int]], gap: int
) -> tuple[dict[tuple[int, int], bytes], int, int]:
    """Every span's bytes, read in merged requests; the number of requests and the bytes they read."""
    merged = [span for span in _merge(spans, gap) if span[1] > span[0]]

    def read(span: tuple[int, int]) -> bytes:
        data = store.get_range(key, base + span[0], base + span[1])
        if len(data) != span[1] - span[0]:
            raise IntegrityError(f"{key}: short range read ({len(data)} of {span[1] - span[0]} bytes)", key=key)
        return data

    if len(merged) > 1:  # remote stores: requests in flight together hide their latency
        with ThreadPoolExecutor(max_workers=min(RANGE_WORKERS, len(merged))) as pool:
            blocks = list(pool.map(read, merged))
    else:
        blocks = [read(span) for span in merged]
    out: dict[tuple[int, int], bytes] = {}
    at = 0
    for (start, stop), data in zip(merged, blocks):
        while at < len(spans) and spans[at][1] <= stop:
            a, b = spans[at]
            out[(a, b)] = data[a - start : b - start]
            at += 1
    for a, b in spans[at:]:  # empty entries past the last request
        out[(a, b)] = b""
    return out, len(merged), sum(stop - start for start, stop in merged)


def _tensor(raw: bytes, info: dict) -> torch.Tensor:
    dtype = SAFETENSORS_DTYPES[info["dtype"]]
    if not raw:
        return torch.empty(info["shape"], dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(info["shape"])
