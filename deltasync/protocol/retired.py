"""Retired objects waiting out their grace period, listed beside the manifest rather than in it.

Retention drops old versions from the manifest; their objects stay in the
store for ``retire_grace_s`` so that a replica that read an older manifest
finishes its downloads. Those objects are listed in ``retired.json`` (key
:data:`~deltasync.protocol.keys.RETIRED_KEY`), which only writers and ``deltasync gc``
read. The manifest, which every replica re-reads at every version, so stays
O(live versions) whatever the publish rate (with one version per second and a
300 s grace, about 600 keys would otherwise ride along in every manifest).

Order of writes, so that every object is always named by the manifest or by
this list until it is deleted: the list (with the newly retired keys) is
written *before* the manifest that drops them, and keys are removed from it
only after their objects were deleted. A crash in between leaves the list
naming objects that are gone, which is harmless (deleting them again is a no-op).

Schema (JSON object): ``{"schema": 1, "run_id": str, "retired": [[key, time], ...]}``,
``time`` being when the key was retired (epoch seconds, the writer's clock).
A manifest may carry the same pairs in its own ``retired`` field (older
writers keep them there); both are honoured.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ManifestError, ObjectNotFound
from ..stores import check_key
from ..util.jsonio import load_json
from .keys import MANIFEST_KEY, RETIRED_KEY
from .manifest import Manifest, referenced_keys

if TYPE_CHECKING:
    from ..stores import Store

__all__ = ["Retired", "RetiredLog", "named_keys", "read_retired", "write_retired", "MAX_RETIRED_BYTES"]

SCHEMA = 1
MAX_RETIRED_BYTES = 64 << 20  # a bound on what a reader accepts (about a million keys)


@dataclass(frozen=True, slots=True)
class Retired:
    """The retired list as stored: its entries and the etag they were read with (``None``: none stored)."""

    entries: tuple[tuple[str, float], ...] = ()
    etag: str | None = None

    @property
    def keys(self) -> set[str]:
        return {key for key, _ in self.entries}


def read_retired(store: Store) -> Retired:
    """The store's retired list (empty when there is none).

    Raises:
        `ManifestError`: the list is malformed.
    """
    try:
        got = store.get_if_changed(RETIRED_KEY, None, max_bytes=MAX_RETIRED_BYTES)
    except ObjectNotFound:
        return Retired()
    if got is None:
        return Retired()
    data, info = got
    try:
        raw: Any = load_json(data, what=RETIRED_KEY, error=ValueError)
        pairs = raw["retired"]
        if raw.get("schema") != SCHEMA or not isinstance(pairs, list):
            raise ValueError("unknown schema")
        entries = tuple((check_key(key), _time(when)) for key, when in pairs)
    except (ValueError, TypeError, KeyError) as exc:
        raise ManifestError(f"{store.url}/{RETIRED_KEY} is malformed ({exc}); delete it and run deltasync gc") from None
    return Retired(entries, info.etag)


def _time(value: Any) -> float:
    """A retirement time: a finite JSON number (not a bool, NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"bad retirement time {value!r:.40}")
    return float(value)


def write_retired(store: Store, entries: tuple[tuple[str, float], ...], *, run_id: str, etag: str | None) -> Retired:
    """Write the retired list, conditionally on ``etag`` where the store can (create-only when ``None``).

    Raises:
        `PreconditionFailed`: someone else rewrote the list since it was read.
    """
    data = json.dumps({"schema": SCHEMA, "run_id": run_id, "retired": [[k, t] for k, t in entries]}).encode()
    if not store.conditional_writes:
        info = store.put(RETIRED_KEY, data)
    elif etag is None:
        info = store.put(RETIRED_KEY, data, mode="create")
    else:
        info = store.put(RETIRED_KEY, data, if_match=etag)
    return Retired(entries, info.etag)


class RetiredLog:
    """A writer's view of the retired list: what it added, what it deleted, written in the safe order.

    Args:
        store (`Store`): the run prefix.
        run_id (`str`): the run the list belongs to.
    """

    def __init__(self, store: Store, run_id: str) -> None:
        self.store, self.run_id = store, run_id
        self.stored = read_retired(store)

    def before_commit(self, new: tuple[tuple[str, float], ...], *, now: float, grace: float) -> list[str]:
        """List ``new`` retired keys before the manifest that drops them is written; return the keys now due."""
        entries = _union(self.stored.entries, new)
        if {key for key, _ in entries} != self.stored.keys:
            self._write(entries)
        return [key for key, when in entries if now - when >= grace]

    def after_delete(self, deleted: list[str]) -> None:
        """Drop deleted keys from the list (best effort: a stale entry only names an object that is gone)."""
        gone = set(deleted)
        if gone & self.stored.keys:
            self._write(tuple((k, t) for k, t in self.stored.entries if k not in gone))

    def _write(self, entries: tuple[tuple[str, float], ...]) -> None:
        from ..errors import PreconditionFailed

        try:
            self.stored = write_retired(self.store, entries, run_id=self.run_id, etag=self.stored.etag)
        except PreconditionFailed:  # gc edited it meanwhile: take its version, keep ours on top
            theirs = read_retired(self.store)
            self.stored = write_retired(
                self.store, _union(theirs.entries, entries), run_id=self.run_id, etag=theirs.etag
            )


def _union(
    entries: tuple[tuple[str, float], ...], extra: tuple[tuple[str, float], ...]
) -> tuple[tuple[str, float], ...]:
    """``entries`` and then the keys of ``extra`` they lack (a key keeps the first time it was retired)."""
    merged = dict(entries)
    for key, when in extra:
        merged.setdefault(key, when)
    return tuple(merged.items())


def named_keys(store: Store, manifest: Manifest) -> set[str]:
    """Every key a run prefix names: the manifest's objects and its retired list's, and both lists themselves.

    What is not among them (and not a replica's ack) was left by a crashed publish: see
    :func:`deltasync.protocol.commit.find_orphans`.
    """
    return referenced_keys(manifest) | read_retired(store).keys | {MANIFEST_KEY, RETIRED_KEY}
