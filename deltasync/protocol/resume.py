"""Where a restarted trainer stands: the newest version a run prefix has committed, and its step.

A trainer killed between a commit and its own bookkeeping (an ``on_publish``
callback, a log line, a checkpoint) may not know its last version was
committed; the store does. README's "When a trainer dies" starts here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ObjectNotFound
from .keys import MANIFEST_KEY
from .manifest import MAX_MANIFEST_BYTES, Manifest

if TYPE_CHECKING:
    from ..stores import Store

__all__ = ["Committed", "last_committed"]


@dataclass(frozen=True, slots=True)
class Committed:
    """The newest version a run prefix holds: where a restarted trainer stands (:func:`last_committed`)."""

    version: int
    """The newest committed version."""
    step: int | None
    """The trainer step its weights come from (``None`` if the publisher was not told)."""
    time: float
    """When it was committed (epoch seconds, the writer's clock)."""
    run_id: str
    writer: str
    """The id of the writer that owns the prefix."""
    lease_left_s: float
    """Seconds the owner's lease still runs (0 when it has ended: a new trainer starts without takeover)."""


def last_committed(store: str | Store, **store_options: Any) -> Committed | None:
    """The newest committed version of a run prefix and the step it came from; ``None`` if there is none.

    A trainer killed between a commit and its own bookkeeping (an ``on_publish``
    callback, a log line) may not know its last version was committed: this is
    what the store says. ``deltasync status --json`` prints the same
    (``last_committed``).

    Example:
        ```python
        >>> last_committed("s3://bucket/run1")
        Committed(version=108, step=108, time=..., run_id='...', writer='88a1...', lease_left_s=412.0)
        ```
    """
    from ..stores import open_store  # stores sit below; imported here to keep this module's import light

    opened = open_store(store, **store_options) if isinstance(store, str) else store
    try:
        try:
            got = opened.get_if_changed(MANIFEST_KEY, None, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFound:
            return None
        if got is None or not (manifest := Manifest.from_bytes(got[0])).versions:
            return None
        latest = manifest.versions[-1]
        return Committed(
            latest.version, latest.step, latest.time, manifest.run_id, manifest.writer,
            max(0.0, manifest.lease_until - time.time()),
        )
    finally:
        if opened is not store:
            opened.close()
