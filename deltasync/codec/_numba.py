"""How deltasync's host kernels are compiled (numba: no GIL, cached on disk) and what they return.

Imported with the kernels, when one first runs (:mod:`.kernels`), never with the package.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

OK, BAD_ESCAPES, OUT_OF_RANGE = 0, 1, 2
"""What a kernel returns: done, an escape count that differs from the params, an index or rank out of range."""


U = np.uint64
"""An index the kernel knows is non-negative, cast with ``U(i)``: numba then leaves out its handling of negative
indices (a sign test and a reload on every access), a real share of a rebuild's hot loops. Only where the
kernel's own checks prove the index is within the array: unlike a wrapped negative index, a wrong one reads
outside it."""


def jit(fn: Any) -> Any:
    """Compile ``fn`` without the GIL, cached on disk where numba finds a writable place for it (beside this
    file, ``NUMBA_CACHE_DIR``, the user's cache); where it finds none, compiled again in each process."""
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return numba.njit(nogil=True, boundscheck=False)(fn)


def inline(fn: Any) -> Any:
    """A loop body compiled into each caller. Called with a literal (a width, a flag), the compiler drops the
    loops and branches that literal decides: a specialised copy per width, faster than one loop over the
    width."""
    return numba.njit(inline="always", boundscheck=False)(fn)
