"""Quick soak: many versions, retention, three restarting replicas, all bit-exact at every version.

A trainer applies random sparse updates (with an occasional dense tensor and
special values: +-0, NaN, +-inf) to a dict of about 1M fp32 and bf16 elements and
publishes; every fourth publish does not wait for the upload before it, so some coalesce. Three follower
threads run replicas that restart at random: resuming from their version
(``start_version``/``run_id``), restarting without a version (an anchor route),
or cold (weights wiped); one joins late. Every update's weights are hashed and
checked against the publisher's snapshot hash of that version, the final
weights against the trainer's bf16 cast, and the store's size against what
retention promises. ``benchmarks/soak.py`` is the long variant, with processes.
"""

from __future__ import annotations

import random
import threading
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

from deltasync.appliers import TorchModuleApplier
from deltasync.demo.workload import make_weights, train_step
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest
from deltasync.protocol.retired import named_keys
from deltasync.publish.publisher import Publisher, PublishInfo
from deltasync.publish.spans import MAX_SPAN
from deltasync.replica.subscriber import Subscriber, UpdateInfo
from deltasync.stores import open_store
from deltasync.tensors import weights_digest as digest

pytestmark = pytest.mark.slow

VERSIONS = 400
ANCHOR_EVERY = 10
KEEP_ANCHORS = 2
REPLICAS = 3
WAIT_S = 60.0  # liveness bound for the final catch-up; not a timing threshold


class Follower(threading.Thread):
    """One replica that restarts its Subscriber at random until told to finish."""

    def __init__(self, name: str, url: str, seed: int, begin: threading.Event, stop: threading.Event) -> None:
        super().__init__(name=f"soak-{name}", daemon=True)
        self.replica_name, self.url, self.begin, self.stop = name, url, begin, stop
        self.rng = random.Random(seed)
        self.weights = {k: torch.zeros_like(v, dtype=torch.bfloat16) for k, v in make_weights().items()}
        self.applier = TorchModuleApplier(self.weights)
        self.applied: list[tuple[int, str, tuple[str, ...]]] = []
        self.restarts: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.final_version: int | None = None
        self.target: int | None = None
        self.error: str | None = None

    def _on_update(self, info: UpdateInfo) -> None:
        self.applied.append((info.version, digest(self.applier.state().items()), info.route))

    def _subscriber(self, version: int | None, run_id: str | None) -> Subscriber:
        return Subscriber(
            self.url, self.applier, replica_id=self.replica_name, poll_interval=0.005, max_poll_interval=0.02,
            on_update=self._on_update, start_version=version, run_id=run_id,
        )

    def run(self) -> None:
        try:
            self.begin.wait()
            version = run_id = None
            while not self.stop.is_set():
                sub = self._subscriber(version, run_id).start()
                self.stop.wait(self.rng.uniform(0.05, 0.6))  # a random lifetime
                sub.close()
                self.rejected.update(sub.stats.rejected)
                version, run_id = sub.version, sub.run_id
                roll = self.rng.random()
                if roll < 0.6 and version is not None:
                    self.restarts["resume"] += 1  # weights kept, routes start at the version held
                elif roll < 0.85:
                    self.restarts["no-version"] += 1  # weights kept, but an anchor route
                    version = run_id = None
                else:
                    self.restarts["cold"] += 1  # a new process: nothing of the old weights
                    for t in self.weights.values():
                        t.zero_()
                    version = run_id = None
            with self._subscriber(version, run_id) as sub:
                sub.start()
                assert self.target is not None
                sub.wait_for(self.target, timeout=WAIT_S)
                self.final_version = sub.version
                self.rejected.update(sub.stats.rejected)
        except BaseException:
            self.error = traceback.format_exc()


