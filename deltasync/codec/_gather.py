"""A CPU replica's read of its weights at the changed indices (:func:`take`), hinted ahead where it is sparse,
and its write of the new bit patterns there (:func:`put`).

Part of the compiled kernels behind :mod:`.kernels`; every index is checked before it is read or written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._numba import OK, OUT_OF_RANGE, U, inline, jit

AHEAD = 192
"""How many changes ahead :func:`take` (and ``rebuild``) ask for their next reads. A replica's weights are
far larger than the caches, so at RL densities each change's read misses; hinted this far ahead, the misses
overlap instead of waiting in turn. The distance is the best of those compared from 64 to 512 ahead over sparse
random reads (``benchmarks/README.md``, Measurements behind the code's choices). The lines in flight are a few
kB: far below any level of cache."""

SPARSE = 20
""":func:`take` hints its reads when fewer than one element in ``SPARSE`` is read (below 5 % density). Denser
reads stream through memory that the CPU's own prefetcher already fetches in order; hints there only cost
instructions and slow the read."""


@intrinsic
def _prefetch(typingctx: Any, array: Any, index: Any) -> Any:
    """Hint the CPU to bring ``array[index]`` into its caches (LLVM's ``prefetch``: for a read, kept in
    every level). A hint, not a load: it never faults and the loop does not wait for it."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        at = cgutils.get_item_pointer(context, builder, array_type, view, [args[1]], wraparound=False)
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        hint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), "llvm.prefetch.p0i8"
        )
        builder.call(hint, [builder.bitcast(at, byte_ptr), i32(0), i32(3), i32(1)])  # read, keep, data
        return context.get_dummy_value()

    return types.void(array, index), codegen


@inline
def _gather(src: Any, indices: Any, out: Any, hinted: bool) -> int:
    size = src.size
    count = indices.size
    for j in range(count):
        if hinted and j + AHEAD < count:
            later = indices[U(j + AHEAD)]
            if later >= 0 and later < size:  # only valid elements are hinted (a hostile index is refused below)
                _prefetch(src, U(later))
        at = indices[U(j)]
        if at < 0 or at >= size:
            return OUT_OF_RANGE
        out[U(j)] = src[U(at)]
    return OK


@jit
def _take_hinted(src: Any, indices: Any, out: Any) -> int:
    if indices.size * SPARSE < src.size:
        return _gather(src, indices, out, True)
    return _gather(src, indices, out, False)


@jit
def _take_plain(src: Any, indices: Any, out: Any) -> int:
    return _gather(src, indices, out, False)


def _pick_take() -> Any:
    """:func:`_take_hinted` where this numba and LLVM compile the hint, else :func:`_take_plain`: the same
    reads without it."""
    probe = np.zeros(SPARSE + 1, np.int16)
    try:
        _take_hinted(probe, np.zeros(1, np.int64), np.empty(1, np.int16))
    except Exception:  # noqa: BLE001 - a compiler that cannot lower the hint, whatever it raises
        return _take_plain
    return _take_hinted


take = _pick_take()


@jit
def put(dst: Any, indices: Any, values: Any) -> int:
    """``dst[indices] = values`` in order, up to the first index out of range (``OUT_OF_RANGE``).

    Unhinted: a write that misses waits in the store buffer, not in the loop, so a hint gains nothing here."""
    size = dst.size
    for j in range(indices.size):
        at = indices[U(j)]
        if at < 0 or at >= size:
            return OUT_OF_RANGE
        dst[U(at)] = values[U(j)]
    return OK


@inline
def _no_hint(array: Any, index: Any) -> None:
    """Where the hint does not compile: nothing (the reads wait in turn)."""


hint = _prefetch if take is _take_hinted else _no_hint
"""What other kernels call to hint a read ahead (``hint(array, index)``, ``index`` within ``array``): the
CPU's prefetch where this numba lowers it, else nothing."""
