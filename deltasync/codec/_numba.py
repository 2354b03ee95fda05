"""How deltasync's host kernels are compiled (numba: no GIL, cached on disk) and what they return.

Imported with the kernels, when one first runs (:mod:`.kernels`), never with the package.
"""

from __future__ import annotations

from typing import Any

import numba

OK, BAD_ESCAPES, OUT_OF_RANGE = 0, 1, 2
"""What a kernel returns: done, an escape count that differs from the params, an index or rank out of range."""


def jit(fn: Any) -> Any:
    """Compile ``fn`` without the GIL, cached on disk where numba finds a writable place for it (beside this
    file, ``NUMBA_CACHE_DIR``, the user's cache); where it finds none, compiled again in each process."""
    try:
        return numba.njit(nogil=True, cache=True, boundscheck=False)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return numba.njit(nogil=True, boundscheck=False)(fn)


def inline(fn: Any) -> Any:
    """A loop body compiled into each caller. Called with a literal (a width, a flag), the compiler drops the
    loops and branches that literal decides: a specialised copy per width, about 1.5x faster than one loop
    over the width."""
    return numba.njit(inline="always", boundscheck=False)(fn)
