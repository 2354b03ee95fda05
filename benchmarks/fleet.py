"""Fleet: N replica processes following one store, with and without the shared object cache.

A publisher in this process applies random sparse updates to a synthetic model
(``deltasync.demo.workload``: fp32 and bf16 tensors, about ``--scales`` million
elements) and publishes ``--versions`` deltas after an anchor, one at a time: it
publishes version v, waits until every replica holds it, then trains the next
step. Each replica is a spawned process with a real
:class:`~deltasync.replica.subscriber.Subscriber` and
:class:`~deltasync.appliers.TorchModuleApplier`; its store is tapped by a
:class:`CountingStore` *below* the cache, so what the tap counts is what the
object store served. With ``cache_dir`` the replicas share one
:class:`~deltasync.replica.cache.CachedStore` directory (``/dev/shm``).

Per version: the time from the manifest commit until the last replica applied
it, and the requests and bytes of version objects the store served to the whole
fleet (manifest polls are counted apart; they pass through the cache). The same
replica processes run every backend and mode in turn, so the modes are compared
on the same processes in the same run.

    python benchmarks/fleet.py                  # 8 replicas; local dir and loopback S3 (moto); 16M and 64M elements
    python benchmarks/fleet.py --scales 16 --backends s3
    python benchmarks/fleet.py --quick          # smoke run: 3 replicas, 2 versions (results in a temp dir)

``tests/test_fleet.py`` drives the same harness with a small model and checks
every recorded weights digest against the publisher's.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import human_bytes, loopback_store, machine, median, results_dir, table, write_json  # noqa: E402

from deltasync.appliers import TorchModuleApplier  # noqa: E402
from deltasync.demo import CommitHasher  # noqa: E402
from deltasync.demo.workload import make_weights, train_step  # noqa: E402
from deltasync.protocol.manifest import MANIFEST_KEY  # noqa: E402
from deltasync.publish.publisher import Publisher  # noqa: E402
from deltasync.replica.cache import CachedStore  # noqa: E402
from deltasync.replica.subscriber import Subscriber, UpdateInfo  # noqa: E402
from deltasync.stores import ObjectInfo, Store, open_store  # noqa: E402
from deltasync.stores.wrap import DelegatingStore  # noqa: E402
from deltasync.tensors import published_tensors, weights_digest  # noqa: E402

REPLICAS = 8
VERSIONS = 8  # deltas after the first anchor: enough for a stable median
SCALES = "16,64"  # million elements (about): 32 MB and 128 MB bf16 anchors (8 replicas fit a shared 24 GB machine)
POLL_S = 0.02  # replicas poll fast after a change, so the time to all shows the sync, not a poll interval
MAX_POLL_S = 0.1  # idle backoff cap (8 replicas polling a loopback server share 2 cores with it)
ROUNDS = 2  # each mode runs this often; times are medians over rounds (the machine is shared)
WAIT_S = 180.0  # liveness bound: a replica that has not reached a version by then is reported lost


# ---------------------------------------------------------------------- the tap


class CountingStore(DelegatingStore):
    """Counts reads that reach ``inner``: requests and bytes, manifest and objects apart."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _add(self, key: str, nbytes: int) -> None:
        kind = "manifest" if key == MANIFEST_KEY else "acks" if key.startswith("acks/") else "objects"
        with self._lock:
            self.counts[f"{kind}_requests"] += 1
            self.counts[f"{kind}_bytes"] += nbytes

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        data = self.inner.get(key, max_bytes=max_bytes)
        self._add(key, len(data))
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        data = self.inner.get_range(key, start, end)
        self._add(key, len(data))
        return data

    def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, ObjectInfo] | None:
        got = self.inner.get_if_changed(key, etag, max_bytes=max_bytes)
        self._add(key, len(got[0]) if got else 0)
        return got

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


# ---------------------------------------------------------------------- replica process


