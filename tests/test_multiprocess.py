"""A trainer in this process, replicas in other processes, one store between them.

Replicas are spawned (``tests/mp_helpers.py``), follow the store with a real
:class:`~deltasync.replica.subscriber.Subscriber` and report a hash of their weights
after every update; the tests wait on those reports (never on sleeps) and end
by comparing every replica's int16 bit patterns with the trainer's bf16 cast.
Runs on the local store and on the loopback S3 server.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from deltasync.protocol.manifest import MANIFEST_KEY, Manifest
from deltasync.publish.publisher import Publisher, PublishInfo
from deltasync.stores import open_store
from deltasync.tensors import published_tensors

from .mp_helpers import bf16_bits, digest, make_model, model_digest, replica_main

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0  # generous: spawning a replica imports torch, on a loaded 2-core machine
LR = 1e-3  # moves a good share of this small model's bf16 elements each step
STEPS = 60  # fast steps for the coalescing test: long enough for replicas to see versions go by


@pytest.fixture(params=["local", "s3"])
def run_store(request: pytest.FixtureRequest, servers: dict[str, Any], tmp_path: Any) -> tuple[str, dict[str, Any]]:
    """A fresh run prefix: (URL, store options) that another process can open too."""
    if request.param == "local":
        return str(tmp_path / "run"), {}
    server = servers["get"]("s3")
    return server.store_url(f"mp-{time.time_ns()}"), server.store_options()


class Replica:
    """A replica process and what it reported."""

    def __init__(self, ctx: Any, name: str, url: str, options: dict[str, Any]) -> None:
        self.name = name
        self.conn, child_end = ctx.Pipe(duplex=False)
        self.stop = ctx.Event()
        self.process = ctx.Process(target=replica_main, args=(name, url, options, child_end, self.stop), daemon=True)
        self.process.start()
        child_end.close()  # the child holds the only writing end: its death reads as EOF here
        self.updates: list[tuple[int, int | None, tuple[str, ...], str]] = []
        """(version, previous, route, weight hash) per update."""
        self.final: tuple[int | None, dict[str, bytes], dict[str, int]] | None = None
        self.ready = False

    @property
    def version(self) -> int | None:
        return self.updates[-1][0] if self.updates else None

    def _receive(self, deadline: float) -> None:
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise AssertionError(f"replica {self.name} is silent (at v{self.version})")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise AssertionError(f"replica {self.name} died (exit code {self.process.exitcode})") from None
        if msg[0] == "ready":
            self.ready = True
        elif msg[0] == "applied":
            self.updates.append(tuple(msg[2:]))  # type: ignore[arg-type]
        elif msg[0] == "final":
            self.final = tuple(msg[2:])  # type: ignore[assignment]
        elif msg[0] == "error":
            raise AssertionError(f"replica {self.name} failed:\n{msg[2]}")

    def wait_ready(self, timeout: float = TIMEOUT_S) -> None:
        """Until the replica follows the store (its process is up and its subscriber started)."""
        deadline = time.monotonic() + timeout
        while not self.ready:
            self._receive(deadline)

    def wait_for(self, version: int, timeout: float = TIMEOUT_S) -> None:
        """Until the replica reports ``version`` or newer."""
        deadline = time.monotonic() + timeout
        while self.version is None or self.version < version:
            self._receive(deadline)

    def finish(self, timeout: float = TIMEOUT_S) -> tuple[int | None, dict[str, bytes], dict[str, int]]:
        """Stop following; returns (version, bf16 bits by name, refused objects)."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        while self.final is None:
            self._receive(deadline)
        self.process.join(timeout)
        return self.final

    def kill(self) -> None:
        """SIGKILL: no chance to finish an update or say goodbye."""
        self.process.kill()
        self.process.join(TIMEOUT_S)
        self.conn.close()


