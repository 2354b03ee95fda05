"""``exp-rice``: ``compact-exp``'s positions and steps, each exponent class Rice-coded with its own parameter.

``compact-exp`` already codes each change's position among the elements of its
base exponent, but zstd codes all of a tensor's gaps, and all of its steps, with
one order-0 table. The classes differ: in a real RL step the smallest weights
of a tensor change nine times in ten and move by tens of units in the last
place, the largest change one time in a hundred and move by exactly one. One
table for all of them costs well above the entropy of each class on its own
(``benchmarks/payload.py`` prints that floor).

So this codec codes every class on its own terms, with a one-byte field per
class and plain Rice codes (no entropy coder state, a few lines to decode):

- positions: per class, none changed, all changed, or the gaps between the
  changed positions (or, where more than half changed, the unchanged ones) as
  Rice codes with the class's best parameter;
- steps: per class, each change's zigzag step less one (the sign lands in the
  low bit) as a Rice code with the class's best parameter, or in a fixed number
  of bits where that is smaller (one bit each for a class that only moves by
  one unit: just the sign).

Rice codes cannot see that a class moves by a few recurring amounts, which is
how an optimizer's first steps look; zstd can. So per tensor, each stream is
whichever of the two codings is smaller: the Rice stream, or ``compact-exp``'s
zstd stream (flagged by the params ``iz`` and ``vz``).

On SmolLM2 RL steps that takes fewer bytes per change than ``compact-exp``, near
the exponent-conditioned floor (``benchmarks/payload.py``, tabled in
``benchmarks/README.md``). Like ``compact-exp`` it
costs both sides an O(numel) pass per changed tensor and version, and the
reader reads every base element: a codec for slow links, never the default.
``docs/FORMAT.md`` specifies both streams to the bit. The value digest is
``compact``'s, over the new bit patterns in index order: a receiver whose base
differs from the writer's decodes other positions or values, and the digest
refuses that before anything is written.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CodecError
from ..tensors import TensorChange, TensorSpec
from ._zstd import compress, decompress
from .base import BaseLookup, Decoded, Encoded, Params, Parts, check_part, to_numpy
from .compact import UNSIGNED, decode_indices, encode_indices, planes, sign_values, unplanes
from .kernels import class_starts, rice_rank_stream, rice_ranks, rice_word_stream, rice_words
from .ranked import CompactExpCodec, ranked_steps, rebuild, whole_base

__all__ = ["ExpRiceCodec"]


class ExpRiceCodec(CompactExpCodec):
    """Per exponent class of the base, Rice-coded position gaps and value steps; per tensor and stream, the
    ``compact-exp`` zstd stream instead where that is smaller."""

    name = "exp-rice"

    def encode(self, change: TensorChange, *, level: int) -> Encoded:
        assert change.whole_base is not None
        starts = class_starts(to_numpy(change.whole_base).reshape(-1))
        ranks, steps = ranked_steps(change, starts)
        width = steps.dtype.itemsize
        params: dict[str, object] = {}
        idx: np.ndarray = rice_rank_stream(ranks, starts)
        zstd_idx, gap_params = encode_indices(ranks, level)
        if zstd_idx.size < idx.size:
            idx = zstd_idx
            params.update(iz=1, **gap_params)
        val: np.ndarray = rice_word_stream(
            (steps.astype(np.int64) - 1) & ((1 << 8 * width) - 1),  # the sign in the low bit
            _per_class(ranks, starts),
            8 * width,
        )
        zstd_val = compress(planes(steps), level)
        if zstd_val.size < val.size:
            val = zstd_val
            params["vz"] = 1
        sign_values(params, to_numpy(change.values))  # in index order, as compact's
        return Encoded(parts={"idx": torch.from_numpy(idx), "val": torch.from_numpy(val)}, params=params)

    def decode(self, parts: Parts, params: Params, spec: TensorSpec, nnz: int, base: BaseLookup | None) -> Decoded:
        if base is None:
            raise CodecError(f"{spec.name}: codec {self.name!r} needs the receiver's current values", name=spec.name)
        zstd_idx, zstd_val = _flag(params, "iz", spec), _flag(params, "vz", spec)
        idx_raw = np.ascontiguousarray(to_numpy(check_part(parts, "idx", torch.uint8, None, spec)))
        val_raw = np.ascontiguousarray(to_numpy(check_part(parts, "val", torch.uint8, None, spec)))
        width = spec.torch_dtype.itemsize
        base_all = whole_base(base, spec)
        starts = class_starts(base_all)
        if zstd_idx:
            ranks = decode_indices(idx_raw, params, spec, nnz)  # strictly increasing, below numel
            changed = _per_class(ranks, starts)
        else:
            found = rice_ranks(idx_raw, starts, nnz)
            if isinstance(found, str):
                raise CodecError(f"{spec.name}::idx is malformed: {found}", name=spec.name, part="idx")
            ranks, changed = found
        if zstd_val:
            steps = unplanes(decompress(val_raw, nnz * width, f"{spec.name}::val"), nnz, UNSIGNED[width])
        else:
            words = rice_words(val_raw, changed, 8 * width)
            if isinstance(words, str):
                raise CodecError(f"{spec.name}::val is malformed: {words}", name=spec.name, part="val")
            steps = ((words + 1) & ((1 << 8 * width) - 1)).astype(UNSIGNED[width])
        return rebuild(base_all, ranks, steps, params, spec, starts)


def _per_class(ranks: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """How many of the sorted ``ranks`` fall in each exponent class (``starts``: :func:`~.kernels.class_starts`)."""
    return np.diff(np.searchsorted(ranks, starts))


def _flag(params: Params, key: str, spec: TensorSpec) -> bool:
    """A stream's coding: param ``key`` absent or 0 for Rice codes, 1 for ``compact-exp``'s zstd stream."""
    value = params.get(key, 0)
    if type(value) is not int or value not in (0, 1):
        raise CodecError(f"{spec.name}: param {key!r} must be 0 or 1, not {value!r:.20}", name=spec.name)
    return value == 1
