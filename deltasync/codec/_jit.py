"""The numba kernels behind :mod:`.kernels` (imported only when a kernel first runs; see there).

No kernel reads outside the arrays it is handed, given the sizes :mod:`.kernels` checks first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._gather import AHEAD, SPARSE, hint
from ._gather import put as put  # the kernels' namespace, as :mod:`.kernels` reads it
from ._gather import take as take
from ._numba import BAD_ESCAPES, OK, OUT_OF_RANGE, U, inline, jit
from ._rice_jit import RICE_PROBLEMS as RICE_PROBLEMS
from ._rice_jit import rice_rank_stream as rice_rank_stream
from ._rice_jit import rice_ranks as rice_ranks
from ._rice_jit import rice_word_stream as rice_word_stream
from ._rice_jit import rice_words as rice_words


@inline
def _gap(raw: Any, j: int, nnz: int, iw: int, big: int, used: int) -> Any:
    """Gap ``j`` of the planes, an escape resolved from the side stream: ``(gap, escapes used, status)``."""
    gap = np.int64(raw[U(j)])
    for p in range(1, iw):
        gap |= np.int64(raw[U(j + p * nnz)]) << (8 * p)
    if gap != (1 << (8 * iw)) - 1:
        return gap, used, OK
    if used == big:
        return gap, used, BAD_ESCAPES
    at = nnz * iw + 8 * used  # used < big: within the side stream (the caller checked raw's size)
    if raw[U(at + 7)] != 0:  # 2**56 or more: past any tensor
        return gap, used, OUT_OF_RANGE
    gap = np.int64(0)
    for b in range(7):
        gap |= np.int64(raw[U(at + b)]) << (8 * b)
    return gap, used + 1, OK


@inline
def _gaps(raw: Any, nnz: int, iw: int, big: int, numel: int, out: Any) -> int:
    used = 0
    last = np.int64(-1)
    for j in range(nnz):
        gap, used, status = _gap(raw, j, nnz, iw, big, used)
        if status != OK:
            return status
        if gap >= numel - last - 1:  # the next index would be numel or more (no sum can wrap)
            return OUT_OF_RANGE
        last += gap + 1
        out[U(j)] = last
    return OK if used == big else BAD_ESCAPES


@jit
def gap_indices(raw: Any, nnz: int, iw: int, big: int, numel: int, out: Any) -> int:
    if iw == 1:
        return _gaps(raw, nnz, 1, big, numel, out)
    if iw == 2:
        return _gaps(raw, nnz, 2, big, numel, out)
    return _gaps(raw, nnz, 4, big, numel, out) if iw == 4 else _gaps(raw, nnz, iw, big, numel, out)


@jit
def class_starts(bits: Any, mask: int, mantissa: int) -> Any:
    # Four counts per exponent byte, one for each element of a group of four, summed after: most elements share
    # a few exponents, and increments of one count would wait on each other.
    lanes = np.zeros((4, 257), np.int64)
    whole = bits.size - bits.size % 4
    for i in range(0, whole, 4):
        for k in range(4):
            lanes[k, U(((np.int64(bits[U(i + k)]) & mask) >> mantissa & 0xFF) + 1)] += 1
    for i in range(whole, bits.size):
        lanes[0, U(((np.int64(bits[U(i)]) & mask) >> mantissa & 0xFF) + 1)] += 1
    starts = np.zeros(257, np.int64)  # per exponent byte: its first rank in the exponent order
    for e in range(257):
        starts[e] = lanes[0, e] + lanes[1, e] + lanes[2, e] + lanes[3, e]
    for e in range(256):
        starts[e + 1] += starts[e]
    return starts


@inline
def _steps(raw: Any, nnz: int, width: int, mantissa: int, base: Any, out: Any) -> int:
    slots = class_starts(base, (np.int64(1) << (8 * width)) - 1, mantissa)
    return _merge(raw, nnz, width, mantissa, base, slots, out)


@inline
def _merge(raw: Any, nnz: int, width: int, mantissa: int, base: Any, slots: Any, out: Any) -> int:
    """Add each change's word to its base bits; ``slots``: per exponent byte, its first slot in the encoder's
    order (:func:`class_starts`), advanced as the loop goes."""
    mask = (np.int64(1) << (8 * width)) - 1
    half = np.int64(1) << (8 * width - 1)
    for j in range(nnz):
        bits = np.int64(base[U(j)]) & mask
        e = U(bits >> mantissa & 0xFF)
        q = slots[e]  # within [0, nnz): the slots count exactly these base reads, class by class
        slots[e] = q + 1
        word = np.int64(raw[U(q)])
        for p in range(1, width):
            word |= np.int64(raw[U(q + p * nnz)]) << (8 * p)
        new = (bits + ((word >> 1) ^ -(word & 1))) & mask
        out[U(j)] = new - 2 * half if new >= half else new
    return OK


@jit
def add_steps(raw: Any, nnz: int, width: int, mantissa: int, base: Any, out: Any) -> int:
    if width == 2:  # bf16, fp16
        return _steps(raw, nnz, 2, mantissa, base, out)
    return _steps(raw, nnz, 4, mantissa, base, out) if width == 4 else _steps(raw, nnz, width, mantissa, base, out)


@jit
def exponent_ranks(bits: Any, mantissa: int, starts: Any, indices: Any, out: Any) -> int:
    mask = (np.int64(1) << (8 * bits.itemsize)) - 1
    seen = np.zeros(256, np.int64)
    k = 0
    for i in range(bits.size):
        e = U((np.int64(bits[U(i)]) & mask) >> mantissa & 0xFF)
        if k < indices.size and indices[U(k)] == i:
            out[U(k)] = starts[e] + seen[e]
            k += 1
        seen[e] += 1
    return OK if k == indices.size else OUT_OF_RANGE


@jit
def exponent_positions(bits: Any, mantissa: int, starts: Any, ranks: Any, where: Any, slot: Any) -> int:
    mask = (np.int64(1) << (8 * bits.itemsize)) - 1
    # Per exponent byte: its next change in rank order, and how many of its elements come before that
    # change's element (-1: no change left in the class). One load and one store per element.
    next_of = np.zeros(256, np.int64)
    skip = np.full(256, -1, np.int64)
    q = 0
    for e in range(256):
        while q < ranks.size and ranks[q] < starts[e]:
            q += 1
        next_of[e] = q
        if q < ranks.size and ranks[q] < starts[e + 1]:
            skip[e] = ranks[q] - starts[e]
    k = 0
    for i in range(bits.size):
        e = U((np.int64(bits[U(i)]) & mask) >> mantissa & 0xFF)
        left = skip[e]
        if left != 0:
            skip[e] = left - 1  # a class with no change left counts down from -1 and never reaches 0
            continue
        if k == ranks.size:
            return OUT_OF_RANGE  # more changes than ranks: ranks not sorted (callers pass sorted ones)
        q = next_of[e]
        where[U(k)] = i
        slot[U(k)] = q
        k += 1
        next_of[e] = q + 1
        more = q + 1 < ranks.size and ranks[U(q + 1)] < starts[e + 1]
        skip[e] = ranks[U(q + 1)] - ranks[U(q)] - 1 if more else -1
    return OK if k == ranks.size else OUT_OF_RANGE


@jit
def gap_counts(indices: Any, counts: Any) -> int:
    # No branch and no early exit, so that the compiler vectorises the loop.
    unsorted = False
    byte, short, word = np.int64(0), np.int64(0), np.int64(0)  # gaps too wide for 1, 2 and 4 bytes
    prev = np.int64(-1)
    for j in range(indices.size):
        at = indices[U(j)]
        gap = at - prev - 1
        prev = at
        unsorted |= gap < 0
        byte += np.int64(gap >= 0xFF)
        short += np.int64(gap >= 0xFFFF)
        word += np.int64(gap >= 0xFFFFFFFF)
    if unsorted:
        return OUT_OF_RANGE  # not sorted and unique
    counts[0] += byte
    counts[1] += short
    counts[2] += word
    return OK


@inline
def _planes(indices: Any, iw: int, out: Any) -> int:
    nnz = indices.size
    escape = (np.int64(1) << (8 * iw)) - 1
    side = nnz * iw
    used = 0
    prev = np.int64(-1)
    for j in range(nnz):  # the indices are sorted and unique (gap_counts), out sized for their escapes
        at = indices[U(j)]
        gap = at - prev - 1
        prev = at
        word = gap
        if gap >= escape:
            word = escape
            side_at = side + 8 * used
            used += 1
            for b in range(8):
                out[U(side_at + b)] = (gap >> (8 * b)) & 0xFF
        for p in range(iw):
            out[U(j + p * nnz)] = (word >> (8 * p)) & 0xFF
    return OK


@jit
def gap_planes(indices: Any, iw: int, out: Any) -> int:
    if iw == 1:  # each width compiled apart, as in the decoder
        return _planes(indices, 1, out)
    if iw == 2:
        return _planes(indices, 2, out)
    return _planes(indices, 4, out) if iw == 4 else _planes(indices, iw, out)


@inline
def _step_planes(new: Any, base: Any, width: int, mantissa: int, out: Any) -> int:
    nnz = base.size
    mask = (np.int64(1) << (8 * width)) - 1
    half = np.int64(1) << (8 * width - 1)
    slots = class_starts(base, mask, mantissa)
    for j in range(nnz):
        bits = np.int64(base[U(j)]) & mask
        e = U(bits >> mantissa & 0xFF)
        q = slots[e]
        slots[e] = q + 1
        step = ((np.int64(new[U(j)]) & mask) - bits) & mask
        if step >= half:
            step -= 2 * half
        word = ((step << 1) ^ (step >> 63)) & mask
        for p in range(width):
            out[U(q + p * nnz)] = (word >> (8 * p)) & 0xFF
    return OK


@jit
def step_planes(new: Any, base: Any, width: int, mantissa: int, out: Any) -> int:
    if width == 2:  # bf16, fp16 compiled apart
        return _step_planes(new, base, 2, mantissa, out)
    if width == 4:
        return _step_planes(new, base, 4, mantissa, out)
    return _step_planes(new, base, width, mantissa, out)


@inline
def _rebuild(
    idx: Any, nnz: int, iw: int, big: int, numel: int, val: Any, width: int, mantissa: int, src: Any, offset: int,
    indices: Any, out: Any,
) -> int:
    if offset < 0 or offset + numel > src.size:
        return OUT_OF_RANGE
    # The gap decoder runs AHEAD changes in front of the base reads and hints each index as it makes it (where
    # sparse): the reads' cache misses overlap each other and the decoding. Each base read is counted by its
    # exponent byte on the way, for the values' order.
    slots = np.zeros(257, np.int64)
    mask = (np.int64(1) << (8 * width)) - 1
    hinted = nnz * SPARSE < numel
    used = 0
    last = np.int64(-1)
    for t in range(nnz + AHEAD):
        if t < nnz:
            gap, used, status = _gap(idx, t, nnz, iw, big, used)
            if status != OK:
                return status
            if gap >= numel - last - 1:  # as in _gaps; kept out of _gap, where it slows this loop
                return OUT_OF_RANGE
            last += gap + 1
            indices[U(t)] = last
            if hinted:
                hint(src, U(last + offset))
        j = t - AHEAD
        if j >= 0:
            bits = src[U(indices[U(j)] + offset)]  # in [offset, offset + numel): checked above
            out[U(j)] = bits
            slots[U(((np.int64(bits) & mask) >> mantissa & 0xFF) + 1)] += 1
    if used != big:
        return BAD_ESCAPES
    for e in range(256):
        slots[e + 1] += slots[e]
    return _merge(val, nnz, width, mantissa, out, slots, out)


@jit
def rebuild(
    idx: Any, nnz: int, iw: int, big: int, numel: int, val: Any, width: int, mantissa: int, src: Any, offset: int,
    indices: Any, out: Any,
) -> int:
    if width == 2:  # bf16, fp16: the common gap widths compiled apart
        if iw == 1:
            return _rebuild(idx, nnz, 1, big, numel, val, 2, mantissa, src, offset, indices, out)
        if iw == 2:
            return _rebuild(idx, nnz, 2, big, numel, val, 2, mantissa, src, offset, indices, out)
    return _rebuild(idx, nnz, iw, big, numel, val, width, mantissa, src, offset, indices, out)
