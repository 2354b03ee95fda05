"""``compact`` and ``compact-abs`` decoded on the host, a chunk of tensors per task.

Each tensor's streams are rebuilt by the compiled kernels of :mod:`.kernels`
without the GIL. Where the receiver holds the tensor whole on the CPU (its
lookup a :class:`~.base.FlatLookup`), one call does it all (:func:`~.kernels.rebuild`:
the gap planes decoded a little ahead of the base reads, each read hinted, then
the values added in one pass); elsewhere the indices, the receiver's read of its
base and the values are three steps. Only zstd and the BLAKE3 check run between
the calls. Tensors are grouped into chunks of
up to :data:`CHUNK` of work (changed elements, and :data:`~deltasync.util.threads.TENSOR_COST` for each
tensor) so the decode threads take a few large, evenly weighed tasks each
instead of hundreds of small ones.

The checks are the per-tensor decoder's: escape counts, indices in bounds, the
base lookup's shape, every value digest. A chunk that fails any of them is
decoded again tensor by tensor by that decoder
(:class:`~deltasync.codec.compact.CompactCodec`), so that a hostile or
mismatched tensor is refused with exactly its error, and its neighbours decode
as they would alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from ..errors import DeltaSyncError
from ..util.threads import TENSOR_COST
from .base import BaseLookup, Decoded, FlatLookup
from .compact import SIGNED, UNSIGNED, check_values, unplanes
from .device import Streams
from .kernels import add_steps, gap_indices, rebuild

__all__ = ["CHUNK", "decode_chunk", "chunks", "work"]

CHUNK = 1 << 18
"""Work per chunk (per task of the decode threads), in changed elements with
:data:`~deltasync.util.threads.TENSOR_COST` added for each tensor: 12 tensors of 20K changes each in ``device_sync``."""


class _Refused(Exception):
    """A check failed somewhere in the chunk: decode it tensor by tensor for the exact error."""


def work(sizes: Sequence[int]) -> int:
    """What tensors of ``sizes`` changed elements cost to decode, in changed elements."""
    return sum(sizes) + TENSOR_COST * len(sizes)


def chunks(sizes: Sequence[int], kinds: Sequence[Hashable]) -> list[list[int]]:
    """Positions grouped into chunks of one kind (``kinds``: what may share a chunk), in file order, of up to
    :data:`CHUNK` of :func:`work` each (``sizes``: changed elements; a larger tensor is a chunk of its own)."""
    runs: list[list[int]] = []
    open_run: dict[Hashable, tuple[list[int], int]] = {}  # per kind: the run being filled, and its work
    for k, (size, kind) in enumerate(zip(sizes, kinds)):
        run, filled = open_run.get(kind, ([], 0))
        cost = work((size,))
        if not run or filled + cost > CHUNK:
            run, filled = [], 0
            runs.append(run)
        run.append(k)
        open_run[kind] = (run, filled + cost)
    return runs


def decode_chunk(items: Sequence[Streams], base: BaseLookup | None) -> list[Decoded] | None:
    """Every tensor of one chunk (see :func:`chunks`), slice-relative; ``None`` when any check fails.

    The caller decodes a refused chunk tensor by tensor, which raises the precise error.
    """
    try:
        return _decode(items, base)
    except (_Refused, DeltaSyncError):
        return None


def _decode(items: Sequence[Streams], base: BaseLookup | None) -> list[Decoded]:
    out = []
    flat = base.flat if isinstance(base, FlatLookup) else None
    # Every tensor's flat view first, its few torch calls one after another: made between two rebuilds, each of
    # which streams megabytes of weights through the caches, they would run cold, at several times the cost.
    sources = [flat(item.name) if flat is not None and item.base_relative else None for item in items]
    for item, src in zip(items, sources):
        width = item.spec.torch_dtype.itemsize
        if src is not None and src.dtype.itemsize == width:  # the base read inside the one compiled call
            rebuilt = rebuild(np.frombuffer(item.idx, dtype=np.uint8), item.nnz, item.iw, item.big, item.spec.numel,
                              np.frombuffer(item.val, dtype=np.uint8), src, item.offset)
            if rebuilt is None:
                raise _Refused
            check_values(rebuilt[1], item.params, item.spec)
            out.append(Decoded(*rebuilt))
            continue
        indices = gap_indices(np.frombuffer(item.idx, dtype=np.uint8), item.nnz, item.iw, item.big, item.spec.numel)
        if indices is None:
            raise _Refused  # an escape count or an index the per-tensor decoder names
        raw = np.frombuffer(item.val, dtype=np.uint8)
        if item.base_relative:
            if base is None:
                raise _Refused  # the per-tensor decoder says which tensor needs a base
            got = np.ascontiguousarray(base(item.name, indices + item.offset if item.offset else indices))
            if got.shape != (item.nnz,) or got.dtype.itemsize != width:
                raise _Refused
            values = add_steps(raw, got.view(SIGNED[width]))
        else:
            values = unplanes(item.val, item.nnz, UNSIGNED[width]).view(SIGNED[width])
        check_values(values, item.params, item.spec)  # an IntegrityError refuses the chunk
        out.append(Decoded(indices, values))
    return out
