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
SmolLM2 RL steps a version takes 0.84 bytes per changed element against
``compact``'s 1.43 (``benchmarks/payload.py``).

The price is an O(numel) pass on both sides per changed tensor and version:
the writer and the reader each count the whole tensor's exponents and walk it
once more (compiled kernels of :mod:`.kernels`, about a nanosecond per element),
and the reader reads every base element. That is a codec a user picks
for slow links, not the default. A reader whose base differs from the
writer's decodes other positions; the values' digest (``sum``, as in
``compact``) refuses that before anything is written.
"""

from __future__ import annotations

import numpy as np
import torch

from ..diff import TensorChange
from ..errors import CodecError
from ..tensors import TensorSpec
from ._zstd import compress, decompress
from .base import BaseLookup, Decoded, Encoded, Params, Parts, check_part, to_numpy
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

__all__ = ["CompactExpCodec"]


class CompactExpCodec(CompactCodec):
    """Ranks in the base's exponent order, gap-coded; base-relative zigzag values; byte planes; zstd."""

    name = "compact-exp"
    needs_base = True

    def supports(self, change: TensorChange) -> bool:
        return not change.dense and change.whole_base is not None

    def encode(self, change: TensorChange, *, level: int) -> Encoded:
        assert change.indices is not None and change.base is not None and change.whole_base is not None
        base_all = to_numpy(change.whole_base).reshape(-1)
        indices = to_numpy(change.indices)
        ranks = exponent_ranks(base_all, indices)
        by_rank = ranks.argsort(kind="stable")
        blob, params = encode_indices(ranks[by_rank], level)
        new, base = to_numpy(change.values), to_numpy(change.base)
        unsigned = UNSIGNED[new.dtype.itemsize]
        steps = zigzag((new.view(unsigned) - base.view(unsigned)).view(new.dtype)[by_rank])
        sign_values(params, new)  # in index order, as compact's
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
        base_all = np.ascontiguousarray(base(spec.name, np.arange(spec.numel, dtype=np.int64)))
        if base_all.shape != (spec.numel,) or base_all.dtype.itemsize != width:
            raise CodecError(f"{spec.name}: base lookup returned the wrong shape", name=spec.name)
        found = exponent_positions(base_all, ranks)
        if found is None:  # unreachable for ranks below numel, which decode_indices proved
            raise CodecError(f"{spec.name}: rank out of range [0, {spec.numel})", name=spec.name)
        indices, slots = found
        unsigned = UNSIGNED[width]
        values = (base_all[indices].view(unsigned) + unzigzag(steps[slots]).view(unsigned)).view(SIGNED[width])
        check_values(values, params, spec)
        return Decoded(indices, values)
