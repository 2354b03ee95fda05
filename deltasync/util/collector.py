"""Python's cycle collector held off while a version is diffed, encoded, decoded and applied, when the process
allows it.

Diffing, encoding and decoding make a few dozen short-lived Python objects per tensor (header entries,
views, small arrays), and every 700 of them start a collection. In a process that holds hundreds of
thousands of objects (torch, numba, a trainer, an inference engine), some of those collections walk them
all, for nothing: reference counting frees everything these paths make (they form no cycles).
``benchmarks/README.md`` ("Measurements behind the code's choices") has a measurement.

The collector is the process's, not deltasync's: the pause happens only where the process allows it,
with :func:`allow_pauses` (deltasync's own programs, ``deltasync follow``, ``watch`` and ``demo``, do) or
with ``DELTASYNC_PAUSE_GC=1`` in the environment (for processes deltasync does not own, such as a vLLM
engine's workers). Otherwise :func:`collector_paused` does nothing.

When allowed, the pause is process-wide (so is the collector): the first of any number of overlapping
holders, on any thread, turns the collector off where it was on, and the last to leave turns it back on,
on every path out. A process that runs with the collector off keeps it off. Cycles that other threads
make meanwhile are collected after. A version's objects still alive when the pause ends are walked by the
collection its end starts, so the callers free what they no longer need inside it (a file's header).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["ENV", "allow_pauses", "collector_paused", "pauses_allowed"]

ENV = "DELTASYNC_PAUSE_GC"
"""Set to ``1`` to allow the pauses in a process that does not call :func:`allow_pauses` itself."""

_LOCK = threading.Lock()
_holders = 0
_resume = False  # whether the last holder turns the collector back on
_allowed: bool | None = None  # None: as the environment says


def allow_pauses(allowed: bool | None = True) -> None:
    """Let deltasync hold Python's cycle collector off during its hot paths in this process (or stop it).

    Call it once, at the start of a program that owns its process (a trainer's script, a replica); the
    collector is back on after each pause. ``allow_pauses(False)`` turns the pauses off whatever the
    environment says; ``allow_pauses(None)`` leaves it to the environment again (:data:`ENV`).
    """
    global _allowed
    _allowed = None if allowed is None else bool(allowed)


def pauses_allowed() -> bool:
    """Whether :func:`collector_paused` pauses the collector in this process."""
    return _allowed if _allowed is not None else os.environ.get(ENV, "") == "1"


@contextmanager
def collector_paused() -> Iterator[None]:
    """Hold Python's cycle collector off for the ``with`` block (or a decorated call), where the process
    allows it (:func:`allow_pauses`); re-entrant and thread-safe."""
    global _holders, _resume
    if not pauses_allowed():
        yield
        return
    with _LOCK:
        if _holders == 0:
            _resume = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _LOCK:
            _holders -= 1
            if _holders == 0 and _resume:
                gc.enable()
