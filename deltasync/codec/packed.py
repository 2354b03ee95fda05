"""``compact`` and ``compact-abs`` decoded on the host a chunk of tensors at a time.

The per-tensor decoder (:class:`~deltasync.codec.compact.CompactCodec`) runs
some thirty numpy calls per tensor on arrays of a tensor's changes (20K at 1 %
of a 2M-element tensor). Each call releases and retakes the GIL, so on a few
decode threads those handoffs, not the work, set the pace: on 2 cores the
thread time of that work doubled with a second thread, and the decode ran only
1.1x faster on two threads than on one. Here the tensors of a chunk (same gap
width, value width and codec; up to :data:`CHUNK` changes) share each call:
their streams are joined, one prefix sum rebuilds every index (each tensor's
start subtracted), and one zigzag and sum rebuilds every value; only zstd, the
reads of the receiver's base, the one-byte radix sort that undoes a tensor's
exponent order and the BLAKE3 checks stay per tensor, and those run without
the GIL.

The checks are the per-tensor decoder's: escape counts, side gaps that cannot
wrap a sum, the last index in bounds, the base lookup's shape, every value
digest. A chunk that fails any of them is decoded again tensor by tensor, so
that a hostile or mismatched tensor is refused with exactly the per-tensor
decoder's error, and its neighbours decode as they would alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from ..errors import DeltaSyncError
from .base import BaseLookup, Decoded
from .compact import SIGNED, UNSIGNED, check_values, unplanes, unzigzag
from .device import Streams

__all__ = ["CHUNK", "decode_chunk", "chunks"]

CHUNK = 1 << 18
"""Changed elements per chunk: large enough that each call amortises its GIL handoff, small enough
that a chunk's int64 scratch stays in a core's cache (13 tensors of 20K changes each in ``device_sync``)."""


class _Refused(Exception):
    """A check failed somewhere in the chunk: decode it tensor by tensor for the exact error."""


def chunks(sizes: Sequence[int], kinds: Sequence[Hashable]) -> list[list[int]]:
    """Positions grouped into chunks of one kind (gap width, value width and codec), in file order, of up to
    :data:`CHUNK` changed elements each (``sizes``; a larger tensor is a chunk of its own)."""
    runs: list[list[int]] = []
    open_run: dict[Hashable, tuple[list[int], int]] = {}  # per kind: the run being filled, and its changes
    for k, (size, kind) in enumerate(zip(sizes, kinds)):
        run, filled = open_run.get(kind, ([], 0))
        if not run or filled + size > CHUNK:
            run, filled = [], 0
            runs.append(run)
        run.append(k)
        open_run[kind] = (run, filled + size)
    return runs


def decode_chunk(items: Sequence[Streams], base: BaseLookup | None) -> list[Decoded] | None:
    """Every tensor of one chunk (see :func:`chunks`), slice-relative; ``None`` when any check fails.

    The caller decodes a refused chunk tensor by tensor, which raises the precise error.
    """
    try:
        return _decode(items, base)
    except (_Refused, DeltaSyncError):
        return None


def _decode(items: Sequence[Streams], base: BaseLookup | None) -> list[Decoded]:
    counts = np.array([item.nnz for item in items], dtype=np.int64)
    starts = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    total = int(starts[-1])
    if total == 0:
        raise _Refused  # nothing to share: the per-tensor decoder handles empty tensors
    indices = _indices(items, counts, starts)
    width = items[0].spec.torch_dtype.itemsize
    words = _joined(items, [item.val for item in items], width, UNSIGNED[width])
    if items[0].base_relative:
        if base is None:
            raise _Refused  # the per-tensor decoder says which tensor needs a base
        reads = []
        for k, item in enumerate(items):
            a, b = int(starts[k]), int(starts[k + 1])
            got = np.ascontiguousarray(base(item.name, indices[a:b] + item.offset if item.offset else indices[a:b]))
            if got.shape != (b - a,) or got.dtype.itemsize != width:
                raise _Refused
            reads.append(got.view(SIGNED[width]))
        current = reads[0] if len(reads) == 1 else np.concatenate(reads)
        values = _add_base(words, current, starts, width)
    else:
        values = words.view(SIGNED[width])
    out = []
    for k, item in enumerate(items):
        a, b = int(starts[k]), int(starts[k + 1])
        check_values(values[a:b], item.params, item.spec)  # an IntegrityError refuses the chunk
        out.append(Decoded(indices[a:b], values[a:b]))
    return out


def _joined(items: Sequence[Streams], streams: Sequence[bytes], width: int, dtype: np.dtype) -> np.ndarray:
    """The words of every tensor's leading ``nnz * width`` bytes of planes, one array for all."""
    if len(items) == 1:  # a chunk of one large tensor: read in place, no joined copy
        return unplanes(streams[0], items[0].nnz, dtype)
    if width == 1:
        return np.concatenate([np.frombuffer(s, dtype=np.uint8, count=item.nnz) for s, item in zip(streams, items)])
    planes = [
        np.frombuffer(s, dtype=np.uint8, count=item.nnz, offset=k * item.nnz)
        for k in range(width) for s, item in zip(streams, items)
    ]
    return unplanes(np.concatenate(planes), sum(item.nnz for item in items), dtype)


