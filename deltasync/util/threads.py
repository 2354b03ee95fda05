"""Per-tensor work on a few threads, one balanced share each.

zstd, hashlib, numpy and torch release the GIL on large arrays, so the
tensors of one file encode and decode in parallel. One task per tensor would
hand the GIL and the results back and forth hundreds of times per file, which
costs more than it saves on a few cores; so each thread (the caller included) takes
one share of the tensors, balanced by their work (changed elements plus a
fixed per-tensor cost), largest dealt first.

The threads are kept between calls (a file's decode makes several calls, and
starting the threads anew for each would cost as much as a small file's work): one pool per process,
grown when a call asks for more workers, made anew after a fork. A call made
from one of those threads (work that itself fans out) gets threads of its own,
so no call ever waits for a thread that is waiting for it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["WORKERS", "TASK_COST", "TENSOR_COST", "map_shared", "mostly_python"]

def _workers() -> int:
    """``DELTASYNC_THREADS`` when set (a positive integer), else the CPU count, at most 8."""
    value = os.environ.get("DELTASYNC_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else min(8, os.cpu_count() or 1)


WORKERS = _workers()
"""Threads per file for encoding and decoding (the caller's included)."""
# What balancing the shares counts per item on top of its work: a tensor's fixed cost, in changed elements.
TASK_COST = 1000
# Below this much work in all, one thread does it: starting threads costs more.
MIN_PARALLEL_WORK = 200_000
TENSOR_COST = 3000
"""A tensor's fixed cost in a decode or an encode, in changed elements: its Python, zstd and digest calls,
weighed against the cost of one change (``benchmarks/device_sync.py --tensors 4096`` measures the cost per
tensor). Decode chunks are cut and dealt counting it, so that a chunk of many small tensors is not taken for a
light one and the threads' shares stay even; and work below it per tensor is mostly Python
(:func:`mostly_python`)."""


def mostly_python(changes: int, tensors: int = 1) -> bool:
    """Whether decoding or encoding ``tensors`` tensors of ``changes`` changed elements in all is mostly Python,
    under :data:`TENSOR_COST` a tensor: ``serial`` work for :func:`map_shared`."""
    return changes < TENSOR_COST * tensors

_I = TypeVar("_I")
_T = TypeVar("_T")


def map_shared(
    fn: Callable[[_I], _T], items: Sequence[_I], work: Sequence[int], workers: int | None = None,
    *, serial: Sequence[bool] | None = None,
) -> list[_T]:
    """``[fn(x) for x in items]`` in up to ``workers`` (default :data:`WORKERS`) threads; ``work[i]`` weighs item ``i``.

    ``serial[i]``: item ``i`` spends most of its time in Python, holding the GIL (many small tensors). All such
    items go to one thread, the caller's: two of them side by side only hand the GIL back and forth at every
    short call that releases it, slower than one thread. The other items are dealt around them.

    Every item is processed even when one fails; then the first failure in
    ``items`` order is raised, so which error a caller sees does not depend on
    thread timing.
    """
    workers = WORKERS if workers is None else workers
    total = sum(work) + TASK_COST * len(items)
    if workers <= 1 or len(items) <= 1 or total < MIN_PARALLEL_WORK or (serial is not None and all(serial)):
        return [fn(x) for x in items]
    shares: list[list[int]] = [[] for _ in range(min(workers, len(items)))]
    loads = [0] * len(shares)
    for i in sorted(range(len(items)), key=lambda i: (not (serial and serial[i]), -work[i])):
        lightest = 0 if serial and serial[i] else loads.index(min(loads))
        shares[lightest].append(i)
        loads[lightest] += work[i] + TASK_COST
    shares = [share for share in shares if share]
    if len(shares) == 1:
        return [fn(x) for x in items]
    results: list[Any] = [None] * len(items)
    errors: dict[int, BaseException] = {}

    def run(share: list[int]) -> None:
        for i in share:
            try:
                results[i] = fn(items[i])
            except Exception as exc:  # noqa: BLE001 - re-raised below, in items order
                errors[i] = exc

    if getattr(_inside, "pool", False):  # on a pool thread: threads of its own (see the module docstring)
        with ThreadPoolExecutor(max_workers=len(shares) - 1) as own:
            _fan_out(own, run, shares)
    else:
        _fan_out(_pool(len(shares) - 1), run, shares)
    if errors:
        raise errors[min(errors)]
    return results


def _fan_out(pool: ThreadPoolExecutor, run: Callable[[list[int]], None], shares: list[list[int]]) -> None:
    """Run the first share on the calling thread and the others on ``pool``; return when all are done."""
    pending = [pool.submit(run, share) for share in shares[1:]]
    run(shares[0])
    for future in pending:
        future.result()


_inside = threading.local()
_lock = threading.Lock()
_shared: tuple[int, ThreadPoolExecutor] | None = None  # (threads, pool); forgotten in a forked child


def _mark() -> None:
    _inside.pool = True


def _forget_in_child() -> None:
    """In a forked child: the parent's pool threads do not exist here, and its lock may have been held."""
    global _lock, _shared
    _lock, _shared = threading.Lock(), None


_fork_hook = False  # registered with the first pool: a process that never fans out gets no hook


def _pool(threads: int) -> ThreadPoolExecutor:
    """The process's pool, with at least ``threads`` threads."""
    global _shared, _fork_hook
    with _lock:
        if not _fork_hook:
            os.register_at_fork(after_in_child=_forget_in_child)
            _fork_hook = True
        if _shared is None or _shared[0] < threads:
            # A smaller pool is dropped, not shut down: a caller may still be submitting to it; its idle
            # threads exit once it is collected.
            _shared = (threads, ThreadPoolExecutor(threads, "deltasync", initializer=_mark))
        return _shared[1]
