"""End to end: from ``Publisher.publish()`` to every replica holding that version, against full checkpoints.

A trainer publishes real SmolLM2-135M-Instruct updates (fp32 masters, AdamW at
lr 3e-6, the chat batches of :mod:`deltasync.demo.models`) through a store to 1, 2
and 4 replicas, each holding bf16 weights loaded from the starting checkpoint.
Per version and per configuration it measures:

- **time to all replicas**: wall time from the call that publishes version v
  until the last replica holds v (replicas report ``time.time()`` when their
  weights are exactly v; one machine, one clock);
- **bytes moved**: object bytes the trainer wrote for v plus the bytes all
  replicas downloaded for it (manifests and pointers excluded, a few KB);
- **trainer stall**: time spent inside the publish call on the training thread
  (the diff; encoding and upload run in the background);
- **replica pause**: time a replica's apply holds its weights (``UpdateInfo.t_apply``).

Baseline, through the same store: each version the trainer casts its weights
to bf16 on the training thread, then a background thread serializes them as one
safetensors checkpoint, uploads it and rewrites a small pointer object; each
replica follows the pointer the way a subscriber follows the manifest (change
feed where the store has one, else the same polling), downloads the checkpoint,
parses it and copies every tensor into its weights (what ``load_state_dict``
does). The baseline checks no hashes, which only favours it.

Workload: training on CPU takes seconds per step, so a few real steps are
trained once, recorded as the exact bf16 changes of each step and cached (in
``$DELTASYNC_CACHE``, default ``~/.cache/deltasync``); every configuration then
replays them. Replaying writes the recorded bf16 values into fp32 masters that
start from the bf16 checkpoint, so the publisher does the same work as after a
real optimizer step (cast and compare every element) and sees the same changes.
Between versions the trainer waits until every replica holds the last one, so
each version is timed alone. Stores: a local directory, a loopback S3 server
(moto, in its own process) and the fake Hub's bucket API with the real
huggingface_hub client (``tests/servers``). Replicas are spawned processes (one
torch thread each, as the demo's); on the fake Hub they are threads of the
trainer process, because its CAS is a local directory that hf_xet opens from
one process at a time. The trainer uses one torch thread too: on a shared,
oversubscribed machine two-thread regions measure the scheduler. Medians over versions;
ratios are taken between delta and full runs of the same configuration in the
same run (the machine is shared: compare ratios, not absolute times).

    python benchmarks/end_to_end.py            # local, s3, hf x 1, 2, 4 replicas x 4 versions
    python benchmarks/end_to_end.py --quick    # local store, 1 replica, 1 version; JSON to a temp dir
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import human_bytes, loopback_store, median, results_dir, shared_machine, table, write_json  # noqa: E402

from deltasync.appliers import TorchModuleApplier  # noqa: E402
from deltasync.errors import DeltaSyncError, ObjectNotFound  # noqa: E402
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest  # noqa: E402
from deltasync.publish.publisher import Publisher, PublishInfo  # noqa: E402
from deltasync.replica.subscriber import Subscriber, UpdateInfo  # noqa: E402
from deltasync.stores import Store, open_store  # noqa: E402
from deltasync.tensors import published_tensors, weights_digest  # noqa: E402

STORES = ("local", "s3", "hf")
REPLICAS = (1, 2, 4)
VERSIONS = 4
QUICK_STORES = ("local",)
QUICK_REPLICAS = (1,)
QUICK_VERSIONS = 1
LR = 3e-6
BATCH_SIZE = 4
POLL_S = 0.02  # replicas poll fast so the numbers show the sync, not a poll interval
MAX_POLL_S = 0.1  # idle backoff cap (both followers)
WAIT_S = 300.0  # liveness bound for one version to reach every replica
POINTER = "full/latest.json"  # the baseline's "manifest": which checkpoint is current


# ---------------------------------------------------------------------- workload: recorded real steps

Change = tuple[str, torch.Tensor | None, torch.Tensor]
"""One tensor's change in one step: name, flat indices (``None``: every element) and new bf16 bit patterns."""


@dataclass
class Recording:
    """Real training steps as exact bf16 changes, replayable onto the starting checkpoint."""

    names: list[str]
    """Published tensor names, in publishing order."""
    steps: list[list[Change]]
    losses: list[float]
    lr: float
    batch_size: int

    def sparsity(self, numel: int) -> list[float]:
        """Fraction of the model's ``numel`` bf16 elements each step left unchanged."""
        return [1 - sum(len(v) for _, _, v in step) / numel for step in self.steps]