def replica_main(name: str, conn: Connection) -> None:
    """One replica: follows whatever store the parent names, until told to exit.

    Commands: ``("follow", url, options, scale, cache_dir, check)``, ``("stop",)``, ``("exit",)``.
    Sends ``("ready", name)``, ``("applied", name, version, time, digest | None, counts)``,
    ``("final", name, version, digest, counts, cache_stats, rejected)``, ``("error", name, traceback)``.
    """
    send_lock = threading.Lock()  # the follow thread and this one both send

    def send(msg: tuple[Any, ...]) -> None:
        with send_lock:
            conn.send(msg)

    try:
        torch.set_num_threads(1)
        while True:
            command = conn.recv()
            if command[0] == "exit":
                return
            _, url, options, scale, cache_dir, check = command
            # Other initial weights than the trainer's: whatever matches came through the store.
            weights = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in make_weights(scale).items()}
            applier = TorchModuleApplier(weights)
            tap = CountingStore(open_store(url, **options))
            store = CachedStore(tap, cache_dir) if cache_dir else tap

            def on_update(info: UpdateInfo, applier: TorchModuleApplier = applier, tap: CountingStore = tap) -> None:
                when = time.time()  # the version is in place: hashing below is bookkeeping
                digest = weights_digest(applier.state().items()) if check else None
                send(("applied", name, info.version, when, digest, tap.snapshot()))

            with Subscriber(
                store, applier, replica_id=name, poll_interval=POLL_S, max_poll_interval=MAX_POLL_S, on_update=on_update
            ) as sub:
                sub.start()
                send(("ready", name))
                command = conn.recv()
                sub.stop()
                cache = store.stats.as_dict() if store is not tap else None  # type: ignore[attr-defined]
                digest = weights_digest(applier.state().items())
                send(("final", name, sub.version, digest, tap.snapshot(), cache, dict(sub.stats.rejected)))
            if command[0] == "exit":
                return
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:
        send(("error", name, traceback.format_exc()))
    finally:
        conn.close()


# ---------------------------------------------------------------------- parent


@dataclass
class Member:
    """The parent's view of one replica process."""

    name: str
    process: Any
    conn: Connection
    version: int | None = None
    applied: list[tuple[int, float, str | None, dict[str, int]]] = field(default_factory=list)
    """(version, time, digest, cumulative store counts) per update."""
    final: tuple[Any, ...] | None = None


