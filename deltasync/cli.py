"""The ``deltasync`` command line.

    deltasync inspect FILE [--json] [--tensors N]      metadata, per-tensor codec, counts, sparsity
    deltasync status URL [--json] [--versions N]       run, writer, versions, anchors, sizes, replica lag
    deltasync gc URL [--dry-run] [--grace SECONDS]     delete retired objects and orphans of crashed publishes
    deltasync watch URL --model DIR [--once]           keep a safetensors checkpoint directory at the latest version

``FILE`` is a local path, or a store URL plus a key (``s3://bucket/run1/deltas/000007.safetensors``
is read through the S3 backend). ``URL`` is a run prefix as the publisher was given it; credentials
come from the environment, and store URLs are printed without user info or query strings.
Exit code 0 on success, 2 on anything deltasync refuses (a bad file, no manifest, a rejected update).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

from .errors import DeltaSyncError, ObjectNotFound, PreconditionFailed, StoreError, VersionError
from .format import Header, raw_header, read_header
from .manifest import (
    MANIFEST_KEY,
    RETIRE_GRACE_S,
    Manifest,
    VersionEntry,
    deletable,
    referenced_keys,
    replace_manifest,
    summarize,
)

if TYPE_CHECKING:
    from .stores import ObjectInfo, Store
    from .subscriber import Subscriber, UpdateInfo

__all__ = ["main"]


def _read(target: str) -> bytes:
    if "://" not in target or target.startswith("file://"):
        return Path(target.removeprefix("file://")).read_bytes()
    from .stores import open_store

    # The key is the last path component; everything before it is the store root.
    root, _, key = target.rpartition("/")
    with open_store(root) as store:
        return store.get(key)


def _part_sizes(data: bytes) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for key, entry in raw_header(data).items():
        if key == "__metadata__":
            continue
        name = key.split("::", 1)[0]
        start, end = entry["data_offsets"]
        sizes[name] = sizes.get(name, 0) + end - start
    return sizes


def describe(header: Header, data: bytes) -> dict[str, Any]:
    """A JSON-able description of a delta or anchor file."""
    sizes = _part_sizes(data)
    return {
        "kind": header.kind,
        "format_version": header.format_version,
        "version": header.version,
        "base_version": header.base_version,
        "fingerprint": header.fingerprint,
        "bytes": len(data),
        "dense_bytes": sum(e.spec.numel * e.spec.torch_dtype.itemsize for e in header.tensors.values())
        if header.kind == "anchor"
        else None,
        "numel": header.numel,
        "nnz": header.nnz,
        "sparsity": header.sparsity,
        "tensors": [
            {
                "name": name,
                "codec": e.codec,
                "dtype": e.spec.dtype,
                "shape": list(e.spec.shape),
                "nnz": e.nnz,
                "density": e.nnz / e.spec.numel if e.spec.numel else 0.0,
                "bytes": sizes.get(name, 0),
            }
            for name, e in header.tensors.items()
        ],
    }


def _print_inspect(info: dict[str, Any], limit: int) -> None:
    base = f" (base {info['base_version']})" if info["base_version"] is not None else ""
    print(f"{info['kind']} version {info['version']}{base}, format v{info['format_version']}")
    print(f"model fingerprint  {info['fingerprint']}")
    print(f"file size          {info['bytes']:,} bytes")
    print(f"elements           {info['nnz']:,} of {info['numel']:,} carried (sparsity {100 * info['sparsity']:.4f} %)")
    codecs: dict[str, int] = {}
    for t in info["tensors"]:
        codecs[t["codec"]] = codecs.get(t["codec"], 0) + 1
    print(f"tensors            {len(info['tensors'])} ({', '.join(f'{n} {c}' for c, n in sorted(codecs.items()))})")
    rows = sorted(info["tensors"], key=lambda t: -t["bytes"])[:limit]
    if not rows:
        return
    width = max(len(t["name"]) for t in rows)
    print(f"\n{'tensor':<{width}}  {'codec':<11} {'dtype':<5} {'shape':<14} {'changed':>10} {'density':>9} {'bytes':>11}")
    for t in rows:
        shape = "x".join(map(str, t["shape"])) or "scalar"
        print(
            f"{t['name']:<{width}}  {t['codec']:<11} {t['dtype']:<5} {shape:<14} "
            f"{t['nnz']:>10,} {100 * t['density']:>8.3f}% {t['bytes']:>11,}"
        )
    if len(info["tensors"]) > limit:
        print(f"... {len(info['tensors']) - limit} more (use --tensors N)")


def _cmd_inspect(args: argparse.Namespace) -> int:
    data = _read(args.file)
    info = describe(read_header(data), data)
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
    else:
        _print_inspect(info, args.tensors)
    return 0


# ---------------------------------------------------------------------- shared

WAIT_INTERVAL_S = 5.0  # how often `watch` looks for a first anchor on an empty prefix


def safe_url(url: str) -> str:
    """``url`` without user info, query string or fragment: nothing that can carry a credential."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def _open(url: str) -> Store:
    """Open an existing store, keeping credentials that a mistyped URL may carry out of messages."""
    from .stores import open_store

    if "://" not in url or url.startswith("file://"):
        # Opening a local store creates its directory; a read must not leave one behind.
        path = Path(unquote(urlsplit(url).path) if url.startswith("file://") else url).expanduser()
        if not path.is_dir():
            raise _no_manifest(url, "no such directory; ")
    try:
        return open_store(url)
    except ValueError as exc:
        raise StoreError(f"cannot open store: {str(exc).replace(url, safe_url(url))}") from None


