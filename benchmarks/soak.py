"""Long soak: thousands of versions, restarting replica processes, bounded store, flat memory.

A trainer in this process applies random sparse updates (an occasional dense
tensor, special values +-0, NaN, +-inf) to about 1M fp32 and bf16 elements and
publishes every step; every fourth publish does not wait for the previous upload
and may coalesce. Replica *processes* (spawned) follow the store and restart
their ``Subscriber`` at random: resuming from their version
(``start_version``/``run_id``), without a version (anchor route), or cold
(weights wiped). The parent also SIGKILLs a replica now and then and spawns a
cold one in its place, and one replica joins half way.

Checked, and written to ``benchmarks/results/soak.json``:

- every update any replica applied holds exactly the publisher's snapshot of
  that version (SHA-256 of the bf16 bit patterns), and every replica ends at
  the last version, bit-identical to the trainer's bf16 cast;
- the bytes listed in the store never exceed
  ``(keep_anchors + 1) x anchor + ((keep_anchors + 1) x anchor_every + 2) x delta``
  plus the manifest, the acks and whatever retired objects still wait out their
  grace period, and nothing is left that no manifest names;
- the resident memory of the trainer (and its Python heap, by tracemalloc) and
  of each replica process is flat: growth from the first quarter of the run to
  its end stays under ``--rss-slack-mb``.

    python benchmarks/soak.py                       # 2000 versions on a local directory
    python benchmarks/soak.py --versions 300 --moto # on a loopback S3 server (moto)
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import random
import sys
import tempfile
import time
import traceback
import tracemalloc
from collections import Counter
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import human_bytes, loopback_store, machine, write_json  # noqa: E402

from deltasync.appliers import TorchModuleApplier  # noqa: E402
from deltasync.demo.workload import make_weights, train_step  # noqa: E402
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest  # noqa: E402
from deltasync.protocol.retired import named_keys  # noqa: E402
from deltasync.publish.publisher import Publisher, PublishInfo  # noqa: E402
from deltasync.replica.subscriber import Subscriber, UpdateInfo  # noqa: E402
from deltasync.stores import open_store  # noqa: E402
from deltasync.tensors import weights_digest as digest  # noqa: E402

RSS_EVERY_S = 1.0  # replicas report their resident memory this often
FINISH_S = 180.0  # liveness bound for the final catch-up of a replica


# ---------------------------------------------------------------------- model and updates


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------- replica process


def replica_main(
    name: str, url: str, options: dict[str, Any], scale: int, seed: int, conn: Connection, control: Any
) -> None:
    """Follow ``url``, restarting the Subscriber at random, until ``control`` names a final version.

    Sends ``("applied", name, version, digest, route)``, ``("rss", name, bytes)``,
    ``("final", name, version, digest, rejected, restarts)`` or ``("error", name, traceback)``.
    """
    try:
        torch.set_num_threads(1)
        rng = random.Random(seed)
        weights = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in make_weights(scale).items()}
        applier = TorchModuleApplier(weights)
        rejected: Counter[str] = Counter()
        restarts: Counter[str] = Counter()
        last_rss = 0.0

        def on_update(info: UpdateInfo) -> None:
            nonlocal last_rss
            conn.send(("applied", name, info.version, digest(applier.state().items()), info.route))
            if time.monotonic() - last_rss > RSS_EVERY_S:
                last_rss = time.monotonic()
                conn.send(("rss", name, rss_bytes()))

        def subscriber(version: int | None, run_id: str | None) -> Subscriber:
            return Subscriber(
                url, applier, replica_id=name, poll_interval=0.005, max_poll_interval=0.05,
                on_update=on_update, start_version=version, run_id=run_id, **options,
            )

        version = run_id = None
        while True:
            sub = subscriber(version, run_id).start()
            try:
                target = control.get(timeout=rng.uniform(0.05, 1.0))  # a random lifetime
            except queue.Empty:
                target = None
            sub.close()
            rejected.update(sub.stats.rejected)
            version, run_id = sub.version, sub.run_id
            if target is not None:
                break
            roll = rng.random()
            if roll < 0.6 and version is not None:
                restarts["resume"] += 1
            elif roll < 0.85:
                restarts["no-version"] += 1
                version = run_id = None
            else:
                restarts["cold"] += 1
                for t in weights.values():
                    t.zero_()
                version = run_id = None
        with subscriber(version, run_id) as sub:
            sub.start()
            sub.wait_for(target, timeout=FINISH_S)
            rejected.update(sub.stats.rejected)
            conn.send(("final", name, sub.version, digest(applier.state().items()), dict(rejected), dict(restarts)))
    except BaseException:
        conn.send(("error", name, traceback.format_exc()))
    finally:
        conn.close()


class Replica:
    """Parent's handle on one replica process."""

    def __init__(self, ctx: Any, name: str, url: str, options: dict[str, Any], scale: int, seed: int) -> None:
        self.name = name
        self.conn, child = ctx.Pipe(duplex=False)
        self.control = ctx.Queue()
        self.process = ctx.Process(
            target=replica_main, args=(name, url, options, scale, seed, child, self.control), daemon=True
        )
        self.process.start()
        child.close()
        self.started = time.monotonic()
        self.rss: list[tuple[float, int]] = []
        self.final: tuple[Any, ...] | None = None
        self.alive = True