class Fleet:
    """``n`` spawned replica processes that follow one store at a time."""

    def __init__(self, n: int = REPLICAS) -> None:
        ctx = mp.get_context("spawn")
        self.members: list[Member] = []
        for i in range(n):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=replica_main, args=(f"replica-{i}", child), daemon=True)
            process.start()
            child.close()
            self.members.append(Member(f"replica-{i}", process, parent))

    def _receive(self, timeout: float) -> None:
        conns = {m.conn: m for m in self.members}
        for conn in wait(list(conns), timeout=timeout):
            member = conns[conn]  # type: ignore[index]
            try:
                msg = conn.recv()  # type: ignore[union-attr]
            except EOFError:
                raise RuntimeError(f"{member.name} died (exit code {member.process.exitcode})") from None
            if msg[0] == "error":
                raise RuntimeError(f"{member.name} failed:\n{msg[2]}")
            if msg[0] == "ready":
                member.version = -1
            elif msg[0] == "applied":
                member.version = msg[2]
                member.applied.append((msg[2], msg[3], msg[4], msg[5]))
            elif msg[0] == "final":
                member.final = msg[2:]

    def _until(self, done: Any, what: str, timeout: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas did not {what} within {timeout:.0f} s")
            self._receive(min(1.0, max(0.0, deadline - time.monotonic())))

    def follow(self, url: str, options: dict[str, Any], scale: int, cache_dir: str | None, *, check: bool) -> None:
        """Start following ``url`` (a model of ``scale``) in every replica; returns once all follow it."""
        for m in self.members:
            m.version, m.applied, m.final = None, [], None
            m.conn.send(("follow", url, options, scale, cache_dir, check))
        self._until(lambda: all(m.version is not None for m in self.members), "start following")

    def wait_for(self, version: int) -> None:
        """Until every replica has applied ``version`` (or a later one)."""
        reached = lambda: all(m.version is not None and m.version >= version for m in self.members)  # noqa: E731
        self._until(reached, f"reach v{version}")

    def stop(self) -> None:
        """Stop following; every replica reports its final state."""
        for m in self.members:
            m.conn.send(("stop",))
        self._until(lambda: all(m.final is not None for m in self.members), "stop")

    def close(self) -> None:
        for m in self.members:
            try:
                m.conn.send(("exit",))
            except OSError:
                pass
        for m in self.members:
            m.process.join(30)
            if m.process.is_alive():
                m.process.terminate()
            m.conn.close()


@dataclass
class Commit:
    """One committed version as the publisher saw it."""

    version: int
    kind: str
    bytes: int
    time: float
    digest: str | None


def run_versions(
    fleet: Fleet,
    url: str,
    options: dict[str, Any],
    *,
    versions: int,
    scale: int,
    cache_dir: str | None,
    check: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Publish an anchor and ``versions`` deltas to ``url`` in lockstep with the fleet; measure each.

    Returns the commits, every replica's updates and final state, per-version rows
    and the trainer's own bf16 digest of its final weights.
    """
    weights = make_weights(scale, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    events: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    hasher = CommitHasher(events)
    fleet.follow(url, options, scale, cache_dir, check=check)
    commits: dict[int, Commit] = {}
    rows = []
    with Publisher(weights, url, on_publish=hasher, **options) as publisher:
        hasher.publisher = publisher
        for step in range(versions + 1):
            if step:
                train_step(weights, step, g)
            publisher.publish(step)
            publisher.flush()
            while not events.empty():
                event = events.get()
                if event[0] == "commit":
                    info = event[1]
                    commits[info["version"]] = Commit(info["version"], info["kind"], info["bytes"], event[2], event[3])
            version = publisher.version
            assert version is not None
            fleet.wait_for(version)
            rows.append(_row(fleet, commits[version]))
    fleet.stop()
    return {
        "commits": commits,
        "rows": rows,
        "members": fleet.members,
        "trainer_digest": weights_digest(published_tensors(weights)),
    }


def _row(fleet: Fleet, commit: Commit) -> dict[str, Any]:
    """What reaching ``commit`` cost the fleet: time until the last replica, store reads in between."""
    reads: Counter[str] = Counter()
    last = 0.0
    for m in fleet.members:
        mine = [a for a in m.applied if a[0] == commit.version]
        before = [a for a in m.applied if a[0] < commit.version]
        if mine:
            last = max(last, mine[0][1])
            reads.update(Counter(mine[0][3]) - Counter(before[-1][3] if before else {}))
    return {
        "version": commit.version,
        "kind": commit.kind,
        "object_bytes": commit.bytes,
        "t_all_s": round(max(0.0, last - commit.time), 4),
        "store_object_requests": reads["objects_requests"],
        "store_object_bytes": reads["objects_bytes"],
    }


# ---------------------------------------------------------------------- benchmark


def summarize(rounds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of the time to all replicas (anchor, deltas) over rounds; store reads per round."""
    anchors = [rows[0] for rows in rounds]
    deltas = [r for rows in rounds for r in rows if r["kind"] == "delta"]
    per_round = lambda field: round(sum(r[field] for rows in rounds for r in rows) / len(rounds))  # noqa: E731
    return {
        "anchor_bytes": anchors[0]["object_bytes"],
        "anchor_t_all_s_median": round(median([r["t_all_s"] for r in anchors]), 4),
        "delta_t_all_s_median": round(median([r["t_all_s"] for r in deltas]), 4) if deltas else None,
        "delta_object_bytes_median": median([r["object_bytes"] for r in deltas]) if deltas else None,
        "store_object_bytes": per_round("store_object_bytes"),
        "store_object_requests": per_round("store_object_requests"),
        "published_object_bytes": per_round("object_bytes"),
    }


def _fresh_cache_dir(base: str, label: str) -> str:
    path = Path(base) / f"deltasync-fleet-{os.getpid()}-{label}"
    shutil.rmtree(path, ignore_errors=True)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=REPLICAS)
    parser.add_argument("--versions", type=int, default=VERSIONS, help="deltas after the first anchor")
    parser.add_argument(
        "--scales", default=SCALES, help="comma-separated model sizes in millions of elements (135: SmolLM2-135M)"
    )
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="repeats of every model size, backend and mode")
    parser.add_argument("--backends", default="local,s3", help="comma-separated: local, s3 (loopback moto)")
    parser.add_argument("--cache-base", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--quick", action="store_true", help="3 replicas, 2 versions, scale 1 (results in a temp dir)")
    parser.add_argument("--results-dir", help="where to write fleet.json (default: results/, quick: a temp dir)")
    args = parser.parse_args(argv)
    if args.quick:
        args.replicas, args.versions, args.scales, args.rounds = 3, 2, "1", 1
    scales = [int(x) for x in args.scales.split(",")]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]

    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        s3 = stack.enter_context(loopback_store("s3", "fleet")) if "s3" in backends else None
        fleet = Fleet(args.replicas)
        stack.callback(fleet.close)
        # Rounds outermost and modes adjacent: a burst of load on the shared machine hits both modes.
        for round_, scale, backend, mode in itertools.product(
            range(args.rounds), scales, backends, ("direct", "cache")
        ):
            label = f"{backend}-{mode}-{scale}m-r{round_}"
            url, options = (f"{s3[0]}-{label}", s3[1]) if backend == "s3" and s3 else (str(Path(tmp) / label), {})
            cache_dir = _fresh_cache_dir(args.cache_base, label) if mode == "cache" else None
            try:
                result = run_versions(fleet, url, options, versions=args.versions, scale=scale, cache_dir=cache_dir)
            finally:
                if cache_dir:
                    shutil.rmtree(cache_dir, ignore_errors=True)
            summary = summarize([result["rows"]])
            exact = all(m.final[1] == result["trainer_digest"] for m in result["members"])
            runs.append({
                "round": round_, "scale_m": scale, "backend": backend, "mode": mode, "exact": exact,
                "summary": summary, "versions": result["rows"],
            })
            print(
                f"{label}: anchor to all {summary['anchor_t_all_s_median']:.2f} s, deltas to all "
                f"{summary['delta_t_all_s_median']:.3f} s (median), store served "
                f"{human_bytes(summary['store_object_bytes'])} in "
                f"{summary['store_object_requests']} object reads, exact {exact}",
                flush=True,
            )

    comparison = _compare(runs)
    payload = {
        "benchmark": "fleet",
        "machine": machine(),
        "replicas": args.replicas,
        "versions": args.versions,
        "rounds": args.rounds,
        "poll_s": [POLL_S, MAX_POLL_S],
        "comparison": comparison,
        "runs": runs,
    }
    path = write_json("fleet", payload, results_dir(args.quick, args.results_dir))
    print()
    print(_table(comparison, args.replicas))
    print(f"wrote {path}")
    return 0 if all(r["exact"] for r in runs) else 1


