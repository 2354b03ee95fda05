"""Compiled host kernels for ``compact``, ``compact-abs`` and ``compact-exp``: a pass or two per stream.

The numpy decoder (:class:`~deltasync.codec.compact.CompactCodec`) rebuilds a
tensor's changes in some twenty array passes (plane merge, escape search,
widening, prefix sum, exponent sort, zigzag, sum), each a trip through memory
and most with a fresh int64 temporary; an encode in numpy would take about as
many. These kernels do the same work in one or two loops per stream, compiled
once by numba (cached on disk) and run without the GIL:

- :func:`gap_indices` (decode): byte planes merged, escapes resolved from the
  side stream, gaps summed into indices, every index bounds-checked as it is made;
- :func:`add_steps` (decode): the receiver's base bits at those indices bucketed
  by exponent byte (the counting sort the encoder's stable exponent order is),
  each value word merged from its planes at its bucket's next slot, unzigzagged
  and added to the base modulo ``2**bits``;
- :func:`gap_payload` and :func:`step_payload` (encode): their inverses, byte for
  byte the streams ``docs/FORMAT.md`` specifies (tests hold them to its formulas);
- :func:`exponent_ranks` and :func:`exponent_positions`: ``compact-exp``'s ranks
  and their inverse, two passes over a tensor instead of sorting it;
- :func:`class_starts`, :func:`rice_rank_stream` / :func:`rice_ranks` and :func:`rice_word_stream` /
  :func:`rice_words`: ``exp-rice``'s class table and its two Rice-coded bit streams, written and read;
- :func:`take`: a CPU replica's read of its weights at the changed indices (the
  base a ``compact`` value is relative to), every index checked; where fewer than
  one element in 20 is read, each read is hinted to the CPU 192 changes ahead, so
  the cache misses overlap;
- :func:`rebuild` (decode): the three above in one call for a replica that holds a
  tensor whole on the CPU, the gap decoder running ahead of the base reads and
  hinting each index as it makes it;
- :func:`put` (apply): a CPU replica's write of a validated patch into its weights.

The decode loops are compiled once per width (1, 2 or 4 bytes of gap, 2 or 4 of
value) rather than looping over the width inside.

A decode kernel never raises: it returns a status, and a non-zero status sends
the tensor to the numpy decoder, which raises the precise error. Every read is
within the arrays it is handed (the stream sizes are checked against the header
before a kernel runs), so a hostile stream can fail a check but never read out
of bounds.

numba is imported when a kernel first runs (a trainer's first delta, a
replica's first decode), not with the package, so importing deltasync stays
light for the CLI and for tools that only read manifests.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..tensors import EXPONENT_SHIFT

__all__ = [
    "add_steps", "class_starts", "exponent_positions", "exponent_ranks", "gap_indices", "gap_payload", "rebuild",
    "put", "rice_rank_stream", "rice_ranks", "rice_word_stream", "rice_words", "step_payload", "take",
]


_JIT: Any = None


def _kernels() -> Any:
    global _JIT
    if _JIT is None:  # a module-level name: a kernel call costs no import lookup after the first
        from . import _jit  # noqa: PLC0415 - numba loads when a kernel first runs, see the module docstring

        _JIT = _jit
    return _JIT


def take(src: np.ndarray, indices: np.ndarray) -> np.ndarray | None:
    """``src[indices]`` for a flat ``src`` and int64 ``indices``; ``None`` if any index is out of range.

    A replica's base read at the changed elements: one cache miss per change, overlapped by hints below
    5 % density (:mod:`._gather`), which makes it faster than torch's ``index_select`` and than the same
    gather without hints (``benchmarks/README.md``, Measurements behind the code's choices).
    """
    out = np.empty(indices.size, dtype=src.dtype)
    return out if _kernels().take(src, indices, out) == 0 else None


def put(dst: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
    """``dst[indices] = values`` in place, for a flat ``dst``, int64 ``indices`` and ``values`` of ``dst``'s dtype.

    A CPU replica's write of a validated patch: on one core it beats torch's ``index_copy_`` and
    ``index_put_`` on two threads into weights not in cache (``benchmarks/device_sync.py``, its ``apply`` row).

    Raises:
        `ValueError`: ``values`` of another length or dtype; `IndexError`: an index out of range (every
            element before it is written: the caller's indices are validated, this is the last guard).
    """
    if values.shape != indices.shape or values.dtype != dst.dtype or indices.dtype != np.int64:
        raise ValueError(f"put: {values.size} values of {values.dtype} at {indices.size} {indices.dtype} indices "
                         f"into {dst.dtype}")
    if _kernels().put(dst, indices, values) != 0:
        raise IndexError(f"put: an index out of range [0, {dst.size})")


def gap_indices(raw: np.ndarray, nnz: int, iw: int, big: int, numel: int) -> np.ndarray | None:
    """Flat indices from ``raw`` (``nnz * iw`` bytes of gap planes, then ``8 * big`` of side gaps).

    Returns ``None`` when the escapes do not number ``big`` or an index reaches ``numel``.
    """
    if raw.size != nnz * iw + 8 * big:
        return None
    out = np.empty(nnz, dtype=np.int64)
    return out if _kernels().gap_indices(raw, nnz, iw, big, numel, out) == 0 else None


def rebuild(
    idx: np.ndarray, nnz: int, iw: int, big: int, numel: int, val: np.ndarray, src: np.ndarray, offset: int = 0
) -> tuple[np.ndarray, np.ndarray] | None:
    """A ``compact`` tensor's changes in one call: :func:`gap_indices` of ``idx``, the base read at ``offset``
    plus each index from ``src`` (a receiver's flat bit patterns, hinted ahead as :func:`take`), and
    :func:`add_steps` of ``val`` onto it.

    One loop per stream as the three kernels, without the calls, arrays and base counting pass between them.
    Returns ``(indices, new bit patterns)`` (signed, as ``src``), or ``None`` where :func:`gap_indices` would
    refuse the streams or the tensor's ``numel`` elements from ``offset`` do not fit in ``src``.
    """
    width = src.dtype.itemsize
    if idx.size != nnz * iw + 8 * big or val.size != nnz * width:
        return None
    indices = np.empty(nnz, dtype=np.int64)
    out = np.empty(nnz, dtype=src.dtype)  # the base read first, each overwritten by its new bits
    status = _kernels().rebuild(idx, nnz, iw, big, numel, val, width, _mantissa(src), src, offset, indices, out)
    return (indices, out) if status == 0 else None


def add_steps(raw: np.ndarray, base: np.ndarray) -> np.ndarray:
    """New bit patterns (signed, as ``base``): ``base`` plus the unzigzagged words of ``raw``.

    ``raw`` holds ``base.size`` words of ``base``'s width as byte planes, in the order
    of a stable sort of the changes by the exponent byte of ``base``.
    """
    width, nnz = base.dtype.itemsize, base.size
    if raw.size != nnz * width:
        raise ValueError(f"add_steps: {raw.size} bytes of planes for {nnz} words of {width} bytes")
    out = np.empty(nnz, dtype=base.dtype)
    _kernels().add_steps(raw, nnz, width, _mantissa(base), base, out)
    return out


def exponent_ranks(bits: np.ndarray, indices: np.ndarray, starts: np.ndarray | None = None) -> np.ndarray:
    """The rank of each of ``indices`` (sorted, unique, in range) in the exponent order of ``bits``.

    The exponent order lists a tensor's elements by the exponent byte of their bit
    patterns, then by index (``docs/FORMAT.md``, ``compact-exp``); one counting pass
    (or ``starts``, :func:`class_starts` of ``bits``, where the caller has it) and one
    walk over ``bits``, no sort.
    """
    bits = np.ascontiguousarray(bits)
    starts = class_starts(bits) if starts is None else starts
    out = np.empty(indices.size, dtype=np.int64)
    if _kernels().exponent_ranks(bits, _mantissa(bits), starts, np.ascontiguousarray(indices, dtype=np.int64), out):
        raise ValueError("exponent_ranks: indices must be sorted, unique and within the tensor")
    return out


def exponent_positions(
    bits: np.ndarray, ranks: np.ndarray, starts: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """Inverse of :func:`exponent_ranks` for sorted ``ranks`` below ``bits.size``.

    ``starts`` is :func:`class_starts` of ``bits`` where the caller has it already (it saves a pass).

    Returns:
        `(indices, slots)` or ``None``: the elements of those ranks in index order, and
            where each of them sits in ``ranks``; ``None`` if a rank is out of range.
    """
    bits = np.ascontiguousarray(bits)
    starts = class_starts(bits) if starts is None else starts
    indices = np.empty(ranks.size, dtype=np.int64)
    slots = np.empty(ranks.size, dtype=np.int64)
    if _kernels().exponent_positions(bits, _mantissa(bits), starts, ranks, indices, slots):
        return None
    return indices, slots


def _mantissa(bits: np.ndarray) -> int:
    """Mantissa bits of the float type whose bit patterns ``bits`` holds (1, 2 or 4 bytes)."""
    if bits.dtype.itemsize not in EXPONENT_SHIFT:
        raise ValueError(f"no exponent byte in {bits.dtype.itemsize}-byte words")
    return EXPONENT_SHIFT[bits.dtype.itemsize]


def gap_payload(indices: np.ndarray) -> tuple[np.ndarray, int, int]:
    """The ``compact`` index payload of sorted unique ``indices``: gap planes in the width (1, 2 or 4 bytes)
    that minimises ``nnz * width + 8 * escapes`` (ties to the narrower), then the side gaps; two passes.

    Returns:
        `(payload, iw, big)`: the bytes to compress, the gap width and the escape count.
    """
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    counts = np.zeros(3, dtype=np.int64)
    if _kernels().gap_counts(indices, counts):
        raise ValueError("gap_payload: indices must be sorted and unique")
    _, iw, big = min((indices.size * width + 8 * int(n), width, int(n)) for width, n in zip((1, 2, 4), counts))
    payload = np.empty(indices.size * iw + 8 * big, dtype=np.uint8)
    _kernels().gap_planes(indices, iw, payload)
    return payload, iw, big


def step_payload(new: np.ndarray, base: np.ndarray) -> np.ndarray:
    """Inverse of :func:`add_steps`: the byte planes of ``zigzag(new - base)`` (modulo ``2**bits``), in the
    stable order of the changes by the exponent byte of ``base``."""
    width = base.dtype.itemsize
    if new.shape != base.shape or new.dtype.itemsize != width:
        raise ValueError("step_payload: new and base values differ in shape or width")
    out = np.empty(base.size * width, dtype=np.uint8)
    _kernels().step_planes(np.ascontiguousarray(new), np.ascontiguousarray(base), width, _mantissa(base), out)
    return out


def class_starts(bits: np.ndarray) -> np.ndarray:
    """Per exponent byte ``c`` of ``bits`` (2- or 4-byte patterns), its first rank in the exponent order: 257
    int64, the last the element count, so class ``c`` holds ``starts[c + 1] - starts[c]`` elements."""
    bits = np.ascontiguousarray(bits)
    mask = (1 << (8 * bits.dtype.itemsize)) - 1
    return _kernels().class_starts(bits, mask, _mantissa(bits))


def rice_rank_stream(ranks: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The ``exp-rice`` index stream of sorted unique ``ranks`` (below ``starts[256]``), by class."""
    ranks = np.ascontiguousarray(ranks, dtype=np.int64)
    if ranks.size and (ranks[0] < 0 or ranks[-1] >= starts[256] or np.any(ranks[1:] <= ranks[:-1])):
        raise ValueError("rice_rank_stream: ranks must be sorted, unique and below the element count")
    return _kernels().rice_rank_stream(ranks, np.ascontiguousarray(starts, dtype=np.int64))


def rice_ranks(raw: np.ndarray, starts: np.ndarray, nnz: int) -> tuple[np.ndarray, np.ndarray] | str:
    """Inverse of :func:`rice_rank_stream`: ``(ranks, changes per class)``, or what is wrong with the stream
    (malformed, or not exactly ``nnz`` changes)."""
    ranks = np.empty(nnz, dtype=np.int64)
    changed = np.zeros(256, dtype=np.int64)
    status = _kernels().rice_ranks(raw, np.ascontiguousarray(starts, dtype=np.int64), nnz, ranks, changed)
    return (ranks, changed) if status == 0 else _kernels().RICE_PROBLEMS[status]


def rice_word_stream(words: np.ndarray, changed: np.ndarray, width: int) -> np.ndarray:
    """The ``exp-rice`` value stream of ``words`` (int64 below ``2**width``, in rank order); ``changed[c]`` of
    them belong to class ``c``."""
    words = np.ascontiguousarray(words, dtype=np.int64)
    if int(changed.sum()) != words.size:
        raise ValueError("rice_word_stream: the class counts do not add up to the words")
    return _kernels().rice_word_stream(words, np.ascontiguousarray(changed, dtype=np.int64), width)


def rice_words(raw: np.ndarray, changed: np.ndarray, width: int) -> np.ndarray | str:
    """Inverse of :func:`rice_word_stream`: the int64 words, or what is wrong with the stream."""
    out = np.empty(int(changed.sum()), dtype=np.int64)
    status = _kernels().rice_words(raw, np.ascontiguousarray(changed, dtype=np.int64), width, out)
    return out if status == 0 else _kernels().RICE_PROBLEMS[status]
