"""``exp-rice``'s compiled kernels: its two Rice-coded bit streams, written and read (see :mod:`.kernels`).

Like every kernel there, a decoder never raises and never reads outside the arrays it is handed: it returns a
status, and :data:`RICE_PROBLEMS` says what each non-zero one means.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._numba import OK, OUT_OF_RANGE, jit

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