# ---------------------------------------------------------------------- parent


class Soak:
    """Runs the trainer loop, the replica processes and every check."""

    def __init__(self, args: argparse.Namespace, url: str, options: dict[str, Any]) -> None:
        self.args, self.url, self.options = args, url, options
        self.ctx = mp.get_context("spawn")
        self.rng = random.Random(args.seed)
        self.snapshot_digests: dict[int, str] = {}
        self.infos: list[PublishInfo] = []
        self.replicas: dict[str, Replica] = {}
        self.applied: list[tuple[str, int, str, tuple[str, ...]]] = []
        self.retired_rss: list[list[tuple[float, int]]] = []
        self.kills = 0
        self.errors: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.memory: list[dict[str, Any]] = []
        self.seeds = iter(range(args.seed * 1000, args.seed * 1000 + 10_000))

    def spawn(self, name: str) -> None:
        self.replicas[name] = Replica(self.ctx, name, self.url, self.options, self.args.scale, next(self.seeds))

    def drain(self, timeout: float = 0.0) -> None:
        """Read whatever the replicas sent."""
        conns = {r.conn: r for r in self.replicas.values() if r.alive}
        for conn in wait(list(conns), timeout=timeout):
            replica = conns[conn]  # type: ignore[index]
            try:
                while replica.alive and conn.poll():  # type: ignore[union-attr]
                    self._handle(replica, conn.recv())  # type: ignore[union-attr]
            except EOFError:
                replica.alive = False

    def _handle(self, replica: Replica, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "applied":
            self.applied.append((msg[1], msg[2], msg[3], tuple(msg[4])))
        elif kind == "rss":
            replica.rss.append((time.monotonic() - replica.started, msg[2]))
        elif kind == "final":
            replica.final = msg[2:]
        elif kind == "error":
            self.errors.append(f"{msg[1]}: {msg[2]}")

    def kill_one(self) -> None:
        """SIGKILL a replica mid-whatever and start a cold one under the same name."""
        name = self.rng.choice(sorted(self.replicas))
        victim = self.replicas[name]
        victim.process.kill()
        victim.process.join(30)
        self.drain()
        victim.conn.close()
        self.retired_rss.append(victim.rss)
        self.kills += 1
        self.spawn(name)

    def sample_store(self, store: Any, version: int | None) -> None:
        listing = list(store.list(""))
        try:
            manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
            retired = {k for k, _ in manifest.retired}
        except Exception:
            retired = set()
        pending = sum(i.size for i in listing if i.key in retired)
        self.samples.append({"version": version, "objects": len(listing), "bytes": sum(i.size for i in listing),
                             "retired_bytes": pending})

    def sample_memory(self, version: int) -> None:
        current, _ = tracemalloc.get_traced_memory() if tracemalloc.is_tracing() else (0, 0)
        self.memory.append({"version": version, "rss": rss_bytes(), "python_heap": current})

    def on_publish(self, info: PublishInfo) -> None:
        self.infos.append(info)
        self.snapshot_digests[info.version] = digest(self.publisher.snapshot.items())  # type: ignore[union-attr]

    def run(self) -> dict[str, Any]:
        args = self.args
        if args.tracemalloc:
            tracemalloc.start()
        weights = make_weights(args.scale)
        store = open_store(self.url, **self.options)
        self.publisher = Publisher(
            weights, self.url, anchor_every=args.anchor_every, keep_anchors=args.keep_anchors,
            retire_grace_s=args.grace, on_publish=self.on_publish, **self.options,
        )
        for i in range(args.replicas - 1):
            self.spawn(f"replica-{i}")
        g = torch.Generator().manual_seed(args.seed)
        started, last_kill, step = time.monotonic(), time.monotonic(), 0
        memory_every = max(1, args.versions // 40)
        next_memory = 0
        while self.publisher.version is None or self.publisher.version < args.versions:
            train_step(weights, step, g)
            self.publisher.publish(step, block=step % 4 != 0)
            step += 1
            version = self.publisher.version or 0
            if f"replica-{args.replicas - 1}" not in self.replicas and version >= args.versions // 2:
                self.spawn(f"replica-{args.replicas - 1}")  # the late joiner
            if args.kill_every and time.monotonic() - last_kill > args.kill_every:
                self.kill_one()
                last_kill = time.monotonic()
            if step % 5 == 0:
                self.sample_store(store, version)
            if version >= next_memory:
                self.sample_memory(version)
                next_memory += memory_every
            self.drain()
        self.publisher.close()
        self.sample_memory(self.publisher.version or 0)
        elapsed = time.monotonic() - started
        target = self.publisher.version
        for r in self.replicas.values():
            r.control.put(target)
        deadline = time.monotonic() + FINISH_S + 30
        while any(r.alive and r.final is None for r in self.replicas.values()) and time.monotonic() < deadline:
            self.drain(timeout=1.0)
        for r in self.replicas.values():
            r.process.join(30)
        final_digest = digest(weights.items())
        return self.report(store, weights, target, final_digest, step, elapsed)

    def report(
        self, store: Any, weights: dict[str, torch.Tensor], target: int | None, final_digest: str, steps: int,
        elapsed: float,
    ) -> dict[str, Any]:
        args = self.args
        checks: dict[str, bool] = {}
        wrong = [(n, v) for n, v, d, _ in self.applied if self.snapshot_digests.get(v) != d]
        checks["every_update_exact"] = not wrong and bool(self.applied)
        finals = {n: r.final for n, r in self.replicas.items()}
        checks["replicas_end_exact"] = all(
            f is not None and f[0] == target and f[1] == final_digest for f in finals.values()
        )
        rejected = sum((Counter(f[2]) for f in finals.values() if f), Counter())
        restarts = sum((Counter(f[3]) for f in finals.values() if f), Counter())
        checks["only_retention_races_refused"] = set(rejected) <= {"ObjectNotFound"}
        checks["no_replica_errors"] = not self.errors

        anchor = max(i.bytes for i in self.infos if i.kind == "anchor")
        delta = max((i.bytes for i in self.infos if i.kind == "delta"), default=0)
        slots = (args.keep_anchors + 1) * args.anchor_every + 2
        static_bound = (args.keep_anchors + 1) * anchor + slots * delta + 64 * 1024 * (1 + args.replicas)
        over = [s for s in self.samples if s["bytes"] > static_bound + s["retired_bytes"]]
        checks["store_bounded"] = not over
        manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
        acks = {f"acks/{n}.json" for n in self.replicas}
        leftover = {i.key for i in store.list("")} - named_keys(store, manifest) - acks
        checks["nothing_unnamed_left"] = not leftover

        slack = args.rss_slack_mb << 20
        quarter = [m for m in self.memory if m["version"] >= args.versions // 4]
        rss_growth = self.memory[-1]["rss"] - quarter[0]["rss"] if quarter else 0
        heap_growth = self.memory[-1]["python_heap"] - quarter[0]["python_heap"] if quarter else 0
        replica_growth = {}
        for name, r in self.replicas.items():
            if len(r.rss) >= 4:
                replica_growth[name] = r.rss[-1][1] - r.rss[len(r.rss) // 4][1]
        checks["trainer_memory_flat"] = rss_growth < slack and heap_growth < slack
        checks["replica_memory_flat"] = all(g < slack for g in replica_growth.values())

        routes = Counter(hop for _, _, _, route in self.applied for hop in route)
        return {
            "params": vars(args),
            "machine": machine(),
            "elements": sum(t.numel() for t in weights.values()),
            "steps": steps,
            "versions": target,
            "seconds": round(elapsed, 1),
            "versions_per_s": round((target or 0) / elapsed, 1),
            "updates_applied": len(self.applied),
            "hops": dict(routes),
            "restarts": dict(restarts),
            "kills": self.kills,
            "refused": dict(rejected),
            "anchor_bytes": anchor,
            "max_delta_bytes": delta,
            "store": {
                "max_bytes": max(s["bytes"] for s in self.samples),
                "max_objects": max(s["objects"] for s in self.samples),
                "bound_bytes_without_retired": static_bound,
                "samples": len(self.samples),
                "over_bound": over[:5],
                "leftover": sorted(leftover)[:5],
            },
            "memory": {
                "trainer_rss_growth_bytes": rss_growth,
                "trainer_python_heap_growth_bytes": heap_growth,
                "replica_rss_growth_bytes": replica_growth,
                "trainer_samples": self.memory,
            },
            "errors": self.errors[:3],
            "wrong_updates": wrong[:5],
            "checks": checks,
            "passed": all(checks.values()),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=2000)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1, help="model size in millions of elements (about)")
    parser.add_argument("--anchor-every", type=int, default=20)
    parser.add_argument("--keep-anchors", type=int, default=2)
    parser.add_argument(
        "--grace", type=float, default=1.0, help="seconds retired objects stay (default 1; 300 in production)"
    )
    parser.add_argument("--kill-every", type=float, default=15.0, help="SIGKILL a replica this often (0: never)")
    parser.add_argument("--rss-slack-mb", type=int, default=64)
    parser.add_argument("--store", help="store URL (default: a temporary directory)")
    parser.add_argument("--moto", action="store_true", help="run against a loopback S3 server (moto)")
    parser.add_argument("--no-tracemalloc", dest="tracemalloc", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="soak", help="results/<name>.json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        options: dict[str, Any] = {}
        if args.moto:  # in its own process: moto keeps objects in memory, which is not the trainer's
            url, options = stack.enter_context(loopback_store("s3", f"soak-{os.getpid()}"))
        else:
            url = args.store or str(Path(tmp) / "run")
        result = Soak(args, url, options).run()
    path = write_json(args.output, result)
    store = result["store"]
    print(
        f"{result['versions']} versions in {result['seconds']} s ({result['versions_per_s']}/s), "
        f"{result['updates_applied']} updates applied by replicas (hops {result['hops']}), "
        f"restarts {result['restarts']}, {result['kills']} kills, refused {result['refused']}"
    )
    print(
        f"store at most {human_bytes(store['max_bytes'])} in {store['max_objects']} objects "
        f"(bound {human_bytes(store['bound_bytes_without_retired'])} + retired in grace); "
        f"trainer RSS growth {human_bytes(result['memory']['trainer_rss_growth_bytes'])}, "
        f"python heap growth {human_bytes(result['memory']['trainer_python_heap_growth_bytes'])}, "
        f"replicas {({k: human_bytes(v) for k, v in result['memory']['replica_rss_growth_bytes'].items()})}"
    )
    for name, ok in result["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print(f"wrote {path}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