def _indices(items: Sequence[Streams], counts: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Flat slice-relative indices of every tensor, after the per-tensor decoder's checks."""
    iw = items[0].iw
    escape = (1 << (8 * iw)) - 1
    narrow = _joined(items, [item.idx for item in items], iw, UNSIGNED[iw])
    escaped = np.flatnonzero(narrow == escape)
    bigs = np.array([item.big for item in items], dtype=np.int64)
    if escaped.size != int(bigs.sum()) or not np.array_equal(np.diff(np.searchsorted(escaped, starts)), bigs):
        raise _Refused  # some tensor's escape count differs from its params
    gaps = np.add(narrow, 1, dtype=np.int64)  # the gap plus the changed element itself
    if escaped.size:
        sides = [np.frombuffer(item.idx, dtype=UNSIGNED[8], count=item.big, offset=item.nnz * iw) for item in items]
        side = sides[0] if len(sides) == 1 else np.concatenate(sides)
        # Per tensor, bound the sum in float first (as the per-tensor decoder does): below it nothing wraps.
        owner = np.repeat(np.arange(len(items)), bigs)
        sums = np.bincount(owner, weights=side.astype(np.float64), minlength=len(items))
        if np.any(sums + counts.astype(np.float64) * (escape + 1) >= 2.0**62):
            raise _Refused
        gaps[escaped] = side.astype(np.int64) + 1
    summed = torch.from_numpy(gaps).cumsum_(0).numpy()  # int64 sums wrap alike: each tensor's difference is exact
    if len(items) > 1:  # each later tensor's sum before its first gap (0 after empty tensors only)
        ends = starts[1:-1] - 1
        before = np.zeros(len(items), dtype=np.int64)
        before[1:] = np.where(ends >= 0, summed[np.maximum(ends, 0)], 0)
        summed -= np.repeat(before, counts)
    summed -= 1
    last = summed[np.maximum(starts[1:] - 1, 0)]
    numel = np.array([item.spec.numel for item in items], dtype=np.int64)
    if np.any((counts > 0) & (last >= numel)):
        raise _Refused
    return summed


def _add_base(words: np.ndarray, current: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """New bit patterns: ``current`` plus the unzigzagged words, undoing each tensor's exponent order.

    The order is a one-byte radix sort per tensor (a single pass; one sort of 16-bit (tensor, exponent)
    keys for the chunk takes two passes over a chunk that no longer fits in cache, and was slower)."""
    unsigned = UNSIGNED[width]
    bits = current.view(unsigned)
    exponent = (bits >> (7 if width == 2 else 23)).astype(np.uint8)  # the byte above the mantissa
    ordered = np.empty_like(words)
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        ordered[a:b][exponent[a:b].argsort(kind="stable")] = words[a:b]
    return (bits + unzigzag(ordered).view(unsigned)).view(SIGNED[width])
