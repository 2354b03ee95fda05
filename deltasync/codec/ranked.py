"""``compact-exp``: ``compact`` with each change's position coded among the elements of its base exponent.

A receiver knows the bf16 exponent of every element it holds, and an optimizer
step flips small weights far more often than large ones: in real RL steps the
changes of one exponent class are many times denser than the tensor's average.
So positions are coded in the *exponent order* of the base: all elements of
exponent 0 (in index order), then all of exponent 1, and so on. A change's
**rank** is its place in that order; the sorted ranks are gap-coded exactly as
``compact`` codes indices, and the values follow in rank order as ``compact``'s
base-relative zigzag words. Gaps inside a dense class are short, so the index
stream shrinks towards the entropy of the changes given the exponents: on
SmolLM2 RL steps a version takes far fewer bytes per changed element than
``compact`` (``benchmarks/payload.py``, tabled in ``benchmarks/README.md``).

The price is an O(numel) pass on both sides per changed tensor and version:
the writer and the reader each count the whole tensor's exponents and walk it
once more (compiled kernels of :mod:`.kernels`), and the reader reads every
base element. That is a codec a user picks
for slow links, not the default. A reader whose base differs from the
writer's decodes other positions; the values' digest (``sum``, as in
``compact``) refuses that before anything is written.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CodecError
from ..tensors import TensorChange, TensorSpec
from ._zstd import compress, decompress
from .base import BaseLookup, Decoded, Encoded, FlatLookup, Params, Parts, check_part, to_numpy
from .compact import (
    SIGNED,
    UNSIGNED,
    CompactCodec,
    check_values,
    decode_indices,
    encode_indices,
    planes,
    sign_values,
    unplanes,
    unzigzag,
    zigzag,
)
from .kernels import exponent_positions, exponent_ranks

__all__ = ["CompactExpCodec", "ranked_steps", "rebuild", "whole_base"]


class CompactExpCodec(CompactCodec):
    """Ranks in the base's exponent order, gap-coded; base-relative zigzag values; byte planes; zstd."""

    name = "compact-exp"
    needs_base = True

    def supports(self, change: TensorChange) -> bool:
        return not change.dense and change.whole_base is not None

    def encode(self, change: TensorChange, *, level: int) -> Encoded:
        ranks, steps = ranked_steps(change)
        blob, params = encode_indices(ranks, level)
        sign_values(params, to_numpy(change.values))  # in index order, as compact's
        return Encoded(
            parts={"idx": torch.from_numpy(blob), "val": torch.from_numpy(compress(planes(steps), level))},
            params=params,
        )

    def decode(self, parts: Parts, params: Params, spec: TensorSpec, nnz: int, base: BaseLookup | None) -> Decoded:
        if base is None:
            raise CodecError(f"{spec.name}: codec {self.name!r} needs the receiver's current values", name=spec.name)
        idx_blob = to_numpy(check_part(parts, "idx", torch.uint8, None, spec))
        val_blob = to_numpy(check_part(parts, "val", torch.uint8, None, spec))
        ranks = decode_indices(idx_blob, params, spec, nnz)  # strictly increasing, below numel
        width = spec.torch_dtype.itemsize
        steps = unplanes(decompress(val_blob, nnz * width, f"{spec.name}::val"), nnz, UNSIGNED[width])
        return rebuild(whole_base(base, spec), ranks, steps, params, spec)


def ranked_steps(change: TensorChange, starts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The changes' ranks in the exponent order of their whole base, ascending, and their zigzag steps
    (unsigned words) in that order. ``starts``: :func:`~.kernels.class_starts` of the base, where known."""
    assert change.indices is not None and change.base is not None and change.whole_base is not None
    ranks = exponent_ranks(to_numpy(change.whole_base).reshape(-1), to_numpy(change.indices), starts)
    by_rank = ranks.argsort(kind="stable")
    new, base = to_numpy(change.values), to_numpy(change.base)
    unsigned = UNSIGNED[new.dtype.itemsize]
    return ranks[by_rank], zigzag((new.view(unsigned) - base.view(unsigned)).view(new.dtype)[by_rank])


WHOLE_CHUNK = 1 << 18
"""Elements per base read of :func:`whole_base`: its index array stays in cache, where an index array of the
whole tensor would add 8 bytes of memory traffic per element, twice."""


def whole_base(base: BaseLookup, spec: TensorSpec) -> np.ndarray:
    """Every element of the receiver's tensor ``spec``, as bit patterns: what an exponent-ranked codec reads.

    A receiver that holds the tensor whole on the host (a :class:`~.base.FlatLookup` with a ``flat`` view of
    it) hands over its weights themselves, read in place: nothing writes them while a file decodes, and copying
    them would be a large share of an ``exp-rice`` decode. Other lookups are read a chunk at a time
    (:data:`WHOLE_CHUNK`), each chunk's shape checked.
    """
    width, numel = spec.torch_dtype.itemsize, spec.numel
    flat = base.flat(spec.name) if isinstance(base, FlatLookup) else None
    if flat is not None and flat.shape == (numel,) and flat.dtype.itemsize == width:
        return flat.view(SIGNED[width])
    out = np.empty(numel, dtype=SIGNED[width])
    for start in range(0, numel, WHOLE_CHUNK):
        stop = min(start + WHOLE_CHUNK, numel)
        got = np.asarray(base(spec.name, np.arange(start, stop, dtype=np.int64)))
        if got.shape != (stop - start,) or got.dtype.itemsize != width:
            raise CodecError(f"{spec.name}: base lookup returned the wrong shape", name=spec.name)
        out[start:stop] = got.view(out.dtype)  # bit patterns, whatever integer type the lookup gave
    return out


def rebuild(
    base_all: np.ndarray, ranks: np.ndarray, steps: np.ndarray, params: Params, spec: TensorSpec,
    starts: np.ndarray | None = None,
) -> Decoded:
    """The changes at sorted ``ranks`` (below ``spec.numel``) with zigzag ``steps`` in rank order, added to
    ``base_all`` and checked against the value digest in ``params``."""
    found = exponent_positions(base_all, ranks, starts)
    if found is None:  # unreachable for ranks below numel, which the rank decoders prove
        raise CodecError(f"{spec.name}: rank out of range [0, {spec.numel})", name=spec.name)
    indices, slots = found
    width = base_all.dtype.itemsize
    unsigned = UNSIGNED[width]
    values = (base_all[indices].view(unsigned) + unzigzag(steps[slots]).view(unsigned)).view(SIGNED[width])
    check_values(values, params, spec)
    return Decoded(indices, values)
