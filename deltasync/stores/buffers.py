"""Memory for large reads: where an object read whole (not mapped) lands before it is verified and used.

A buffer the size of an anchor's part is new memory, and on many machines a read into
new memory costs more in page faults than in copying: the kernel traps once per 4 KiB
page it hands out. :func:`fresh_buffer` asks for large buffers in 2 MiB pages instead
(transparent huge pages, ``MADV_HUGEPAGE``), so a read faults once per 2 MiB and
runs markedly faster (``benchmarks/device_sync.py`` measures the path as "anchor
load, copied": the path of network filesystems and of a replica's read-through cache).

The kernel honours the advice under transparent huge pages' ``madvise`` and ``always``
modes (``/sys/kernel/mm/transparent_hugepage/enabled``); under ``never``, or where
``madvise`` is unavailable, the buffer is ordinary memory and nothing else changes.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

__all__ = ["HUGE_BYTES", "fresh_buffer"]

HUGE_BYTES = 4 << 20  # buffers this large or larger are asked for in huge pages


def fresh_buffer(size: int) -> memoryview:
    """``size`` bytes of writable memory for a read to fill (zeroed or not: the read overwrites it).

    Large buffers are private anonymous mappings advised to use huge pages; the mapping
    goes back to the kernel when the last view of it is dropped. Small ones are numpy's.
    """
    if size >= HUGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:  # out of mappings (vm.max_map_count): ordinary memory below
            pass
        else:
            with contextlib.suppress(OSError):  # a kernel without transparent huge pages refuses the advice
                memory.madvise(mmap.MADV_HUGEPAGE)
            return memoryview(memory)
    return memoryview(np.empty(size, dtype=np.uint8))
