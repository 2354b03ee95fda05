"""The numba kernels behind :mod:`.kernels` (imported only when a kernel first runs; see there).

No kernel reads outside the arrays it is handed, given the sizes :mod:`.kernels` checks first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._gather import take as take  # the kernels' namespace, as :mod:`.kernels` reads it
from ._numba import BAD_ESCAPES, OK, OUT_OF_RANGE, inline, jit


@inline
def _gaps(raw: Any, nnz: int, iw: int, big: int, numel: int, out: Any) -> int:
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


@jit
def gap_indices(raw: Any, nnz: int, iw: int, big: int, numel: int, out: Any) -> int:
    if iw == 1:
        return _gaps(raw, nnz, 1, big, numel, out)
    if iw == 2:
        return _gaps(raw, nnz, 2, big, numel, out)
    return _gaps(raw, nnz, 4, big, numel, out) if iw == 4 else _gaps(raw, nnz, iw, big, numel, out)


@jit
def class_starts(bits: Any, mask: int, mantissa: int) -> Any:
    starts = np.zeros(257, np.int64)  # per exponent byte: its first rank in the exponent order
    for i in range(bits.size):
        starts[((np.int64(bits[i]) & mask) >> mantissa & 0xFF) + 1] += 1
    for e in range(256):
        starts[e + 1] += starts[e]
    return starts


@inline
def _steps(raw: Any, nnz: int, width: int, mantissa: int, base: Any, out: Any) -> int:
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
        e = (np.int64(bits[i]) & mask) >> mantissa & 0xFF
        if k < indices.size and indices[k] == i:
            out[k] = starts[e] + seen[e]
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


@jit
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


@jit
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


@jit
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


# ``exp-rice``: Rice-coded bit streams (docs/FORMAT.md). Bit ``i`` of a stream is bit ``i % 8`` of byte ``i // 8``;
# a Rice code of ``v`` with parameter ``k`` is ``v >> k`` one bits, a zero bit, then the ``k`` low bits of ``v``,
# least significant first.
TRUNCATED, BAD_FIELD, BAD_COUNT, TRAILING = 3, 4, 5, 6
"""More statuses of the ``exp-rice`` decoders, and what each says of the stream:"""
RICE_PROBLEMS = {
    TRUNCATED: "a code runs past the end of the stream",
    BAD_FIELD: "a class field or a code is out of range",
    BAD_COUNT: "it does not list as many changes as the entry's nnz",
    OUT_OF_RANGE: "a position lies past the end of its exponent class",
    TRAILING: "bytes or non-zero bits follow its last code",
}


@jit
def _put(out: Any, bit: int, value: int, count: int) -> int:
    for i in range(count):
        if (value >> i) & 1:
            at = bit + i
            out[at >> 3] |= np.uint8(1 << (at & 7))
    return bit + count


@jit
def _put_rice(out: Any, bit: int, value: int, k: int) -> int:
    for i in range(value >> k):  # the quotient, in unary
        at = bit + i
        out[at >> 3] |= np.uint8(1 << (at & 7))
    return _put(out, bit + (value >> k) + 1, value & ((np.int64(1) << k) - 1), k)


@jit
def _get(raw: Any, bit: int, count: int) -> int:
    value = np.int64(0)
    for i in range(count):
        at = bit + i
        value |= np.int64((raw[at >> 3] >> (at & 7)) & 1) << i
    return value


@jit
def _rice_cost(values: Any, count: int, k: int) -> int:
    bits = np.int64(count) * (1 + k)
    for i in range(count):
        bits += values[i] >> k
    return bits


@jit
def _best_rice(values: Any, count: int, kmax: int) -> Any:
    best, best_k = _rice_cost(values, count, 0), 0
    for k in range(1, kmax + 1):
        bits = _rice_cost(values, count, k)
        if bits < best:
            best, best_k = bits, k
    return best, best_k


@jit
def _bit_length(value: int) -> int:
    n = 0
    while value >> n:
        n += 1
    return n


@jit
def _listing(ranks: Any, lo: int, hi: int, start: int, size: int, unchanged: bool, gaps: Any) -> int:
    """The gaps of one class's listed positions (changed ones, or with ``unchanged`` the others), closed by the
    gap to ``size``; returns how many."""
    m, prev, q = 0, np.int64(-1), lo
    if unchanged:
        for p in range(size):
            if q < hi and ranks[q] - start == p:
                q += 1
                continue
            gaps[m] = p - prev - 1
            m, prev = m + 1, p
    else:
        for j in range(lo, hi):
            p = ranks[j] - start
            gaps[m] = p - prev - 1
            m, prev = m + 1, p
    gaps[m] = size - prev - 1
    return m + 1


@jit
def rice_rank_stream(ranks: Any, starts: Any) -> Any:
    modes = np.zeros(256, np.int64)
    ks = np.zeros(256, np.int64)
    ends = np.searchsorted(ranks, starts)  # class c's changes are ranks[ends[c]:ends[c + 1]]
    gaps = np.empty(ranks.size + 2, np.int64)
    total = np.int64(0)
    for c in range(256):  # pass 1: each class's field and the size of its codes
        size, changed = starts[c + 1] - starts[c], ends[c + 1] - ends[c]
        if size == 0:
            continue
        total += 8
        if changed == 0 or changed == size:
            modes[c] = 0 if changed == 0 else 1
            continue
        unchanged = 2 * changed > size  # list the fewer
        m = _listing(ranks, ends[c], ends[c + 1], starts[c], size, unchanged, gaps)
        top = 0
        for i in range(m):
            top = max(top, gaps[i])
        bits, k = _best_rice(gaps, m, _bit_length(top))
        modes[c], ks[c] = 3 if unchanged else 2, k
        total += bits
    out = np.zeros((total + 7) >> 3, np.uint8)
    bit = np.int64(0)
    for c in range(256):  # pass 2: write them
        if starts[c + 1] == starts[c]:
            continue
        bit = _put(out, bit, modes[c] | ks[c] << 2, 8)
        if modes[c] >= 2:
            m = _listing(ranks, ends[c], ends[c + 1], starts[c], starts[c + 1] - starts[c], modes[c] == 3, gaps)
            for i in range(m):
                bit = _put_rice(out, bit, gaps[i], ks[c])
    return out


@jit
def _get_unary(raw: Any, bit: int, total: int, limit: int) -> Any:
    """A unary quotient at ``bit``: ``(quotient, next bit)``; quotient -1 past the stream, -2 above ``limit``."""
    q = 0
    while True:
        if bit >= total:
            return -1, bit
        if (raw[bit >> 3] >> (bit & 7)) & 1 == 0:
            return q, bit + 1
        q += 1
        bit += 1
        if q > limit:
            return -2, bit


@jit
def _get_rice(raw: Any, bit: int, total: int, k: int, limit: int) -> Any:
    """The Rice code with parameter ``k`` at ``bit``: ``(value, next bit)``; value -1 past the stream, -2 for a
    quotient above ``limit``."""
    q, bit = _get_unary(raw, bit, total, limit)
    if q < 0:
        return q, bit
    if bit + k > total:
        return -1, bit
    return q << k | _get(raw, bit, k), bit + k


@jit
def _stream_end(raw: Any, bit: int) -> int:
    """Whether ``bit`` ends the stream: fewer than 8 bits left, all of them zero."""
    total = raw.size * 8
    if total - bit >= 8 or (bit < total and raw[bit >> 3] >> (bit & 7) != 0):
        return TRAILING
    return OK


@jit
def rice_ranks(raw: Any, starts: Any, nnz: int, out: Any, changed: Any) -> int:
    total = np.int64(raw.size) * 8
    bit, m = np.int64(0), 0
    for c in range(256):
        size = starts[c + 1] - starts[c]
        if size == 0:
            continue
        if bit + 8 > total:
            return TRUNCATED
        field = _get(raw, bit, 8)
        bit += 8
        mode, k = field & 3, field >> 2
        first = m
        if mode <= 1:
            if k != 0 or (mode == 1 and m + size > nnz):
                return BAD_FIELD if k != 0 else BAD_COUNT
            if mode == 1:
                for p in range(size):
                    out[m] = starts[c] + p
                    m += 1
        else:
            prev = np.int64(-1)
            while True:
                gap, bit = _get_rice(raw, bit, total, k, size >> k)
                if gap < 0:
                    return TRUNCATED if gap == -1 else BAD_FIELD
                if gap > size - prev - 1:  # past the class (checked before the sum, which cannot wrap)
                    return OUT_OF_RANGE
                p = prev + gap + 1
                if mode == 3:  # the positions strictly between two listed unchanged ones changed
                    if m + (p - prev - 1) > nnz:
                        return BAD_COUNT
                    for x in range(prev + 1, p):
                        out[m] = starts[c] + x
                        m += 1
                elif p < size:
                    if m == nnz:
                        return BAD_COUNT
                    out[m] = starts[c] + p
                    m += 1
                if p == size:
                    break
                prev = p
        changed[c] = m - first
    return _stream_end(raw, bit) if m == nnz else BAD_COUNT


@jit
def rice_word_stream(words: Any, changed: Any, width: int) -> Any:
    fields = np.zeros(256, np.int64)
    total, j = np.int64(0), 0
    for c in range(256):  # pass 1: per class, the cheaper of a fixed width and the best Rice parameter
        count = changed[c]
        if count == 0:
            continue
        top = 0
        for i in range(j, j + count):
            top = max(top, words[i])
        fixed = _bit_length(top)
        bits, k = _best_rice(words[j:j + count], count, min(fixed, width))
        if fixed * count <= bits:
            bits, fields[c] = fixed * count, 64 + fixed
        else:
            fields[c] = k
        total += 8 + bits
        j += count
    out = np.zeros((total + 7) >> 3, np.uint8)
    bit, j = np.int64(0), 0
    for c in range(256):  # pass 2: write them
        count = changed[c]
        if count == 0:
            continue
        field = fields[c]
        bit = _put(out, bit, field, 8)
        for i in range(j, j + count):
            bit = _put(out, bit, words[i], field - 64) if field >= 64 else _put_rice(out, bit, words[i], field)
        j += count
    return out


@jit
def rice_words(raw: Any, changed: Any, width: int, out: Any) -> int:
    total = np.int64(raw.size) * 8
    top = (np.int64(1) << width) - 1
    bit, j = np.int64(0), 0
    for c in range(256):
        count = changed[c]
        if count == 0:
            continue
        if bit + 8 > total:
            return TRUNCATED
        field = _get(raw, bit, 8)
        bit += 8
        if 64 <= field <= 64 + width:
            size = field - 64
            if bit + count * size > total:
                return TRUNCATED
            for i in range(j, j + count):
                out[i] = _get(raw, bit, size)
                bit += size
        elif field <= width:
            for i in range(j, j + count):
                word, bit = _get_rice(raw, bit, total, field, top >> field)
                if word < 0:
                    return TRUNCATED if word == -1 else BAD_FIELD
                out[i] = word
        else:
            return BAD_FIELD
        j += count
    return _stream_end(raw, bit)