def checkpoint_file() -> Path:
    """The bf16 safetensors file of SmolLM2-135M-Instruct (converted once, cached)."""
    from deltasync.demo.models import smollm2_checkpoint

    return smollm2_checkpoint() / "model.safetensors"


def base_weights(names: list[str]) -> dict[str, torch.Tensor]:
    """The starting bf16 weights, in publishing order (every replica loads these)."""
    from safetensors.torch import load_file

    loaded = load_file(str(checkpoint_file()))
    return {name: loaded[name] for name in names}


def record_steps(steps: int, lr: float = LR, batch_size: int = BATCH_SIZE) -> Recording:
    """Train ``steps`` real optimizer steps once and record each step's bf16 changes (cached on disk)."""
    from safetensors.torch import load_file, save_file

    from deltasync.demo.models import CACHE_DIR, chat_batches, load_smollm2, train_step
    from deltasync.publish.diff import Snapshot, diff

    stem = f"replay-smollm2-lr{lr:g}-bs{batch_size}"
    cached = sorted(CACHE_DIR.glob(f"{stem}-*.safetensors"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    usable = [p for p in cached if int(p.stem.rsplit("-", 1)[1]) >= steps]
    path = usable[0] if usable else CACHE_DIR / f"{stem}-{steps}.safetensors"
    if not path.exists():
        print(f"recording {steps} real training steps of SmolLM2-135M (cached in {path}) ...", flush=True)
        torch.manual_seed(0)
        model, tokenizer = load_smollm2(dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        batches = chat_batches(tokenizer, batch_size)
        snapshot = Snapshot.capture(model)
        tensors: dict[str, torch.Tensor] = {}
        losses = []
        for step in range(steps):
            losses.append(train_step(model, optimizer, batches[step % len(batches)]))
            changes = diff(snapshot, model)
            snapshot.advance(changes)
            for c in changes.changes:
                tensors[f"{step}:{c.spec.name}:v"] = c.values.contiguous()
                if c.indices is not None:
                    tensors[f"{step}:{c.spec.name}:i"] = c.indices.contiguous()
        names = [s.name for s in snapshot.specs]
        meta = {"names": json.dumps(names), "losses": json.dumps(losses), "steps": str(steps)}
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        tmp.replace(path)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    loaded = load_file(str(path))
    names, losses = json.loads(meta["names"]), json.loads(meta["losses"])
    recorded: list[list[Change]] = []
    for step in range(steps):
        recorded.append([
            (name, loaded.get(f"{step}:{name}:i"), loaded[f"{step}:{name}:v"])
            for name in names if f"{step}:{name}:v" in loaded
        ])
    return Recording(names, recorded, losses, lr, batch_size)


def replay(masters: dict[str, torch.Tensor], step: list[Change]) -> None:
    """Write one recorded step's new bf16 values into fp32 masters (exact: they cast back to the same bits)."""
    for name, indices, values in step:
        flat = masters[name].view(-1)
        new = values.view(torch.bfloat16).to(flat.dtype)
        if indices is None:
            flat.copy_(new)
        else:
            flat.index_copy_(0, indices, new)


# ---------------------------------------------------------------------- the baseline: full checkpoints


class FullCheckpointPublisher:
    """Trainer side of the baseline: a bf16 safetensors checkpoint per version, uploaded in the background.

    The bf16 cast runs on the caller's thread (training may change the weights
    right after); serializing, the upload, the pointer write and deleting the
    previous checkpoint run on one worker thread.
    """

    def __init__(self, weights: dict[str, torch.Tensor], store: Store) -> None:
        self.weights, self.store = weights, store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="full-checkpoint")
        self._previous: str | None = None

    def publish(self, version: int) -> Future[dict[str, float]]:
        snapshot = {name: t.detach().to(torch.bfloat16) for name, t in published_tensors(self.weights)}
        return self._pool.submit(self._upload, version, snapshot)

    def _upload(self, version: int, snapshot: dict[str, torch.Tensor]) -> dict[str, float]:
        from safetensors.torch import save

        t0 = time.perf_counter()
        data = save(snapshot)
        t1 = time.perf_counter()
        key = f"full/{version:010d}.safetensors"
        self.store.put(key, data)
        self.store.put(POINTER, json.dumps({"version": version, "key": key, "size": len(data)}).encode())
        committed = time.time()
        if self._previous is not None:  # every replica holds a newer version already (the benchmark waits)
            self.store.delete(self._previous)
        self._previous = key
        t_upload = time.perf_counter() - t1
        return {"bytes": len(data), "t_serialize": t1 - t0, "t_upload": t_upload, "committed": committed}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()


class FullCheckpointFollower:
    """Replica side of the baseline: follow the pointer, download the checkpoint, copy it into the weights."""

    def __init__(self, store: Store, weights: dict[str, torch.Tensor], report: Any) -> None:
        self.store, self.weights, self.report = store, weights, report
        self.version = 0  # every replica starts from the checkpoint the trainer started from
        self.polled = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="full-follower", daemon=True)

    def start(self) -> FullCheckpointFollower:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.store.close()

    def _run(self) -> None:
        from safetensors.torch import load

        feed, etag, interval = self.store.change_feed(), None, POLL_S
        try:
            while not self._stop.is_set():
                try:
                    got = self.store.get_if_changed(POINTER, etag)
                    pointer = json.loads(got[0]) if got else None
                    if pointer and pointer["version"] > self.version:
                        t0 = time.perf_counter()
                        blob = self.store.get(pointer["key"])
                        t1 = time.perf_counter()
                except ObjectNotFound:
                    got = pointer = None
                except DeltaSyncError as exc:  # a transient store failure: keep the weights, try again
                    logging.getLogger("end_to_end").warning("replica keeps v%d: %s", self.version, exc)
                    self._stop.wait(MAX_POLL_S)
                    continue
                self.polled.set()
                if got:
                    etag = got[1].etag
                if pointer and pointer["version"] > self.version:
                    state = load(blob)
                    t2 = time.perf_counter()
                    with torch.no_grad():
                        for name, tensor in self.weights.items():
                            tensor.copy_(state[name])
                    t3 = time.perf_counter()
                    self.version = pointer["version"]
                    self.report(self.version, len(blob), t1 - t0, t2 - t1, t3 - t2)
                    interval = POLL_S
                    continue
                interval = min(MAX_POLL_S, interval * 2)
                if feed is None or not feed.wait(POINTER, timeout=interval):
                    self._stop.wait(0 if feed is not None else interval)
        finally:
            if feed is not None:
                feed.close()


# ---------------------------------------------------------------------- replica process


def replica_main(index: int, names: list[str], commands: Any, events: Any) -> None:
    """One replica process: on each ``("follow", mode, url, options, run_id)`` start from the checkpoint
    and follow the store until ``("stop",)``; ``("quit",)`` ends the process.

    Sends ``("ready", i)``, ``("applied", i, version, wall time, bytes, t_fetch, t_decode, t_apply)``,
    ``("final", i, version, digest, rejected)`` and ``("error", i, traceback)``.
    """
    torch.set_num_threads(1)  # up to four replicas, the trainer and a server share two cores
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    try:
        while True:
            command = commands.get()
            if command[0] == "quit":
                return
            _, mode, url, options, run_id = command
            weights = base_weights(names)

            def report(version: int, nbytes: int, t_fetch: float, t_decode: float, t_apply: float) -> None:
                events.put(("applied", index, version, time.time(), nbytes, t_fetch, t_decode, t_apply))

            if mode == "delta":
                def on_update(info: UpdateInfo) -> None:
                    report(info.version, info.bytes, info.t_fetch, info.t_decode, info.t_apply)

                sub = Subscriber(
                    url, TorchModuleApplier(weights), replica_id=f"replica-{index}", ack=False,
                    poll_interval=POLL_S, max_poll_interval=MAX_POLL_S, on_update=on_update,
                    start_version=0, run_id=run_id, **options,
                ).start()
                _wait_first_poll(lambda: sub.stats.polls > 0)
                events.put(("ready", index))
                commands.get()  # ("stop",)
                sub.close()
                final = (sub.version, dict(sub.stats.rejected))
            else:
                follower = FullCheckpointFollower(open_store(url, **options), weights, report).start()
                follower.polled.wait(WAIT_S)
                events.put(("ready", index))
                commands.get()
                follower.close()
                final = (follower.version, {})
            events.put(("final", index, final[0], weights_digest(weights.items()), final[1]))
            del weights
    except BaseException:
        events.put(("error", index, traceback.format_exc()))
        raise


def _wait_first_poll(done: Any) -> None:
    """Until the follower has read the store once (its change feed, where there is one, is then live)."""
    deadline = time.monotonic() + WAIT_S
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


class Fleet:
    """The parent's handle on the replicas (started once, reused by every configuration).

    Replicas are spawned processes; with ``threads=True`` they are threads of
    this process instead (for the fake Hub, whose local CAS directory hf_xet
    opens for one process at a time).
    """

    def __init__(self, count: int, names: list[str], *, threads: bool = False) -> None:
        ctx: Any = mp.get_context("spawn")
        make_queue = queue.Queue if threads else ctx.Queue
        self.events = make_queue()
        self.commands = [make_queue() for _ in range(count)]
        worker = threading.Thread if threads else ctx.Process
        self.processes = [
            worker(target=replica_main, args=(i, names, self.commands[i], self.events), name=f"replica-{i}")
            for i in range(count)
        ]
        for p in self.processes:
            p.daemon = True
            p.start()

    def next_event(self, timeout: float = WAIT_S) -> tuple[Any, ...]:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"no word from the replicas for {timeout:.0f} s") from None
        if event[0] == "error":
            raise RuntimeError(f"replica {event[1]} failed:\n{event[2]}")
        return event

    def follow(self, n: int, mode: str, url: str, options: dict[str, Any], run_id: str | None) -> None:
        for i in range(n):
            self.commands[i].put(("follow", mode, url, options, run_id))
        ready = 0
        while ready < n:
            ready += self.next_event()[0] == "ready"

    def wait_applied(self, n: int, version: int) -> dict[int, tuple[Any, ...]]:
        applied: dict[int, tuple[Any, ...]] = {}
        while len(applied) < n:
            event = self.next_event()
            if event[0] == "applied" and event[2] == version:
                applied[event[1]] = event
        return applied

    def stop(self, n: int) -> dict[int, tuple[Any, ...]]:
        for i in range(n):
            self.commands[i].put(("stop",))
        finals: dict[int, tuple[Any, ...]] = {}
        while len(finals) < n:
            event = self.next_event()
            if event[0] == "final":
                finals[event[1]] = event
        return finals

    def close(self) -> None:
        for c in self.commands:
            c.put(("quit",))
        for p in self.processes:
            p.join(30)
            if p.is_alive() and isinstance(p, mp.process.BaseProcess):
                p.terminate()


