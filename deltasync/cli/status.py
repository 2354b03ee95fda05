"""``deltasync status URL``: a run prefix's run, writer and lease, versions, anchors, sizes and replica lag.

Reads the manifest and the replicas' acks (``acks/<replica>.json``) once; :func:`collect_status`
turns them into one JSON-able dictionary (``--json``), which is otherwise printed as tables. Acks
are written by replicas, so every field of one is checked and store text is made terminal-safe.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from ..protocol.manifest import Manifest, VersionEntry, summarize
from .common import (
    Column,
    format_duration,
    format_size,
    load_manifest,
    open_existing,
    print_json,
    print_table,
    safe_url,
)

__all__ = ["collect_status"]


def _printable(value: Any, limit: int = 64) -> str:
    """Text from the store, made safe for a terminal (no control sequences) and short."""
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def collect_status(
    url: str, manifest: Manifest, acks: Sequence[Any], *, now: float, limit: int,
    leftovers: Sequence[Any] = (), retired_listed: int = 0,
) -> dict[str, Any]:
    """Everything ``deltasync status`` shows, JSON-able (ages in seconds relative to ``now``).

    ``leftovers``: objects no manifest names and unfinished writes (``ObjectInfo``), whatever their age;
    ``retired_listed``: retired objects listed beside the manifest (``retired.json``), pending deletion.
    """
    latest = manifest.versions[-1] if manifest.versions else None
    sizes = summarize(manifest)
    newest = reversed(manifest.versions[-limit:]) if limit > 0 else ()
    replicas = (row for row in (_replica_row(a, manifest, now) for a in acks) if row is not None)
    return {
        "store": safe_url(url),
        "run_id": manifest.run_id,
        "fingerprint": manifest.fingerprint,
        "numel": manifest.numel,
        "writer": manifest.writer,
        "lease_until": manifest.lease_until,
        "lease_live": manifest.lease_until > now,
        "updated": manifest.updated,
        "latest": None if latest is None else _version_row(latest, manifest.numel, now),
        "anchors": [{"version": e.version, "bytes": e.anchor_bytes, "parts": len(e.anchor)} for e in manifest.anchors()],
        "versions_listed": len(manifest.versions),
        "retracted": sorted(manifest.retracted()),
        "delta_bytes": sizes["delta_bytes"],
        "anchor_bytes": sizes["anchor_bytes"],
        "span_bytes": sizes["span_bytes"],
        "total_bytes": sizes["delta_bytes"] + sizes["anchor_bytes"] + sizes["span_bytes"],
        "retired_pending": len(manifest.retired) + retired_listed,
        "leftovers": len(leftovers),
        "leftover_bytes": sum(info.size or 0 for info in leftovers),
        "last_committed": None if latest is None else {"version": latest.version, "step": latest.step},
        "versions": [_version_row(e, manifest.numel, now) for e in newest],
        "replicas": sorted(replicas, key=lambda r: r["replica"]),
    }


def _version_row(entry: VersionEntry, numel: int, now: float) -> dict[str, Any]:
    kinds = [k for k, refs in (("delta", entry.delta), ("anchor", entry.anchor)) if refs]
    kinds += ["span"] if entry.spans else []
    return {
        "version": entry.version,
        "step": entry.step,
        "kinds": kinds,
        "spans_from": [span.base for span in entry.spans],
        "nnz": entry.nnz,
        # An anchor-only version carries everything; "changed" is only defined against a previous version.
        "sparsity": (1.0 - entry.nnz / numel if numel else 1.0) if entry.delta else None,
        "bytes": entry.delta_bytes + entry.anchor_bytes + entry.span_bytes,
        "time": entry.time,
        "age_s": now - entry.time,
    }


def _replica_row(ack: Any, manifest: Manifest, now: float) -> dict[str, Any] | None:
    """One ack as a table row; acks are written by replicas, so every field is checked."""
    if not isinstance(ack, dict) or not isinstance(ack.get("replica"), str):
        return None
    number = lambda v: v if isinstance(v, (int, float)) and not isinstance(v, bool) else None  # noqa: E731
    version = ack.get("version") if isinstance(ack.get("version"), int) else None
    same_run = ack.get("run_id") == manifest.run_id
    lag = manifest.latest - version if same_run and version is not None and manifest.latest is not None else None
    rejected = ack.get("rejected") if isinstance(ack.get("rejected"), dict) else {}
    acked = number(ack.get("time"))
    return {
        "replica": _printable(ack["replica"], 100),
        "version": version,
        "same_run": same_run,
        "lag_versions": lag,
        "ack_age_s": now - acked if acked is not None else None,
        "apply_ms": number(ack.get("apply_ms")),
        "rejected": {_printable(k): n for k, n in rejected.items() if isinstance(n, int)},
    }


def _print_status(info: dict[str, Any], now: float) -> None:
    lease = info["lease_until"] - now
    if lease > 0:
        lease_text = f"lease live, {format_duration(lease)} left"
    else:
        lease_text = f"lease expired {format_duration(-lease)} ago"
    print(f"store      {info['store']}")
    print(f"run        {info['run_id']}")
    print(f"model      {info['fingerprint']} ({info['numel']:,} elements)")
    print(f"writer     {info['writer'][:12]} ({lease_text})")
    latest = info["latest"]
    if latest is None:
        print("latest     none published yet")
    else:
        age = format_duration(latest["age_s"])
        print(f"latest     v{latest['version']} (step {latest['step']}), published {age} ago")
    anchors = ", ".join(f"v{a['version']} ({format_size(a['bytes'])})" for a in info["anchors"]) or "none"
    print(f"anchors    {anchors}")
    print(
        f"stored     {info['versions_listed']} version{'' if info['versions_listed'] == 1 else 's'}: deltas {format_size(info['delta_bytes'])}, anchors "
        f"{format_size(info['anchor_bytes'])}, spans {format_size(info['span_bytes'])}, "
        f"total {format_size(info['total_bytes'])}; "
        f"{info['retired_pending']} retired objects pending deletion"
    )
    if info["retracted"]:
        shown = ", ".join(f"v{v}" for v in info["retracted"][:10]) + (" ..." if len(info["retracted"]) > 10 else "")
        print(f"retracted  {shown} (taken back by a rollback; still listed)")
    if info["leftovers"]:
        print(
            f"leftovers  {info['leftovers']} objects ({format_size(info['leftover_bytes'])}) that no manifest names: "
            "uploads of a publish in progress or of a crashed one, and unfinished writes (`deltasync gc` reclaims them)"
        )
    _print_versions(info["versions"])
    _print_replicas(info["replicas"])


_VERSION_COLUMNS = (
    Column("version", 8, ">"),
    Column("step", 8, ">", gap=2),
    Column("kind", 12),
    Column("changed", 12, ">"),
    Column("sparsity", 10, ">"),
    Column("bytes", 11, ">", gap=2),
    Column("published"),
)


def _print_versions(rows: list[dict[str, Any]]) -> None:
    if rows:
        print_table(_VERSION_COLUMNS, (_version_cells(r) for r in rows))


def _version_cells(r: dict[str, Any]) -> tuple[object, ...]:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"]))
    return (
        r["version"],
        "-" if r["step"] is None else r["step"],
        "+".join(r["kinds"]),
        f"{r['nnz']:,}",
        f"{100 * r['sparsity']:.3f}%" if r["sparsity"] is not None else "-",
        format_size(r["bytes"]),
        f"{stamp} ({format_duration(r['age_s'])} ago)",
    )


def _print_replicas(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("\nreplicas   none have acknowledged a version (acks/ is empty)")
        return
    columns = (
        Column("replica", max(7, *(len(r["replica"]) for r in rows))),
        Column("version", 8, ">"),
        Column("lag", 9, ">"),
        Column("acked", 13, ">"),
        Column("apply ms", 9, ">", gap=2),
        Column("rejected"),
    )
    print_table(columns, (_replica_cells(r) for r in rows))


def _replica_cells(r: dict[str, Any]) -> tuple[object, ...]:
    return (
        r["replica"],
        "-" if r["version"] is None else r["version"],
        "other run" if not r["same_run"] else "-" if r["lag_versions"] is None else r["lag_versions"],
        f"{format_duration(r['ack_age_s'])} ago" if r["ack_age_s"] is not None else "?",
        "-" if r["apply_ms"] is None else f"{r['apply_ms']:.1f}",
        ", ".join(f"{k} {n}" for k, n in sorted(r["rejected"].items())) or "-",
    )


def add_parser(sub: Any) -> None:
    """Register ``status`` on the ``deltasync`` subcommands."""
    status = sub.add_parser("status", help="show a run prefix: writer, versions, anchors, sizes, replica lag")
    status.add_argument("url", help="the run prefix, e.g. ./run1 or s3://bucket/run1")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--versions", type=int, default=10, metavar="N", help="newest N versions to list (default 10)")
    status.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print a run prefix's status (tables, or JSON with ``--json``)."""
    from ..protocol.commit import classify_orphans
    from ..protocol.retired import read_retired
    from ..replica.subscriber import read_acks

    with open_existing(args.url) as store:
        manifest, _ = load_manifest(store)
        acks = read_acks(store)
        now = time.time()
        due, kept = classify_orphans(store, manifest, now=now)
        listed = len(read_retired(store).entries)
    info = collect_status(
        store.url, manifest, acks, now=now, limit=args.versions, leftovers=due + kept, retired_listed=listed
    )
    if args.json:
        print_json(info)
    else:
        _print_status(info, now)
    return 0
