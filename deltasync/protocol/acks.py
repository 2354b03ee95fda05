"""Replica acknowledgements: ``acks/<replica>.json``, how a fleet is seen without a control plane.

A replica rewrites its ack after every update (version, run, lag, bytes, apply
time, refusals); ``deltasync status`` and the TRL callback's waits read them,
and ``deltasync gc`` deletes acks not rewritten for :data:`ACK_TTL_S`. Acks are
advisory: a failed write never fails an update, an unreadable ack is skipped.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

from ..errors import DeltaSyncError
from ..stores import ObjectInfo, Store
from ..util.jsonio import load_json
from .keys import ACKS, ack_key

__all__ = ["ACK_TTL_S", "MAX_ACK_BYTES", "safe_replica_id", "read_acks", "write_ack", "stale_acks"]

logger = logging.getLogger("deltasync.subscriber")

# ``deltasync gc`` deletes acks not rewritten for this long (replicas that are gone); a live
# replica rewrites its ack on every update.
ACK_TTL_S = 7 * 86400.0
MAX_ACK_BYTES = 64 << 10  # an ack is a few hundred bytes; anything far larger is not one


def safe_replica_id(raw: str) -> str:
    """``raw`` reduced to characters a store key allows (at most 100 of them)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "-", raw).strip(".-") or "replica"
    return cleaned[:100]


def write_ack(store: Store, replica_id: str, body: dict[str, Any]) -> None:
    """Write an ack; failures are logged, never raised (acks are advisory)."""
    try:
        store.put(ack_key(safe_replica_id(replica_id)), json.dumps(body).encode())
    except DeltaSyncError as exc:
        logger.warning("could not write ack: %s", exc)


def read_acks(store: Store) -> list[dict[str, Any]]:
    """Every replica's latest ack (unreadable acks, and JSON that is not an object, are skipped: acks are written
    by replicas, and a trainer waiting on them must not fail on one)."""
    return [ack for _, ack in _acks(store) if isinstance(ack, dict)]


def stale_acks(store: Store, run_id: str, *, now: float, ttl: float = ACK_TTL_S) -> list[ObjectInfo]:
    """Acks ``deltasync gc`` deletes: of another run, unreadable, or not rewritten for ``ttl`` seconds."""
    stale = []
    for info, ack in _acks(store):
        try:
            written = float(ack.get("time", 0.0)) if ack is not None else 0.0
            current = ack is not None and ack.get("run_id") == run_id
        except (AttributeError, TypeError, ValueError, OverflowError):  # not an object, or a time that is no number
            written, current = 0.0, False
        if not current or not now - written < ttl:  # a NaN time is stale too
            stale.append(info)
    return stale


def _acks(store: Store) -> Iterator[tuple[ObjectInfo, Any]]:
    """Every ack object with its parsed JSON (``None`` when unreadable), each read bounded."""
    for info in store.list(ACKS):
        try:
            yield info, load_json(store.get(info.key, max_bytes=MAX_ACK_BYTES), what=info.key, error=ValueError)
        except (DeltaSyncError, ValueError, RecursionError):  # RecursionError: a deeply nested ack
            yield info, None
