"""Compiled host kernels for ``compact``, ``compact-abs`` and ``compact-exp``: a pass or two per stream.

The numpy decoder (:class:`~deltasync.codec.compact.CompactCodec`) rebuilds a
tensor's changes in some twenty array passes (plane merge, escape search,
widening, prefix sum, exponent sort, zigzag, sum), each a trip through memory
and most with a fresh int64 temporary; the encoder took about as many. These
kernels do the same work in one or two loops per stream, compiled once by numba
(cached on disk) and run without the GIL:

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
- :func:`take`: a CPU replica's read of its weights at the changed indices (the
  base a ``compact`` value is relative to), every index checked.

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

__all__ = ["add_steps", "exponent_positions", "exponent_ranks", "gap_indices", "gap_payload", "step_payload", "take"]


def _kernels() -> Any:
    from . import _jit  # noqa: PLC0415 - numba loads when a kernel first runs, see the module docstring

    return _jit


def take(src: np.ndarray, indices: np.ndarray) -> np.ndarray | None:
    """``src[indices]`` for a flat ``src`` and int64 ``indices``; ``None`` if any index is out of range.

    A replica's base read at the changed elements: one cache miss per change, 17 % faster per change
    than torch's ``index_select`` on one core (9.8 against 11.7 ns, 2M-element tensors at 1 %).
    """
    out = np.empty(indices.size, dtype=src.dtype)
    return out if _kernels().take(src, indices, out) == 0 else None


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
    patterns, then by index (``docs/FORMAT.md``, ``compact-exp``); one counting pass
    and one walk over ``bits``, no sort.
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
