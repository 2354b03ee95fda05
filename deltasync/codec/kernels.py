"""Compiled host kernels for ``compact`` and ``compact-abs``: one pass per stream, no temporaries.

The numpy decoder (:class:`~deltasync.codec.compact.CompactCodec`) rebuilds a
tensor's changes in some twenty array passes (plane merge, escape search,
widening, prefix sum, exponent sort, zigzag, sum), each a trip through memory
and most with a fresh int64 temporary. These kernels do the same work in two
loops per tensor, compiled once by numba (cached on disk) and run without the
GIL, so the decode threads scale:

- :func:`gap_indices`: byte planes merged, escapes resolved from the side
  stream, gaps summed into indices, every index bounds-checked as it is made;
- :func:`add_steps`: the receiver's base bits at those indices bucketed by
  exponent byte (the counting sort the encoder's stable exponent order is), each
  value word merged from its planes at its bucket's next slot, unzigzagged and
  added to the base modulo ``2**bits``.

A kernel never raises: it returns a status, and a non-zero status sends the
tensor to the numpy decoder, which raises the precise error. Every read is
within the arrays it is handed (the stream sizes are checked against the header
before a kernel runs), so a hostile stream can fail a check but never read out
of bounds.

numba is imported on the first decode, not with the package: a publisher that
never decodes never pays its import or compile time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["gap_indices", "add_steps", "exponent_ranks", "exponent_positions"]


def _kernels() -> Any:
    from . import _jit  # noqa: PLC0415 - numba loads on the first decode, see the module docstring

    return _jit


def gap_indices(raw: np.ndarray, nnz: int, iw: int, big: int, numel: int) -> np.ndarray | None:
    """Flat indices from ``raw`` (``nnz * iw`` bytes of gap planes, then ``8 * big`` of side gaps).

    Returns ``None`` when the escapes do not number ``big`` or an index reaches ``numel``.
    """
    if raw.size != nnz * iw + 8 * big:
        return None
    out = np.empty(nnz, dtype=np.int64)
    return out if _kernels().gap_indices(raw, nnz, iw, big, numel, out) == 0 else None


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


def exponent_ranks(bits: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The rank of each of ``indices`` (sorted, unique, in range) in the exponent order of ``bits``.

    The exponent order lists a tensor's elements by the exponent byte of their bit
    patterns, then by index (:func:`deltasync.codec.ranked.exponent_order`); one
    counting pass and one walk over ``bits``, no sort.
    """
    bits = np.ascontiguousarray(bits)
    out = np.empty(indices.size, dtype=np.int64)
    if _kernels().exponent_ranks(bits, _mantissa(bits), np.ascontiguousarray(indices, dtype=np.int64), out):
        raise ValueError("exponent_ranks: indices must be sorted, unique and within the tensor")
    return out


def exponent_positions(bits: np.ndarray, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Inverse of :func:`exponent_ranks` for sorted ``ranks`` below ``bits.size``.

    Returns:
        `(indices, slots)` or ``None``: the elements of those ranks in index order, and
            where each of them sits in ``ranks``; ``None`` if a rank is out of range.
    """
    bits = np.ascontiguousarray(bits)
    indices = np.empty(ranks.size, dtype=np.int64)
    slots = np.empty(ranks.size, dtype=np.int64)
    if _kernels().exponent_positions(bits, _mantissa(bits), ranks, indices, slots):
        return None
    return indices, slots


def _mantissa(bits: np.ndarray) -> int:
    """Mantissa bits of the float type whose bit patterns ``bits`` holds (2 or 4 bytes)."""
    if bits.dtype.itemsize not in (2, 4):
        raise ValueError(f"no exponent byte in {bits.dtype.itemsize}-byte words")
    return 7 if bits.dtype.itemsize == 2 else 23
