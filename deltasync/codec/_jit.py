"""The numba kernels behind :mod:`.kernels` (imported only when a kernel first runs; see there).

No kernel reads outside the arrays it is handed, given the sizes :mod:`.kernels` checks first.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

OK, BAD_ESCAPES, OUT_OF_RANGE = 0, 1, 2
"""What a kernel returns: done, an escape count that differs from the params, an index or rank out of range."""


def _jit(fn: Any) -> Any:
    """Compile ``fn`` without the GIL, cached on disk where numba finds a writable place for it (beside this
    file, ``NUMBA_CACHE_DIR``, the user's cache); where it finds none, compiled again in each process."""
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return numba.njit(nogil=True, boundscheck=False)(fn)


@_jit
def take(src: Any, indices: Any, out: Any) -> int:
    size = src.size
    for j in range(indices.size):
        at = indices[j]
        if at < 0 or at >= size:
            return OUT_OF_RANGE
        out[j] = src[at]
    return OK


@_jit
def gap_indices(raw: Any, nnz: int, iw: int, big: int, numel: int, out: Any) -> int:
    escape = (1 << (8 * iw)) - 1
    side = nnz * iw
    used = 0
    last = np.int64(-1)
    for j in range(nnz):
        gap = np.int64(raw[j])
        for p in range(1, iw):
            gap |= np.int64(raw[j + p * nnz]) << (8 * p)
        if gap == escape:
            if used == big:
                return BAD_ESCAPES
            at = side + 8 * used
            used += 1
            if raw[at + 7] != 0:  # 2**56 or more: past any tensor
                return OUT_OF_RANGE
            gap = np.int64(0)
            for b in range(7):
                gap |= np.int64(raw[at + b]) << (8 * b)
        if gap >= numel - last - 1:  # the next index would be numel or more (no sum can wrap)
            return OUT_OF_RANGE
        last += gap + 1
        out[j] = last
    return OK if used == big else BAD_ESCAPES


@_jit
def class_starts(bits: Any, mask: int, mantissa: int) -> Any:
    starts = np.zeros(257, np.int64)  # per exponent byte: its first rank in the exponent order
    for i in range(bits.size):
        starts[((np.int64(bits[i]) & mask) >> mantissa & 0xFF) + 1] += 1
    for e in range(256):
        starts[e + 1] += starts[e]
    return starts


@_jit
def add_steps(raw: Any, nnz: int, width: int, mantissa: int, base: Any, out: Any) -> int:
    mask = (np.int64(1) << (8 * width)) - 1
    half = np.int64(1) << (8 * width - 1)
    slots = class_starts(base, mask, mantissa)  # per exponent byte: its first slot in the encoder's order
    for j in range(nnz):
        bits = np.int64(base[j]) & mask
        e = bits >> mantissa & 0xFF
        q = slots[e]
        slots[e] = q + 1
        word = np.int64(raw[q])
        for p in range(1, width):
            word |= np.int64(raw[q + p * nnz]) << (8 * p)
        new = (bits + ((word >> 1) ^ -(word & 1))) & mask
        out[j] = new - 2 * half if new >= half else new
    return OK


@_jit
def exponent_ranks(bits: Any, mantissa: int, indices: Any, out: Any) -> int:
    mask = (np.int64(1) << (8 * bits.itemsize)) - 1
    starts = class_starts(bits, mask, mantissa)
    seen = np.zeros(256, np.int64)
    k = 0
    for i in range(bits.size):
        e = (np.int64(bits[i]) & mask) >> mantissa & 0xFF
        if k < indices.size and indices[k] == i:
            out[k] = starts[e] + seen[e]
            k += 1
        seen[e] += 1
    return OK if k == indices.size else OUT_OF_RANGE


@_jit
def exponent_positions(bits: Any, mantissa: int, ranks: Any, where: Any, slot: Any) -> int:
    mask = (np.int64(1) << (8 * bits.itemsize)) - 1
    starts = class_starts(bits, mask, mantissa)
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
        e = (np.int64(bits[i]) & mask) >> mantissa & 0xFF
        left = skip[e]
        if left != 0:
            skip[e] = left - 1  # a class with no change left counts down from -1 and never reaches 0
            continue
        q = next_of[e]
        where[k] = i
        slot[k] = q
        k += 1
        next_of[e] = q + 1
        skip[e] = ranks[q + 1] - ranks[q] - 1 if q + 1 < ranks.size and ranks[q + 1] < starts[e + 1] else -1
    return OK if k == ranks.size else OUT_OF_RANGE


@_jit
def gap_counts(indices: Any, counts: Any) -> int:
    prev = np.int64(-1)
    for j in range(indices.size):
        gap = indices[j] - prev - 1
        if gap < 0:
            return OUT_OF_RANGE  # not sorted and unique
        if gap >= 0xFF:
            counts[0] += 1
            if gap >= 0xFFFF:
                counts[1] += 1
                if gap >= 0xFFFFFFFF:
                    counts[2] += 1
        prev = indices[j]
    return OK


@_jit
def gap_planes(indices: Any, iw: int, out: Any) -> int:
    nnz = indices.size
    escape = (np.int64(1) << (8 * iw)) - 1
    side = nnz * iw
    used = 0
    prev = np.int64(-1)
    for j in range(nnz):
        gap = indices[j] - prev - 1
        prev = indices[j]
        word = gap
        if gap >= escape:
            word = escape
            at = side + 8 * used
            used += 1
            for b in range(8):
                out[at + b] = (gap >> (8 * b)) & 0xFF
        for p in range(iw):
            out[j + p * nnz] = (word >> (8 * p)) & 0xFF
    return OK


@_jit
def step_planes(new: Any, base: Any, width: int, mantissa: int, out: Any) -> int:
    nnz = base.size
    mask = (np.int64(1) << (8 * width)) - 1
    half = np.int64(1) << (8 * width - 1)
    slots = class_starts(base, mask, mantissa)
    for j in range(nnz):
        bits = np.int64(base[j]) & mask
        e = bits >> mantissa & 0xFF
        q = slots[e]
        slots[e] = q + 1
        step = ((np.int64(new[j]) & mask) - bits) & mask
        if step >= half:
            step -= 2 * half
        word = ((step << 1) ^ (step >> 63)) & mask
        for p in range(width):
            out[q + p * nnz] = (word >> (8 * p)) & 0xFF
    return OK