def _no_manifest(url: str, why: str = "") -> ObjectNotFound:
    return ObjectNotFound(
        f"no {MANIFEST_KEY} at {safe_url(url)}: {why}nothing has been published there (check the URL)",
        key=MANIFEST_KEY,
    )


def _load_manifest(store: Store) -> tuple[Manifest, str | None]:
    """The manifest and its etag; a missing manifest is a clear, typed error."""
    try:
        got = store.get_if_changed(MANIFEST_KEY, None)
    except ObjectNotFound:
        raise _no_manifest(store.url) from None
    assert got is not None  # no etag given, so the object is always returned
    data, info = got
    return Manifest.from_bytes(data), info.etag


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.1f} {unit}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = abs(seconds)
    for limit, unit, scale in ((60, "s", 1), (3600, "min", 60), (86400, "h", 3600)):
        if s < limit:
            break
    else:
        unit, scale = "d", 86400
    text = f"{s / scale:.1f} {unit}"
    return text if seconds >= 0 else f"-{text}"


def _printable(value: Any, limit: int = 64) -> str:
    """Text from the store, made safe for a terminal (no control sequences) and short."""
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------- status


def collect_status(url: str, manifest: Manifest, acks: Sequence[Any], *, now: float, limit: int) -> dict[str, Any]:
    """Everything ``deltasync status`` shows, JSON-able (ages in seconds relative to ``now``)."""
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
        "delta_bytes": sizes["delta_bytes"],
        "anchor_bytes": sizes["anchor_bytes"],
        "total_bytes": sizes["delta_bytes"] + sizes["anchor_bytes"],
        "retired_pending": len(manifest.retired),
        "versions": [_version_row(e, manifest.numel, now) for e in newest],
        "replicas": sorted(replicas, key=lambda r: r["replica"]),
    }


def _version_row(entry: VersionEntry, numel: int, now: float) -> dict[str, Any]:
    kinds = [k for k, refs in (("delta", entry.delta), ("anchor", entry.anchor)) if refs]
    return {
        "version": entry.version,
        "step": entry.step,
        "kinds": kinds,
        "nnz": entry.nnz,
        # An anchor-only version carries everything; "changed" is only defined against a previous version.
        "sparsity": (1.0 - entry.nnz / numel if numel else 1.0) if entry.delta else None,
        "bytes": entry.delta_bytes + entry.anchor_bytes,
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
    lease_text = f"lease live, {_duration(lease)} left" if lease > 0 else f"lease expired {_duration(-lease)} ago"
    print(f"store      {info['store']}")
    print(f"run        {info['run_id']}")
    print(f"model      {info['fingerprint']} ({info['numel']:,} elements)")
    print(f"writer     {info['writer'][:12]} ({lease_text})")
    latest = info["latest"]
    if latest is None:
        print("latest     none published yet")
    else:
        print(f"latest     v{latest['version']} (step {latest['step']}), published {_duration(latest['age_s'])} ago")
    anchors = ", ".join(f"v{a['version']} ({_size(a['bytes'])})" for a in info["anchors"]) or "none"
    print(f"anchors    {anchors}")
    print(
        f"stored     {info['versions_listed']} versions: deltas {_size(info['delta_bytes'])}, anchors "
        f"{_size(info['anchor_bytes'])}, total {_size(info['total_bytes'])}; "
        f"{info['retired_pending']} retired objects pending deletion"
    )
    _print_versions(info["versions"])
    _print_replicas(info["replicas"])


def _print_versions(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print(f"\n{'version':>8} {'step':>8}  {'kind':<12} {'changed':>12} {'sparsity':>10} {'bytes':>11}  published")
    for r in rows:
        sparsity = f"{100 * r['sparsity']:.3f}%" if r["sparsity"] is not None else "-"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["time"]))
        step = "-" if r["step"] is None else r["step"]
        print(
            f"{r['version']:>8} {step:>8}  {'+'.join(r['kinds']):<12} {r['nnz']:>12,} {sparsity:>10} "
            f"{_size(r['bytes']):>11}  {stamp} ({_duration(r['age_s'])} ago)"
        )


