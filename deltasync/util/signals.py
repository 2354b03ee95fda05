"""Stopping a long-running loop on Ctrl-C or SIGTERM, without ever deadlocking.

A loop (a subscriber's :meth:`~deltasync.Subscriber.run`) runs in a thread of its
own; the main thread waits for it or for a signal. The signal handlers only
record the signal: Python runs a handler in the main thread between any two
bytecodes, so a handler that took a lock (``Event.set`` does) could interrupt
the main thread inside that same lock and deadlock, and a ``KeyboardInterrupt``
raised inside ``Event.wait`` can leave the event's lock held, so that every
later ``set()`` blocks forever. Once a signal is recorded the main thread sets
the stop event itself, outside any handler, and the loop finishes the update
in progress.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

__all__ = ["run_until_signal"]

SIGNAL_POLL_S = 0.1  # how soon a recorded signal is acted on
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_until_signal(loop: Callable[[threading.Event], None], stop: threading.Event) -> int | None:
    """Run ``loop(stop)`` in a thread until it returns or SIGINT/SIGTERM arrives, then stop it.

    Off the main thread (where signals cannot be handled) the loop runs until it returns.

    Returns:
        `int` or `None`: the signal that ended the loop, or ``None`` if it ended by itself.

    Raises:
        Whatever ``loop`` raised.
    """
    received: list[int] = []
    failures: list[BaseException] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            previous[signum] = signal.signal(signum, lambda number, _frame: received.append(number))

    def target() -> None:
        try:
            loop(stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            failures.append(exc)

    thread = threading.Thread(target=target, name="deltasync-loop", daemon=True)
    thread.start()
    try:
        while not received and thread.is_alive():
            time.sleep(SIGNAL_POLL_S)
    finally:
        stop.set()
        thread.join()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failures:
        raise failures[0]
    return received[0] if received else None