# ---------------------------------------------------------------------- one configuration


def run_config(
    mode: str, store: str, url: str, options: dict[str, Any], n: int, fleet: Fleet,
    recording: Recording, masters: dict[str, torch.Tensor], base: dict[str, torch.Tensor], versions: int,
) -> dict[str, Any]:
    """Publish ``versions`` replayed steps in ``mode`` ("delta" or "full") to ``n`` replicas; one row per version."""
    with torch.no_grad():
        for name, tensor in masters.items():
            tensor.copy_(base[name])
    infos: dict[int, PublishInfo] = {}
    publisher: Any
    if mode == "delta":
        publisher = Publisher(masters, url, on_publish=lambda info: infos.setdefault(info.version, info), **options)
        publisher.publish(0, block=True)  # v0: the anchor of the checkpoint every replica already holds
        publisher.flush()
        run_id: str | None = Manifest.from_bytes(publisher.store.get(MANIFEST_KEY)).run_id
    else:
        publisher = FullCheckpointPublisher(masters, open_store(url, **options))
        run_id = None
    fleet.follow(n, mode, url, options, run_id)
    rows = []
    try:
        for version in range(1, versions + 1):
            replay(masters, recording.steps[(version - 1) % len(recording.steps)])
            started, t0 = time.time(), time.perf_counter()
            if mode == "delta":
                publisher.publish(version, block=True)
                stall = time.perf_counter() - t0
                pending = None
            else:
                pending = publisher.publish(version)
                stall = time.perf_counter() - t0
            applied = fleet.wait_applied(n, version)
            if mode == "delta":
                publisher.flush()
                info = infos[version]
                written, commit, t_upload = info.bytes, info.t_total, info.t_upload
            else:
                done = pending.result()
                written, commit, t_upload = done["bytes"], done["committed"] - started, done["t_upload"]
            reached = [event[3] - started for event in applied.values()]
            rows.append({
                "version": version,
                "stall_s": stall,
                "commit_s": commit,
                "upload_s": t_upload,
                "all_replicas_s": max(reached),
                "per_replica_s": sorted(reached),
                "bytes_written": written,
                "bytes_read": sum(event[4] for event in applied.values()),
                "pause_s": median([event[7] for event in applied.values()]),
                "max_pause_s": max(event[7] for event in applied.values()),
                "fetch_s": median([event[5] for event in applied.values()]),
                "decode_s": median([event[6] for event in applied.values()]),
            })
    finally:
        publisher.close()
        finals = fleet.stop(n)
        with open_store(url, **options) as done:  # the S3 server keeps objects in memory: free them
            for info in list(done.list("")):
                done.delete(info.key)
    trainer = weights_digest(published_tensors(masters))
    exact = all(f[2] == versions and f[3] == trainer for f in finals.values())
    rejected = {k: v for f in finals.values() for k, v in f[4].items()}
    return {"store": store, "replicas": n, "mode": mode, "rows": rows, "exact": exact, "rejected": rejected}