def _table(comparison: list[dict[str, Any]], replicas: int) -> str:
    rows = [
        [
            f"{c['scale_m']}M",
            c["backend"],
            human_bytes(c["published_bytes"]),
            f"{human_bytes(c['direct_bytes'])} / {c['direct_requests']}",
            f"{human_bytes(c['cache_bytes'])} / {c['cache_requests']}",
            f"{c['bytes_ratio']:.1f}x",
            f"{c['direct_anchor_s']:.2f} / {c['cache_anchor_s']:.2f}",
            f"{c['direct_delta_s']:.3f} / {c['cache_delta_s']:.3f}",
        ]
        for c in comparison
    ]
    header = [
        "model",
        "store",
        "published",
        "store served, direct (bytes / reads)",
        "store served, cache (bytes / reads)",
        "direct / cache",
        f"anchor to all {replicas}, s (direct / cache)",
        f"delta to all {replicas}, median s (direct / cache)",
    ]
    return table(rows, header)


def _compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model size and backend: direct against cache, over every round of the same run."""
    out = []
    for scale, backend in dict.fromkeys((r["scale_m"], r["backend"]) for r in runs):
        rounds = {
            mode: [r["versions"] for r in runs if (r["scale_m"], r["backend"], r["mode"]) == (scale, backend, mode)]
            for mode in ("direct", "cache")
        }
        direct, cache = summarize(rounds["direct"]), summarize(rounds["cache"])
        out.append({
            "scale_m": scale,
            "backend": backend,
            "rounds": len(rounds["direct"]),
            "published_bytes": direct["published_object_bytes"],
            "direct_bytes": direct["store_object_bytes"],
            "direct_requests": direct["store_object_requests"],
            "cache_bytes": cache["store_object_bytes"],
            "cache_requests": cache["store_object_requests"],
            "bytes_ratio": round(direct["store_object_bytes"] / max(1, cache["store_object_bytes"]), 2),
            "direct_anchor_s": direct["anchor_t_all_s_median"],
            "cache_anchor_s": cache["anchor_t_all_s_median"],
            "direct_delta_s": direct["delta_t_all_s_median"],
            "cache_delta_s": cache["delta_t_all_s_median"],
        })
    return out


if __name__ == "__main__":
    sys.exit(main())