def _print_replicas(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("\nreplicas   none have acknowledged a version (acks/ is empty)")
        return
    width = max(7, *(len(r["replica"]) for r in rows))
    print(f"\n{'replica':<{width}} {'version':>8} {'lag':>9} {'acked':>13} {'apply ms':>9}  rejected")
    for r in rows:
        version = "-" if r["version"] is None else r["version"]
        lag = "other run" if not r["same_run"] else "-" if r["lag_versions"] is None else r["lag_versions"]
        apply_ms = "-" if r["apply_ms"] is None else f"{r['apply_ms']:.1f}"
        rejected = ", ".join(f"{k} {n}" for k, n in sorted(r["rejected"].items())) or "-"
        acked = f"{_duration(r['ack_age_s'])} ago" if r["ack_age_s"] is not None else "?"
        print(f"{r['replica']:<{width}} {version:>8} {lag:>9} {acked:>13} {apply_ms:>9}  {rejected}")


def _cmd_status(args: argparse.Namespace) -> int:
    from .subscriber import read_acks

    with _open(args.url) as store:
        manifest, _ = _load_manifest(store)
        acks = read_acks(store)
    now = time.time()
    info = collect_status(store.url, manifest, acks, now=now, limit=args.versions)
    if args.json:
        json.dump(info, sys.stdout, indent=2)
        print()
    else:
        _print_status(info, now)
    return 0


# ---------------------------------------------------------------------- gc


def _gc_retired(
    store: Store, manifest: Manifest, etag: str | None, *, now: float, grace: float, dry_run: bool
) -> tuple[list[tuple[str, int | None]], str | None]:
    """Retired objects past their grace: deleted after a compare-and-swap manifest write drops them.

    Returns:
        `(removed, note)`: ``(key, size)`` of what was (or would be) deleted, and why nothing was, if so.
    """
    due, remaining = deletable(manifest, now=now, grace=grace)
    if not due:
        return [], None
    if not store.conditional_writes or etag is None:
        return [], f"{len(due)} retired objects are due, but this store has no compare-and-swap: left to the publisher"
    if manifest.lease_until > now:
        # Our write would change the etag under the live writer, whose next commit would then fail.
        return [], (
            f"{len(due)} retired objects are due, but writer {manifest.writer[:8]} holds the lease for another "
            f"{_duration(manifest.lease_until - now)} and deletes them itself: manifest left alone"
        )
    removed = [(key, _object_size(store, key)) for key in due]
    if dry_run:
        return removed, None
    try:
        store.put(MANIFEST_KEY, replace_manifest(remaining, updated=now).to_bytes(), if_match=etag)
    except PreconditionFailed:
        return [], "the manifest changed while gc ran (a publisher is active): retired objects left alone; run gc again"
    for key, _ in removed:
        store.delete(key)
    return removed, None


def _object_size(store: Store, key: str) -> int | None:
    try:
        return store.head(key).size
    except ObjectNotFound:
        return None


def _gc_orphans(
    store: Store, manifest: Manifest, *, now: float, grace: float, dry_run: bool
) -> list[tuple[str, int | None]]:
    """Objects under ``deltas/`` and ``anchors/`` that no manifest names, older than ``grace``."""
    from .publisher import sweep_orphans

    # The same rule as sweep_orphans, read first: it reports keys only, and --dry-run deletes nothing.
    referenced = referenced_keys(manifest)
    candidates: dict[str, ObjectInfo] = {
        info.key: info
        for prefix in ("deltas/", "anchors/")
        for info in store.list(prefix)
        if info.key not in referenced and (info.modified is None or now - info.modified >= grace)
    }
    if dry_run:
        return [(key, info.size) for key, info in candidates.items()]
    removed = sweep_orphans(store, manifest, now=now, grace=grace)
    return [(key, candidates[key].size if key in candidates else None) for key in removed]


def _cmd_gc(args: argparse.Namespace) -> int:
    from .publisher import ORPHAN_GRACE_S

    with _open(args.url) as store:
        manifest, etag = _load_manifest(store)
        now = time.time()
        retire_grace = RETIRE_GRACE_S if args.grace is None else args.grace
        orphan_grace = ORPHAN_GRACE_S if args.grace is None else args.grace
        notes = []
        if manifest.lease_until > now and orphan_grace < ORPHAN_GRACE_S:
            # A live writer's uploads are unnamed until its manifest write: they look like orphans.
            notes.append(f"a writer's lease is live: orphans younger than {ORPHAN_GRACE_S:.0f} s are kept")
            orphan_grace = ORPHAN_GRACE_S
        retired, note = _gc_retired(store, manifest, etag, now=now, grace=retire_grace, dry_run=args.dry_run)
        orphans = _gc_orphans(store, manifest, now=now, grace=orphan_grace, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"gc {safe_url(store.url)}{' (dry run)' if args.dry_run else ''}")
    for label, removed in (("retired", retired), ("orphan", orphans)):
        for key, size in removed:
            print(f"  {verb} {label:<8} {key}  {_size(size)}")
    for line in ([note] if note else []) + notes:
        print(f"  note: {line}")
    total = sum(size or 0 for _, size in retired + orphans)
    count = len(retired) + len(orphans)
    print(f"{'would free' if args.dry_run else 'freed'} {_size(total)} ({total:,} bytes) in {count} objects")
    return 0


# ---------------------------------------------------------------------- watch


def _cmd_watch(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    directory = Path(args.model)
    replica = args.replica_id or f"watch-{socket.gethostname()}-{directory.resolve().name}"
    stop = threading.Event()
    try:
        from .appliers.checkpoint import has_checkpoint

        if not has_checkpoint(directory) and not _initialise(args, directory, replica, stop):
            return 0
        return _watch(args, directory, replica, stop)
    except KeyboardInterrupt:
        print("interrupted; the checkpoint records the last version applied", file=sys.stderr)
        return 0


def _watch(args: argparse.Namespace, directory: Path, replica: str, stop: threading.Event) -> int:
    from .appliers.checkpoint import CheckpointDirApplier
    from .subscriber import Subscriber

    applier = CheckpointDirApplier(directory)
    resume = applier.resume_options()
    sub = Subscriber(
        args.url, applier, replica_id=replica, ack=not args.no_ack, **resume, **_poll_options(args)
    )
    sub.add_hook(applier.recorder(sub))
    sub.add_hook(_print_update)
    where = (
        f"v{resume['start_version']} of run {resume['run_id'][:8]}"
        if resume
        else "no resumable version: the next update uses an anchor"
    )
    print(f"watching {safe_url(sub.store.url)} into {directory} ({where})", flush=True)
    try:
        if args.once:
            if sub.update() is None:
                if sub.latest is None:
                    raise VersionError(f"no versions published at {safe_url(sub.store.url)} yet")
                print(f"up to date at v{sub.version}", flush=True)
            return 0
        _follow(sub, stop)
        print(f"stopped at v{sub.version}", flush=True)
        return 0
    finally:
        sub.close()
        applier.close()


def _poll_options(args: argparse.Namespace) -> dict[str, float]:
    return {} if args.interval is None else {"poll_interval": args.interval, "max_poll_interval": args.interval}


def _print_update(info: UpdateInfo) -> None:
    print(
        f"v{info.version} (step {info.step}) from {info.previous} via {'+'.join(info.route)}: "
        f"{info.bytes:,} bytes, apply {1e3 * info.t_apply:.1f} ms, lag {info.lag_s:.2f} s",
        flush=True,
    )


def _follow(sub: Subscriber, stop: threading.Event) -> None:
    """Follow until Ctrl-C or SIGTERM; an update in progress finishes first, a crash is re-raised."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set()) if in_main else None
    failures: list[BaseException] = []

    def follow() -> None:
        try:
            sub.run(stop)  # bad input is counted and logged inside; anything else ends the watch
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            failures.append(exc)
        finally:
            stop.set()

    thread = threading.Thread(target=follow, name="deltasync-watch", daemon=True)
    thread.start()
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        stop.set()
    finally:
        stop.set()
        thread.join()
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    if failures:
        raise failures[0]


def _anchor_published(url: str) -> bool:
    try:
        with _open(url) as store:
            manifest, _ = _load_manifest(store)
    except ObjectNotFound:
        return False
    return bool(manifest.anchors())


def _wait_for_anchor(args: argparse.Namespace, stop: threading.Event) -> bool:
    """Whether an anchor is published; waits for one unless ``--once`` (``False``: stopped)."""
    while not _anchor_published(args.url):
        if args.once:
            raise VersionError(
                f"nothing published at {safe_url(args.url)} yet: no anchor to initialise {args.model} from"
            )
        print(f"waiting for a first anchor at {safe_url(args.url)}", flush=True)
        if stop.wait(args.interval or WAIT_INTERVAL_S):
            return False
    return True


def _initialise(args: argparse.Namespace, directory: Path, replica: str, stop: threading.Event) -> bool:
    """Create the checkpoint from the newest anchor; ``False`` if stopped while waiting for one."""
    from .appliers.checkpoint import SINGLE_FILE, initialise_checkpoint

    if not _wait_for_anchor(args, stop):
        return False
    info = initialise_checkpoint(directory, args.url, replica_id=replica, ack=not args.no_ack, on_update=_print_update)
    print(f"initialised {directory / SINGLE_FILE} at v{info.version}", flush=True)
    return True


# ---------------------------------------------------------------------- parser


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(prog="deltasync", description="Exact sparse weight sync through object storage.")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="show a delta or anchor file's metadata and per-tensor contents")
    inspect.add_argument("file", help="a path, or a store URL ending in the object key")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    inspect.add_argument("--tensors", type=int, default=20, metavar="N", help="largest N tensors to list (default 20)")
    inspect.set_defaults(func=_cmd_inspect)

    status = sub.add_parser("status", help="show a run prefix: writer, versions, anchors, sizes, replica lag")
    status.add_argument("url", help="the run prefix, e.g. ./run1 or s3://bucket/run1")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument("--versions", type=int, default=10, metavar="N", help="newest N versions to list (default 10)")
    status.set_defaults(func=_cmd_status)

    gc = sub.add_parser("gc", help="delete retired objects past their grace period and orphans of crashed publishes")
    gc.add_argument("url", help="the run prefix")
    gc.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
    gc.add_argument(
        "--grace", type=float, default=None, metavar="SECONDS",
        help="minimum age of what is deleted (default: 300 s for retired objects, 3600 s for orphans)",
    )
    gc.set_defaults(func=_cmd_gc)

    watch = sub.add_parser("watch", help="keep a local safetensors checkpoint directory at the latest version")
    watch.add_argument("url", help="the run prefix")
    watch.add_argument(
        "--model", required=True, metavar="DIR", help="checkpoint directory (initialised from an anchor if empty)"
    )
    watch.add_argument("--once", action="store_true", help="apply what is available, then exit")
    watch.add_argument(
        "--interval", type=float, default=None, metavar="S",
        help="seconds between polls (default: 1 s after a change, backing off to 15 s)",
    )
    watch.add_argument("--replica-id", default=None, help="name in acks/ (default: watch-HOST-DIRNAME)")
    watch.add_argument("--no-ack", action="store_true", help="do not write acks/<replica>.json")
    watch.set_defaults(func=_cmd_watch)

    from .demo import add_arguments as _demo_arguments

    demo = sub.add_parser("demo", help="train SmolLM2-135M on CPU, publish every step, two replicas follow bit-exactly")
    _demo_arguments(demo).set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``deltasync`` command."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except DeltaSyncError as exc:
        print(f"deltasync {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"deltasync {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
