"""The shared read-through cache: the store conformance suite through it, then what only a cache does.

Runs on real components: a real publisher writes versions into a local
directory (or the loopback S3 server), readers are :class:`CachedStore`
instances sharing one cache directory (as replica processes on a node do) or
real spawned processes, and the store is tapped with ``tests.faults.FaultyStore``
to count what reaches it.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync.appliers import TorchModuleApplier
from deltasync.errors import IntegrityError
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest, ObjectRef
from deltasync.publish.publisher import Publisher
from deltasync.replica.cache import CachedStore, open_cached
from deltasync.replica.subscriber import Subscriber
from deltasync.stores import Store, open_store
from deltasync.stores.wrap import DelegatingStore

from .conftest import make_store
from .faults import FaultyStore
from .mp_helpers import make_model, model_digest
from .test_stores import TestConditionalWrites, TestReadWrite  # noqa: F401 - rerun through the cache

WAIT_S = 30.0  # liveness bound for waits on other threads and processes


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(params=["memory", "local", "s3"])
def store(request: pytest.FixtureRequest, servers: dict[str, Any], tmp_path: Path) -> Iterator[Store]:
    """The conformance suite's backends, each read through a cache (overrides conftest's ``store``)."""
    s = CachedStore(make_store(request.param, servers, tmp_path), tmp_path / "cache")
    yield s
    s.close()


def publish(url: str, versions: int, **options: Any) -> torch.nn.Module:
    """Publish ``versions`` versions of the small test model (a few elements change each time)."""
    model = make_model(seed=0)
    with Publisher(model, url, **options) as publisher:
        for step in range(versions):
            with torch.no_grad():
                for p in model.parameters():
                    p.view(-1)[step % p.numel()] += 0.5
            publisher.publish(step)
            publisher.flush()
    return model


@pytest.fixture
def run(tmp_path: Path) -> str:
    """A local run prefix holding versions 0-3 (an anchor and three deltas)."""
    url = str(tmp_path / "run")
    publish(url, 4)
    return url


def objects(store: Store) -> list[ObjectRef]:
    """Every object the current manifest names."""
    manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
    return [ref for entry in manifest.versions for ref in entry.objects()]


def reader(url: str, cache: Path, **options: Any) -> tuple[CachedStore, FaultyStore]:
    """A cached reader of ``url`` that has read the manifest, and the tap on its store."""
    tap = FaultyStore(open_store(url))
    cached = CachedStore(tap, cache, **options)
    assert cached.get_if_changed(MANIFEST_KEY, None) is not None
    return cached, tap


def store_gets(tap: FaultyStore, key: str) -> int:
    return sum(1 for op, k, _ in tap.calls if op == "get" and k == key)


def cache_files(cache: Path) -> set[str]:
    return {p.name for p in cache.rglob("objects/**/*") if p.is_file()}


# ---------------------------------------------------------------------- read-through


class TestReadThrough:
    def test_second_reader_is_served_by_the_cache(self, run: str, tmp_path: Path) -> None:
        first, tap1 = reader(run, tmp_path / "cache")
        second, tap2 = reader(run, tmp_path / "cache")
        refs = objects(first)
        for ref in refs:
            data = first.get(ref.key)
            assert ref.verify(data)
            assert second.get(ref.key) == data
        assert [store_gets(tap1, r.key) for r in refs] == [1] * len(refs)
        assert [store_gets(tap2, r.key) for r in refs] == [0] * len(refs)
        assert (first.stats.misses, first.stats.fills, second.stats.hits) == (len(refs), len(refs), len(refs))
        assert second.stats.store_bytes == 0

    def test_keys_no_manifest_named_pass_through(self, run: str, tmp_path: Path) -> None:
        tap = FaultyStore(open_store(run))
        cached = CachedStore(tap, tmp_path / "cache")
        ref = objects(open_store(run))[0]
        cached.get(ref.key)  # no manifest read through this store yet: size and hash unknown
        cached.get(ref.key)
        assert store_gets(tap, ref.key) == 2
        assert cache_files(tmp_path / "cache") == set()

    def test_mutable_keys_never_cached(self, run: str, tmp_path: Path) -> None:
        cached, tap = reader(run, tmp_path / "cache")
        cached.put("acks/r1.json", b'{"version": 1}')
        assert cached.get("acks/r1.json") == b'{"version": 1}'
        cached.put("acks/r1.json", b'{"version": 2}')
        assert cached.get("acks/r1.json") == b'{"version": 2}'
        cached.get(MANIFEST_KEY)
        cached.get(MANIFEST_KEY)
        assert store_gets(tap, MANIFEST_KEY) == 2 and store_gets(tap, "acks/r1.json") == 2
        for ref in objects(cached):
            cached.get(ref.key)
        assert cache_files(tmp_path / "cache") == {Path(r.key).name for r in objects(cached)}

    def test_a_manifest_naming_an_ack_does_not_make_it_cacheable(self, tmp_path: Path) -> None:
        url = str(tmp_path / "run")
        publish(url, 1)
        inner = open_store(url)
        ref = objects(inner)[0]
        ack = ref.key.replace("anchors/", "acks/")
        inner.put(ack, inner.get(ref.key))
        inner.put(MANIFEST_KEY, inner.get(MANIFEST_KEY).replace(ref.key.encode(), ack.encode()))
        cached, tap = reader(url, tmp_path / "cache")
        cached.get(ack)
        cached.get(ack)
        assert store_gets(tap, ack) == 2 and cache_files(tmp_path / "cache") == set()

    def test_range_reads_from_verified_files_only(self, run: str, tmp_path: Path) -> None:
        cached, tap = reader(run, tmp_path / "cache")
        other, other_tap = reader(run, tmp_path / "cache")
        ref = objects(cached)[0]
        data = cached.get(ref.key)
        assert cached.get_range(ref.key, 0, 8) == data[:8]
        assert cached.get_range(ref.key, ref.size - 3, ref.size + 10) == data[-3:]
        assert not [c for c in tap.calls if c[0] == "get_range"]
        assert other.get_range(ref.key, 0, 8) == data[:8]  # not hashed by this reader yet: from the store
        assert len([c for c in other_tap.calls if c[0] == "get_range"]) == 1


# ---------------------------------------------------------------------- integrity


def _flip(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


class TestIntegrity:
    @pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "extend"])
    def test_damaged_cache_file_is_refused_and_refetched(self, run: str, tmp_path: Path, damage: str) -> None:
        cached, tap = reader(run, tmp_path / "cache")
        ref = objects(cached)[-1]
        good = cached.get(ref.key)
        path = cached.root / "objects" / ref.key
        bad = {"flip": _flip(good), "truncate": good[: len(good) // 2], "empty": b"", "extend": good + b"\0"}[damage]
        path.write_bytes(bad)  # in place, as a torn write or a stray process would
        other, other_tap = reader(run, tmp_path / "cache")
        assert other.get(ref.key) == good
        assert other.stats.corrupt == 1 and other.stats.fills == 1
        assert store_gets(other_tap, ref.key) == 1
        assert path.read_bytes() == good  # repaired for everyone
        assert cached.get(ref.key) == good and store_gets(tap, ref.key) == 1

    def test_buffers_are_checked_copies_never_mappings(self, tmp_path: Path) -> None:
        """A replica downloads with ``get_buffer``: a hit is read into writable memory (viewed by the decoder)
        after its check, never mapped, so damage done in place later cannot reach it; damage before is refused."""
        import mmap

        url = str(tmp_path / "run")
        with Publisher({"w": torch.randn(1 << 20)}, url) as publisher:  # an anchor of 2 MiB: mapped if read
            publisher.publish(0, block=True)
        cached, tap = reader(url, tmp_path / "cache")
        ref = objects(cached)[0]
        good = bytes(cached.get_buffer(ref.key))  # a miss fills the cache
        other, other_tap = reader(url, tmp_path / "cache")
        hit = other.get_buffer(ref.key)
        assert other.stats.hits == 1 and store_gets(other_tap, ref.key) == 0
        assert bytes(hit) == good and not hit.readonly and not isinstance(hit.obj, mmap.mmap)
        path = cached.root / "objects" / ref.key
        path.write_bytes(_flip(good))  # in place, after the hit: the buffer handed out keeps the checked bytes
        assert bytes(hit) == good
        assert bytes(other.get_buffer(ref.key)) == good and other.stats.corrupt == 1  # refused, refetched
        assert path.read_bytes() == good and store_gets(other_tap, ref.key) == 1

    def test_damaged_range_source_is_not_trusted(self, run: str, tmp_path: Path) -> None:
        cached, tap = reader(run, tmp_path / "cache")
        ref = objects(cached)[0]
        good = cached.get(ref.key)
        path = cached.root / "objects" / ref.key
        path.unlink()
        path.write_bytes(_flip(good))  # a new file: this reader never hashed it
        assert cached.get_range(ref.key, 0, len(good)) == good
        assert len([c for c in tap.calls if c[0] == "get_range"]) == 1

    def test_store_bytes_with_wrong_hash_are_returned_not_cached(self, run: str, tmp_path: Path) -> None:
        cached, tap = reader(run, tmp_path / "cache")
        ref = objects(cached)[-1]
        tap.corrupt["deltas/"] = _flip
        assert not ref.verify(cached.get(ref.key))
        assert cached.stats.refused == 1 and cached.stats.fills == 0
        assert not (cached.root / "objects" / ref.key).exists()
        tap.corrupt.clear()
        assert ref.verify(cached.get(ref.key))

    def test_subscriber_refuses_bad_store_bytes_through_the_cache(self, run: str, tmp_path: Path) -> None:
        tap = FaultyStore(open_store(run))
        tap.corrupt["anchors/"] = _flip
        applier = TorchModuleApplier(make_model(seed=1234).to(torch.bfloat16))
        with Subscriber(CachedStore(tap, tmp_path / "cache"), applier, ack=False) as sub:
            with pytest.raises(IntegrityError, match="object refused"):
                sub.update()
            tap.corrupt.clear()
            assert sub.update() is not None and sub.version == 3

    def test_subscriber_follows_through_a_corrupted_cache(self, tmp_path: Path) -> None:
        url = str(tmp_path / "run")
        trainer = publish(url, 4)
        warm, _ = reader(url, tmp_path / "cache")
        for ref in objects(warm):
            warm.get(ref.key)
        for path in (tmp_path / "cache").rglob("objects/**/*.safetensors"):
            path.write_bytes(_flip(path.read_bytes()))
        tap = FaultyStore(open_store(url))
        model = make_model(seed=1234).to(torch.bfloat16)
        with Subscriber(tap, TorchModuleApplier(model), ack=False, cache_dir=tmp_path / "cache") as sub:
            assert isinstance(sub.store, CachedStore)
            info = sub.update()
            assert info is not None and info.version == 3 and not sub.stats.rejected
            assert sub.store.stats.corrupt == len(info.route)
        assert model_digest(model) == model_digest(trainer)


# ---------------------------------------------------------------------- concurrent fills


class _SlowStore(DelegatingStore):
    """Object reads take ``delay`` seconds: fills overlap."""

    def __init__(self, inner: Store, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if key != MANIFEST_KEY:
            time.sleep(self.delay)
        return self.inner.get(key, max_bytes=max_bytes)


def _fill_in_child(url: str, cache: str, key: str, barrier: Any, results: Any) -> None:
    """A reader process: read the manifest, meet the others, read ``key`` through the cache."""
    cached = CachedStore(_SlowStore(open_store(url), 0.5), cache)
    cached.get(MANIFEST_KEY)
    barrier.wait(WAIT_S)
    data = cached.get(key)
    results.put((hashlib.sha256(data).hexdigest(), cached.stats.as_dict()))


class TestConcurrentFill:
    @pytest.mark.slow  # four spawned processes, each importing torch
    def test_processes_read_the_store_once(self, run: str, tmp_path: Path) -> None:
        ref = objects(open_store(run))[0]
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [
            ctx.Process(target=_fill_in_child, args=(run, str(tmp_path / "cache"), ref.key, barrier, results))
            for _ in range(4)
        ]
        for p in procs:
            p.start()
        got = [results.get(timeout=WAIT_S * 2) for _ in procs]
        for p in procs:
            p.join(WAIT_S)
        whole = open_store(run).get(ref.key)
        assert ref.verify(whole) and {digest for digest, _ in got} == {hashlib.sha256(whole).hexdigest()}
        assert sum(stats["misses"] for _, stats in got) == 1
        assert sum(stats["hits"] for _, stats in got) == 3
        assert sum(stats["waits"] for _, stats in got) >= 1

    def test_threads_read_the_store_once(self, run: str, tmp_path: Path) -> None:
        tap = FaultyStore(open_store(run))
        readers = [CachedStore(tap, tmp_path / "cache") for _ in range(6)]
        for r in readers:
            r.get_if_changed(MANIFEST_KEY, None)
        ref = objects(readers[0])[0]
        stall = tap.inject("get", ref.key, kind="stall")
        out: list[bytes] = []
        threads = [threading.Thread(target=lambda r=r: out.append(r.get(ref.key))) for r in readers]
        for t in threads:
            t.start()
        assert stall.entered.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while sum(r.stats.waits for r in readers) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)  # the other five reach the lock and wait on it
        stall.release.set()
        for t in threads:
            t.join(WAIT_S)
        assert len(out) == 6 and all(ref.verify(d) for d in out)
        assert store_gets(tap, ref.key) == 1

    def test_stale_lock_is_broken(self, run: str, tmp_path: Path) -> None:
        cached, tap = reader(run, tmp_path / "cache")
        ref = objects(cached)[0]
        lock = cached.root / "locks" / ref.key
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.write_bytes(b"12345")  # a filler that died
        old = time.time() - cached._wait_budget(ref) - 60
        os.utime(lock, (old, old))
        assert ref.verify(cached.get(ref.key))
        assert cached.stats.fills == 1 and cached.stats.fallbacks == 0 and not lock.exists()

    def test_held_lock_times_out_to_the_store(self, run: str, tmp_path: Path) -> None:
        cached, tap = reader(run, tmp_path / "cache", fill_wait=0.05)
        ref = objects(cached)[0]
        lock = cached.root / "locks" / ref.key
        lock.parent.mkdir(parents=True, exist_ok=True)
        lock.write_bytes(b"12345")  # a live, slow filler elsewhere
        assert ref.verify(cached.get(ref.key))
        assert cached.stats.fallbacks == 1 and store_gets(tap, ref.key) == 1


# ---------------------------------------------------------------------- eviction and opening


class TestEviction:
    def test_size_cap_evicts_least_recently_used(self, run: str, tmp_path: Path) -> None:
        cached, _ = reader(run, tmp_path / "cache", max_bytes=1000)
        now = time.time()
        for i, name in enumerate(["d1", "d2", "d3", "anchor"]):  # oldest first
            path = cached.root / "objects" / "x" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * (600 if name == "anchor" else 200))
            os.utime(path, (now - 100 + i, now - 100 + i))
        os.utime(cached.root / "objects" / "x" / "d1", (now, now))  # just read: most recently used
        assert cached.evict(keep="x/d2") == 800  # 1400 bytes, down to 900 or less: d3 and the anchor go
        assert cache_files(tmp_path / "cache") == {"d1", "d2"}
        assert cached.evict() == 0  # under the cap

    def test_fills_respect_the_cap(self, run: str, tmp_path: Path) -> None:
        cached, tap = reader(run, tmp_path / "cache", max_bytes=1)
        refs = objects(cached)
        for ref in refs:
            cached.get(ref.key)
            assert cache_files(tmp_path / "cache") == {Path(ref.key).name}  # only the file just filled
        assert cached.stats.evicted == len(refs) - 1

    def test_retired_objects_are_dropped(self, tmp_path: Path) -> None:
        url = str(tmp_path / "run")
        model = make_model(seed=0)
        with Publisher(model, url, anchor_every=2, keep_anchors=1) as publisher:
            publisher.publish(0)
            publisher.flush()
            cached, _ = reader(url, tmp_path / "cache")
            first = objects(cached)
            for ref in first:
                cached.get(ref.key)
            for step in range(1, 5):
                with torch.no_grad():
                    next(model.parameters()).view(-1)[step] += 0.5
                publisher.publish(step)
                publisher.flush()
        assert cached.get_if_changed(MANIFEST_KEY, None) is not None
        assert all(not (cached.root / "objects" / r.key).exists() for r in first)
        assert cached.stats.evicted == len(first)

    def test_leftover_temporary_files_are_swept(self, run: str, tmp_path: Path) -> None:
        cached, _ = reader(run, tmp_path / "cache", max_bytes=1)
        tmp = cached.root / "objects" / "deltas" / ".tmp-dead"
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(b"x" * 100)
        os.utime(tmp, (0, 0))
        cached.evict()
        assert not tmp.exists()


class TestOpenCached:
    def test_cache_dir_option(self, run: str, tmp_path: Path) -> None:
        store = open_cached(run, str(tmp_path / "cache"), max_bytes=1 << 20)
        assert isinstance(store, CachedStore) and store.max_bytes == 1 << 20
        assert store.scheme == "file" and store.url == open_store(run).url
        assert open_cached(store, str(tmp_path / "cache")) is store
        wrapped = open_cached(FaultyStore(open_store(run)), str(tmp_path / "cache"))
        assert isinstance(wrapped, CachedStore) and isinstance(wrapped.inner, FaultyStore)
        assert not isinstance(open_cached(run, None), CachedStore)

    def test_cache_options_need_a_directory(self, run: str) -> None:
        with pytest.raises(ValueError, match="cache_dir"):
            open_cached(run, None, max_bytes=1 << 20)

    def test_open_store_points_to_the_replica_side(self, run: str, tmp_path: Path) -> None:
        for option in ("cache_dir", "cache_max_bytes"):
            with pytest.raises(ValueError, match=rf"open_store takes no {option}.*Subscriber"):
                open_store(run, **{option: str(tmp_path)})

    def test_stores_keep_apart_in_one_directory(self, tmp_path: Path) -> None:
        a = open_cached(str(tmp_path / "a"), str(tmp_path / "cache"))
        b = open_cached(str(tmp_path / "b"), str(tmp_path / "cache"))
        assert isinstance(a, CachedStore) and isinstance(b, CachedStore) and a.root != b.root