class Trainer:
    """fp32 masters, AdamW, a Publisher; remembers the hash of its bf16 cast at every committed version."""

    def __init__(self, url: str, options: dict[str, Any], **publisher_options: Any) -> None:
        self.model = make_model(seed=0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.publisher = Publisher(self.model, url, **publisher_options, **options)
        self.digests: dict[int, str] = {}
        self.step = 0
        self._data = torch.Generator().manual_seed(0)

    def train(self) -> None:
        self.step += 1
        x = torch.randn(16, 48, generator=self._data)
        (self.model(x) - x.flip(1)).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def publish_and_commit(self) -> int:
        """Publish the current weights and wait for the commit; returns the version."""
        assert self.publisher.publish(self.step, block=True)
        self.publisher.flush()
        version = self.publisher.version
        assert version is not None
        self.digests[version] = model_digest(self.model)
        return version

    def bits(self) -> dict[str, bytes]:
        return bf16_bits(published_tensors(self.model))


@pytest.fixture
def spawn() -> Iterator[Any]:
    """Start replicas with ``spawn(name, url, options)``; all still running at the end are killed."""
    ctx = mp.get_context("spawn")
    started: list[Replica] = []

    def start(name: str, url: str, options: dict[str, Any]) -> Replica:
        started.append(Replica(ctx, name, url, options))
        return started[-1]

    yield start
    for replica in started:
        if replica.process.is_alive():
            replica.kill()


def assert_exact(replica: Replica, trainer: Trainer, digests: dict[int, str], version: int) -> None:
    """Every update matched the trainer's weights at that version; the final weights match bit for bit."""
    final_version, bits, rejected = replica.finish()
    assert final_version == version
    assert rejected == {}
    assert bits.keys() == trainer.bits().keys()
    mismatched = [name for name, data in trainer.bits().items() if bits[name] != data]
    assert mismatched == [], f"replica {replica.name} differs from the trainer in {mismatched}"
    wrong = [v for v, _, _, d in replica.updates if d != digests[v]]
    assert wrong == [], f"replica {replica.name} held other weights than the trainer at versions {wrong}"


class TestReplicaProcesses:
    def test_follow_late_join_and_restart_after_kill(self, run_store: tuple[str, dict[str, Any]], spawn: Any) -> None:
        url, options = run_store
        trainer = Trainer(url, options, anchor_every=3, anchor_ratio=1e9)  # anchors at v0, v3, v6, v9 only
        try:
            a, b = spawn("a", url, options), spawn("b", url, options)
            assert trainer.publish_and_commit() == 0
            for _ in range(3):
                trainer.train()
                trainer.publish_and_commit()
            a.wait_for(3)
            b.wait_for(3)

            trainer.train()
            trainer.publish_and_commit()  # v4; b may be fetching or applying it right now
            b.kill()
            for _ in range(3):
                trainer.train()
                trainer.publish_and_commit()  # v5..v7
            a.wait_for(7)

            # Retention dropped v0..v2 after the anchor at v6: newcomers can only start from an anchor.
            with open_store(url, **options) as store:
                manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
            assert [e.version for e in manifest.anchors()] == [3, 6] and manifest.versions[0].version == 3
            late, restarted = spawn("c", url, options), spawn("b", url, options)
            late.wait_for(7)
            restarted.wait_for(7)
            for newcomer in (late, restarted):
                assert newcomer.updates[0][:3] == (7, None, ("anchor", "delta")), "newest anchor + one delta"

            for _ in range(3):
                trainer.train()
                trainer.publish_and_commit()  # v8..v10 with three replicas following
            for replica in (a, late, restarted):
                replica.wait_for(10)
            for replica in (a, late, restarted):
                assert_exact(replica, trainer, trainer.digests, 10)
        finally:
            trainer.publisher.close()

    def test_coalescing_publisher_replicas_end_exact(self, run_store: tuple[str, dict[str, Any]], spawn: Any) -> None:
        """Publishes as fast as training goes: some are coalesced, replicas skip versions, all stay exact."""
        url, options = run_store
        committed: dict[int, str] = {}
        infos: list[PublishInfo] = []

        def on_publish(info: PublishInfo) -> None:
            # Runs on the worker thread after the snapshot advanced: it is exactly the committed version.
            committed.setdefault(info.version, digest(trainer.publisher.snapshot.items()))
            infos.append(info)

        trainer = Trainer(url, options, anchor_every=10, on_publish=on_publish)
        a, b = spawn("a", url, options), spawn("b", url, options)
        a.wait_ready()
        b.wait_ready()
        try:
            started = [trainer.publisher.publish(0)]
            for _ in range(STEPS):
                trainer.train()
                started.append(trainer.publisher.publish(trainer.step))
        finally:
            trainer.publisher.close()  # publishes the newest weights if the last call was coalesced
        final = trainer.publisher.version
        assert final is not None and committed[final] == model_digest(trainer.model)
        assert sum(i.coalesced for i in infos) == started.count(False)
        for replica in (a, b):
            replica.wait_for(final)
        for replica in (a, b):
            assert_exact(replica, trainer, committed, final)