def summarize(config: dict[str, Any]) -> dict[str, Any]:
    """Medians over versions of one configuration."""
    rows = config["rows"]
    keys = ("all_replicas_s", "stall_s", "commit_s", "upload_s", "pause_s", "max_pause_s", "fetch_s", "decode_s",
            "bytes_written", "bytes_read")
    out = {k: median([r[k] for r in rows]) for k in keys}
    out["bytes_moved"] = median([r["bytes_written"] + r["bytes_read"] for r in rows])
    return out


def compare(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (store, replicas): delta and full medians side by side, and full / delta ratios."""
    by_key = {(c["store"], c["replicas"], c["mode"]): c for c in configs}
    out = []
    for (store, n, mode), config in by_key.items():
        if mode != "delta" or (store, n, "full") not in by_key:
            continue
        delta, full = config["summary"], by_key[(store, n, "full")]["summary"]
        out.append({
            "store": store,
            "replicas": n,
            "delta": delta,
            "full": full,
            "exact": config["exact"] and by_key[(store, n, "full")]["exact"],
            "full_over_delta": {
                k: full[k] / delta[k] if delta[k] else None
                for k in ("all_replicas_s", "bytes_moved", "stall_s", "pause_s")
            },
        })
    return out


def report(comparisons: list[dict[str, Any]]) -> str:
    ms = lambda s: f"{1e3 * s:.0f} ms" if s < 10 else f"{s:.1f} s"  # noqa: E731
    ratio = lambda r: f"{r:.0f}x" if r and r >= 10 else (f"{r:.1f}x" if r else "-")  # noqa: E731
    rows = [
        [c["store"], c["replicas"],
         ms(c["delta"]["all_replicas_s"]), ms(c["full"]["all_replicas_s"]),
         ratio(c["full_over_delta"]["all_replicas_s"]),
         human_bytes(c["delta"]["bytes_moved"]), human_bytes(c["full"]["bytes_moved"]),
         ratio(c["full_over_delta"]["bytes_moved"]),
         ms(c["delta"]["stall_s"]), ms(c["full"]["stall_s"]),
         ms(c["delta"]["pause_s"]), ms(c["full"]["pause_s"]),
         "yes" if c["exact"] else "NO"]
        for c in comparisons
    ]
    text = table(rows, ["store", "replicas", "to all (delta)", "to all (full)", "full/delta", "moved (delta)",
                        "moved (full)", "full/delta", "stall (delta)", "stall (full)", "pause (delta)",
                        "pause (full)", "bit-exact"])
    print(text)
    return text


@contextmanager
def store_root(kind: str, tmp: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A run root for ``kind``: a directory, or a prefix on a loopback server started for this run.

    The S3 server runs in its own process. The fake Hub runs in this one, with
    the replicas: its CAS is a local directory that hf_xet opens for one process
    at a time (the real Hub serves the CAS over HTTP and has no such limit).
    """
    prefix = f"e2e-{os.getpid()}"
    if kind == "local":
        yield str(Path(tmp) / "local"), {}
    elif kind == "hf":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.servers.hf import serve

        with serve() as hub:
            yield hub.store_url(prefix), hub.store_options()
    else:
        with loopback_store(kind, prefix) as root:
            yield root


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a local store, 1 replica, 1 version (a smoke run)")
    parser.add_argument("--stores", default=None, help=f"comma-separated, from {','.join(STORES)} (default all; "
                        f"{','.join(QUICK_STORES)} with --quick)")
    parser.add_argument("--replicas", default=None, help=f"comma-separated counts (default {REPLICAS})")
    parser.add_argument("--versions", type=int, default=None, help=f"versions per configuration (default {VERSIONS})")
    parser.add_argument("--results-dir", default=None, help="where end_to_end.json goes (default benchmarks/results; "
                        "a temporary directory with --quick)")
    args = parser.parse_args(argv)
    stores = [s for s in args.stores.split(",") if s] if args.stores else list(QUICK_STORES if args.quick else STORES)
    default = QUICK_REPLICAS if args.quick else REPLICAS
    counts = [int(n) for n in args.replicas.split(",")] if args.replicas else list(default)
    versions = args.versions or (QUICK_VERSIONS if args.quick else VERSIONS)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # One torch thread: with replicas and servers on the same two cores, two-thread regions wait on
    # descheduled threads and the trainer's numbers would measure the scheduler (5-10x slower here).
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # per-file bars from every upload otherwise
    started, load_before = time.perf_counter(), os.getloadavg()

    recording = record_steps(versions)
    base = base_weights(recording.names)
    masters = {name: t.float() for name, t in base.items()}
    numel = sum(t.numel() for t in base.values())
    print(f"SmolLM2-135M-Instruct, {numel / 1e6:.1f} M parameters; {len(recording.steps)} recorded steps, "
          f"sparsity {', '.join(f'{100 * s:.2f} %' for s in recording.sparsity(numel))}", flush=True)
    out_dir = results_dir(args.quick, args.results_dir)
    fleets: dict[bool, Fleet] = {}
    configs: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="deltasync-e2e-") as tmp:
            for store in stores:
                threads = store == "hf"
                if threads not in fleets:
                    fleets[threads] = Fleet(max(counts), recording.names, threads=threads)
                fleet = fleets[threads]
                with store_root(store, tmp) as (root, options):
                    for n in counts:
                        for mode in ("delta", "full"):  # in turns, so the ratio compares like with like
                            url = f"{root}/{mode}-{n}"
                            t0 = time.perf_counter()
                            try:
                                config = run_config(
                                    mode, store, url, options, n, fleet, recording, masters, base, versions
                                )
                            except Exception as exc:  # keep the other configurations' results
                                print(f"{store} {n} replica(s) {mode}: FAILED: {exc}", flush=True)
                                failures.append({"store": store, "replicas": n, "mode": mode, "error": str(exc)})
                                continue
                            config["seconds"] = round(time.perf_counter() - t0, 1)
                            config["summary"] = summarize(config)
                            configs.append(config)
                            # Kept if a later configuration takes the run down.
                            write_json("end_to_end", {"partial": True, "configs": configs}, out_dir)
                            s = config["summary"]
                            print(f"{store:5} {n} replica(s) {mode:5}: to all {1e3 * s['all_replicas_s']:.0f} ms, "
                                  f"moved {human_bytes(s['bytes_moved'])}, stall {1e3 * s['stall_s']:.0f} ms, "
                                  f"pause {1e3 * s['pause_s']:.0f} ms, exact={config['exact']} ({config['seconds']} s)",
                                  flush=True)
    finally:
        for fleet in fleets.values():
            fleet.close()
    comparisons = compare(configs)
    text = report(comparisons)
    elapsed = time.perf_counter() - started
    result = {
        "benchmark": "end_to_end",
        "quick": args.quick,
        "workload": {
            "model": "SmolLM2-135M-Instruct", "numel": numel, "dense_bf16_bytes": 2 * numel,
            "optimizer": "AdamW", "lr": recording.lr, "batch_size": recording.batch_size, "master_dtype": "float32",
            "recorded_steps": len(recording.steps), "losses": recording.losses, "sparsity": recording.sparsity(numel),
            "how": "real training steps recorded once as exact bf16 changes, replayed into fp32 masters",
        },
        "params": {"stores": stores, "replicas": counts, "versions": versions, "poll_s": POLL_S,
                   "replicas_as": {s: "threads of the trainer process" if s == "hf" else "processes" for s in stores},
                   "max_poll_s": MAX_POLL_S, "torch_threads": 1},
        "machine": shared_machine(load_before, "shared 2-core machine: absolute times are noisy, ratios are in-run"),
        "seconds": round(elapsed, 1),
        "comparisons": comparisons,
        "configs": configs,
        "failures": failures,
        "table": text,
    }
    path = write_json("end_to_end", result, out_dir)
    print(f"{elapsed:.0f} s; wrote {path}")
    return result


if __name__ == "__main__":
    main()
