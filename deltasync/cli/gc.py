"""``deltasync gc URL``: delete retired objects past their grace period and orphans of crashed publishes.

Retired objects are dropped from the manifest by a compare-and-swap write first, then deleted; on a
store without compare-and-swap, or while a writer's lease is live, they are left to the publisher.
Orphans (objects under ``deltas/`` and ``anchors/`` that no manifest names, and unfinished writes a
killed process left, such as the local store's ``.tmp-*`` files) are deleted once older
than the grace period, which never drops below the publisher's while a lease is live. Replica acks
(``acks/<replica>.json``) are deleted when they belong to another run or were last written longer
ago than ``--ack-ttl`` (replicas that are gone). ``--dry-run`` lists what would go and deletes nothing.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from ..errors import ObjectNotFound, PreconditionFailed
from ..protocol.acks import ACK_TTL_S, stale_acks
from ..protocol.commit import ORPHAN_GRACE_S, classify_orphans, cleanup_blocked, orphan_grace, plan_retired_cleanup
from ..protocol.keys import MANIFEST_KEY, RETIRED_KEY
from ..protocol.manifest import RETIRE_GRACE_S, Manifest
from ..protocol.retired import read_retired, write_retired
from .common import format_duration, format_size, load_manifest, open_existing, safe_url

if TYPE_CHECKING:
    from ..stores import Store


def _gc_retired(
    store: Store, manifest: Manifest, etag: str | None, *, now: float, grace: float, dry_run: bool
) -> tuple[list[tuple[str, int | None]], str | None]:
    """Retired objects past their grace: deleted after a compare-and-swap manifest write drops them.

    Returns:
        `(removed, note)`: ``(key, size)`` of what was (or would be) deleted, and why nothing was, if so.
    """
    plan = plan_retired_cleanup(
        manifest, now=now, grace=grace, compare_and_swap=store.conditional_writes and etag is not None
    )
    due = plan.due
    if not due:
        return [], None
    if plan.blocked == "no-cas":
        return [], _blocked_note(len(due), plan.blocked, manifest, now)
    if plan.blocked == "lease":
        return [], _blocked_note(len(due), plan.blocked, manifest, now) + ": manifest left alone"
    removed = [(key, _object_size(store, key)) for key in due]
    if dry_run:
        return removed, None
    try:
        store.put(MANIFEST_KEY, plan.manifest.to_bytes(), if_match=etag)
    except PreconditionFailed:
        return [], "the manifest changed while gc ran (a publisher is active): retired objects left alone; run gc again"
    for key, _ in removed:
        store.delete(key)
    return removed, None


def _gc_retired_list(
    store: Store, manifest: Manifest, *, now: float, grace: float, dry_run: bool
) -> tuple[list[tuple[str, int | None]], str | None]:
    """Keys of ``retired.json`` past their grace: deleted, then dropped from the list (the publisher's own
    order); left to the publisher while its lease is live."""
    listed = read_retired(store)
    due = [key for key, when in listed.entries if now - when >= grace]
    if not due:
        return [], None
    blocked = cleanup_blocked(manifest, now=now, compare_and_swap=store.conditional_writes)
    if blocked is not None:
        return [], _blocked_note(len(due), blocked, manifest, now)
    removed = [(key, _object_size(store, key)) for key in due]
    if dry_run:
        return removed, None
    for key, _ in removed:
        store.delete(key)
    gone = set(due)
    try:
        write_retired(store, tuple((k, t) for k, t in listed.entries if k not in gone), run_id=manifest.run_id,
                      etag=listed.etag)
    except PreconditionFailed:
        return removed, f"{RETIRED_KEY} changed while gc ran: it may still name deleted objects (harmless)"
    return removed, None


def _blocked_note(due: int, blocked: str, manifest: Manifest, now: float) -> str:
    """Why ``due`` retired objects were left to the publisher."""
    if blocked == "no-cas":
        return f"{due} retired objects are due, but this store has no compare-and-swap: left to the publisher"
    return (
        f"{due} retired objects are due, but writer {manifest.writer[:8]} holds the lease for another "
        f"{format_duration(manifest.lease_until - now)} and deletes them itself"
    )


def _object_size(store: Store, key: str) -> int | None:
    try:
        return store.head(key).size
    except ObjectNotFound:
        return None


def _gc_orphans(
    store: Store, manifest: Manifest, *, now: float, grace: float, dry_run: bool
) -> tuple[list[tuple[str, int | None]], str | None]:
    """Objects under ``deltas/`` and ``anchors/`` that no manifest names, and unfinished writes, older than
    ``grace``; and a note on those kept (younger), saying why and what removes them."""
    orphans, kept = classify_orphans(store, manifest, now=now, grace=grace)
    if not dry_run:
        for info in orphans:
            store.delete(info.key)
    note = None
    if kept:
        size = format_size(sum(info.size or 0 for info in kept))
        note = (
            f"kept {len(kept)} objects ({size}) that no manifest names, younger than {grace:.0f} s (or of unknown "
            "age): a publish may still be uploading them. Once no trainer publishes here, `deltasync gc --grace 0` "
            "deletes them; a trainer that takes the prefix over reclaims them at once"
        )
    return [(info.key, info.size) for info in orphans], note


def _gc_acks(store: Store, manifest: Manifest, *, now: float, ttl: float, dry_run: bool) -> list[tuple[str, int | None]]:
    """Acks of other runs, unreadable acks, and acks not rewritten for ``ttl`` seconds."""
    stale = stale_acks(store, manifest.run_id, now=now, ttl=ttl)
    if not dry_run:
        for info in stale:
            store.delete(info.key)
    return [(info.key, info.size) for info in stale]


def add_parser(sub: Any) -> None:
    """Register ``gc`` on the ``deltasync`` subcommands."""
    gc = sub.add_parser("gc", help="delete retired objects past their grace period and orphans of crashed publishes")
    gc.add_argument("url", help="the run prefix")
    gc.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    gc.add_argument(
        "--grace", type=float, default=None, metavar="SECONDS",
        help="minimum age of what is deleted (default: 300 s for retired objects, 3600 s for orphans)",
    )
    gc.add_argument(
        "--ack-ttl", type=float, default=ACK_TTL_S, metavar="SECONDS",
        help="delete replica acks not rewritten for this long, and acks of other runs (default: 7 days)",
    )
    gc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Delete (or with ``--dry-run`` list) what is due, and report what was freed."""
    with open_existing(args.url) as store:
        manifest, etag = load_manifest(store)
        now = time.time()
        retire_grace = RETIRE_GRACE_S if args.grace is None else args.grace
        asked = ORPHAN_GRACE_S if args.grace is None else args.grace
        orphans_grace = orphan_grace(manifest, asked, now=now)
        notes = []
        if orphans_grace > asked:  # a live writer's uploads are unnamed until its manifest write
            notes.append(f"a writer's lease is live: orphans younger than {ORPHAN_GRACE_S:.0f} s are kept")
        retired, note = _gc_retired(store, manifest, etag, now=now, grace=retire_grace, dry_run=args.dry_run)
        listed, listed_note = _gc_retired_list(store, manifest, now=now, grace=retire_grace, dry_run=args.dry_run)
        retired += listed
        notes += [listed_note] if listed_note else []
        orphans, kept_note = _gc_orphans(store, manifest, now=now, grace=orphans_grace, dry_run=args.dry_run)
        notes += [kept_note] if kept_note else []
        acks = _gc_acks(store, manifest, now=now, ttl=args.ack_ttl, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"gc {safe_url(store.url)}{' (dry run)' if args.dry_run else ''}")
    for label, removed in (("retired", retired), ("orphan", orphans), ("ack", acks)):
        for key, size in removed:
            print(f"  {verb} {label:<8} {key}  {format_size(size)}")
    for line in ([note] if note else []) + notes:
        print(f"  note: {line}")
    total = sum(size or 0 for _, size in retired + orphans + acks)
    count = len(retired) + len(orphans) + len(acks)
    print(f"{'would free' if args.dry_run else 'freed'} {format_size(total)} ({total:,} bytes) in {count} objects")
    return 0