def test_soak_quick(tmp_path: Path) -> None:
    # Retired objects are deleted at the first manifest write after their grace; 0 s instead of
    # 300 s makes the store's size a function of versions alone (replicas may then lose an object
    # mid-download and must recover: part of what this soaks).
    url = str(tmp_path / "run")
    weights = make_weights()
    snapshot_digests: dict[int, str] = {}
    infos: list[PublishInfo] = []
    holder: dict[str, Publisher] = {}

    def on_publish(info: PublishInfo) -> None:  # worker thread, right after the commit of info.version
        infos.append(info)
        snapshot_digests[info.version] = digest(holder["pub"].snapshot.items())  # type: ignore[union-attr]

    begin, late, stop = threading.Event(), threading.Event(), threading.Event()
    followers = [
        Follower(f"replica-{i}", url, seed=i, begin=late if i == REPLICAS - 1 else begin, stop=stop)
        for i in range(REPLICAS)
    ]
    for f in followers:
        f.start()
    store = open_store(url)
    samples: list[tuple[int, int]] = []
    g = torch.Generator().manual_seed(0)
    pub = holder["pub"] = Publisher(
        weights, url, anchor_every=ANCHOR_EVERY, keep_anchors=KEEP_ANCHORS, retire_grace_s=0.0, on_publish=on_publish
    )
    step = 0
    while pub.version is None or pub.version < VERSIONS:
        train_step(weights, step, g)
        # Mostly one version per step; every fourth publish does not wait and may coalesce.
        pub.publish(step, block=step % 4 != 0)
        step += 1
        if step == 1:
            begin.set()
        if pub.version is not None and pub.version >= VERSIONS // 2:
            late.set()  # the third replica joins half way
        if step % 5 == 0:
            listing = list(store.list(""))
            samples.append((len(listing), sum(i.size for i in listing)))
    pub.close()
    assert pub.stats.failed == 0
    for f in followers:
        f.target = pub.version
    stop.set()
    for f in followers:
        f.join(WAIT_S + 30)
        assert not f.is_alive() and f.error is None, f.error

    final = {k: v.to(torch.bfloat16).view(torch.int16) for k, v in weights.items()}
    for f in followers:
        assert f.final_version == pub.version, f.replica_name
        for name, bits in final.items():
            assert torch.equal(f.weights[name].view(torch.int16), bits), (f.replica_name, name)
        # Invariant 1 at every version any replica ever held, not just the last.
        wrong = [(v, d) for v, d, _ in f.applied if snapshot_digests.get(v) != d]
        assert not wrong, f"{f.replica_name} held other weights than the trainer at {[v for v, _ in wrong]}"
        # Only lost races with retention (an object deleted mid-download) may have been refused.
        assert set(f.rejected) <= {"ObjectNotFound"}, f.rejected
    restarts = sum((f.restarts for f in followers), Counter())
    routes = Counter(hop for f in followers for _, _, route in f.applied for hop in route)
    assert restarts["resume"] and restarts["no-version"] + restarts["cold"] and routes["anchor"] and routes["delta"]
    assert followers[-1].applied[0][2][0] == "anchor"  # the late joiner started from an anchor
    assert step > pub.version  # publishes did coalesce

    # Retention bounds the store: keep_anchors anchors and the deltas after the oldest of them, plus
    # one anchor and one delta in flight, plus the manifest and one ack per replica.
    anchor = max(i.bytes for i in infos if i.kind == "anchor")
    delta = max(i.bytes for i in infos if i.kind == "delta")
    slots = (KEEP_ANCHORS + 1) * ANCHOR_EVERY + 2
    # Catch-up spans: one a version on average over any window, plus the longest ones of its last version;
    # each is smaller than the chain it replaces, so each length adds at most a delta a version.
    levels = MAX_SPAN.bit_length() - 1
    bound_bytes = (KEEP_ANCHORS + 1) * anchor + (1 + levels) * slots * delta + 64 * 1024 * (1 + REPLICAS)
    bound_objects = (KEEP_ANCHORS + 1) + 2 * slots + levels + 1 + REPLICAS
    assert max(n for n, _ in samples) <= bound_objects, (max(samples), bound_objects)
    assert max(b for _, b in samples) <= bound_bytes, (max(samples), bound_bytes)
    manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
    acks = {f"acks/{f.replica_name}.json" for f in followers}
    leftover = {i.key for i in store.list("")} - named_keys(store, manifest) - acks
    assert not leftover, sorted(leftover)[:5]
    assert len(manifest.anchors()) == KEEP_ANCHORS
    print(
        f"soak: {step} steps -> {pub.version} versions; restarts {dict(restarts)}; hops {dict(routes)}; "
        f"refused {dict(sum((f.rejected for f in followers), Counter()))}; store at most {max(samples)} "
        f"(objects, bytes), bound ({bound_objects}, {bound_bytes})"
    )
