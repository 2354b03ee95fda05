"""HF bucket store beyond the conformance suite: URLs, secrets, best-effort conditions, big objects.

Everything runs the real huggingface_hub + hf_xet clients against the loopback fake Hub in
``tests/servers/hf.py``.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from deltasync.errors import ObjectNotFound, PreconditionFailed, StoreError
from deltasync.stores import open_store
from deltasync.stores.base import ChangeFeed
from deltasync.stores.hf import HFBucketStore, parse_bucket_url
from tests.servers.hf import DEFAULT_BUCKET, FakeHub, serve

pytest.importorskip("huggingface_hub")
pytest.importorskip("hf_xet")

SECRET = "hf_THIS_token_must_never_leak_0123456789"
BIG = 8 * 1024 * 1024  # several xet chunks (~64 KiB each) and more than one xorb range


@pytest.fixture
def hub(servers: dict[str, Any]) -> FakeHub:
    return servers["get"]("hf")  # type: ignore[no-any-return]


@pytest.fixture
def store(hub: FakeHub) -> Iterator[HFBucketStore]:
    s = open_store(hub.store_url(f"run-{uuid.uuid4().hex[:8]}"), **hub.store_options())
    assert isinstance(s, HFBucketStore)
    yield s
    s.close()


def _payload(size: int, seed: int) -> bytes:
    # Not os.urandom: reproducible, and bf16-like (low bytes vary, high bytes repeat), as deltas are.
    import numpy as np

    return np.random.default_rng(seed).normal(0, 0.02, size // 4).astype(np.float32).tobytes()


class TestUrls:
    @pytest.mark.parametrize(
        ("url", "bucket", "prefix"),
        [
            ("hf://buckets/my-org/rl-weights", "my-org/rl-weights", ""),
            ("hf://buckets/my-org/rl-weights/", "my-org/rl-weights", ""),
            ("hf://buckets/u/b.v2/runs/1/", "u/b.v2", "runs/1"),
            ("hf://buckets/u/b/run=7@x", "u/b", "run=7@x"),
        ],
    )
    def test_good(self, url: str, bucket: str, prefix: str) -> None:
        assert parse_bucket_url(url) == (bucket, prefix)

    @pytest.mark.parametrize(
        ("url", "match"),
        [
            ("hf://my-org/my-model", "not an HF bucket URL.*repos are not stores"),
            ("s3://bucket/prefix", "not an HF bucket URL"),
            ("hf://buckets/only-namespace", "invalid bucket name ''"),
            ("hf://buckets//name", "invalid namespace ''"),
            ("hf://buckets/ns/bad name", "invalid bucket name 'bad name'"),
            ("hf://buckets/ns/-dash", "invalid bucket name"),
            ("hf://buckets/ns/name/../escape", "invalid prefix '../escape'"),
            ("hf://buckets/ns/name/a//b", "invalid prefix 'a//b'"),
            ("hf://buckets/ns/name/a?b=1", "invalid prefix"),
        ],
    )
    def test_bad(self, url: str, match: str) -> None:
        with pytest.raises(ValueError, match=match) as info:
            HFBucketStore.from_url(url)
        assert "hf://buckets/<namespace>/<name>[/<prefix>]" in str(info.value)  # says how to fix it

    def test_store_root(self, hub: FakeHub) -> None:
        s = HFBucketStore.from_url(hub.store_url("runs/7/"), **hub.store_options())
        assert (s.url, s.bucket_id, s.prefix) == (f"hf://buckets/{DEFAULT_BUCKET}/runs/7", DEFAULT_BUCKET, "runs/7")
        assert s.scheme == "hf" and s.conditional_writes is False

    def test_sibling_prefix_does_not_leak(self, hub: FakeHub) -> None:
        # The Hub's tree prefix is lexical: "run-1" also matches "run-10/...".
        base = f"sib-{uuid.uuid4().hex[:6]}"
        one = open_store(hub.store_url(f"{base}/run-1"), **hub.store_options())
        ten = open_store(hub.store_url(f"{base}/run-10"), **hub.store_options())
        one.put("m", b"1")
        ten.put("m", b"10")
        assert [i.key for i in one.list()] == ["m"]
        assert one.get("m") == b"1"


    def test_endpoint_and_token_from_environment(self, hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_TOKEN", hub.store_options()["token"])
        s = open_store(hub.store_url(f"env-{uuid.uuid4().hex[:6]}"))
        assert s.put("k", b"v").size == 1 and s.get("k") == b"v"
        assert abs(s.head("k").modified - time.time()) < 60  # type: ignore[operator]


class TestSecrets:
    def _failing_store(self, hub: FakeHub) -> HFBucketStore:
        s = open_store(hub.store_url("secret-run"), endpoint=hub.endpoint, token=SECRET)
        assert isinstance(s, HFBucketStore)
        return s

    def test_not_in_repr(self, hub: FakeHub) -> None:
        s = self._failing_store(hub)
        for text in (repr(s), str(s), s.url):
            assert SECRET not in text
        assert repr(s) == f"HFBucketStore('hf://buckets/{DEFAULT_BUCKET}/secret-run', endpoint={hub.endpoint!r})"

    def test_fake_echoes_the_token(self, hub: FakeHub) -> None:
        # Makes the next test meaningful: the raw client error does quote the rejected token.
        from huggingface_hub import HfApi

        with pytest.raises(Exception) as info:
            list(HfApi(endpoint=hub.endpoint, token=SECRET).get_bucket_paths_info(DEFAULT_BUCKET, ["x"]))
        assert SECRET in str(info.value)

    @pytest.mark.parametrize(
        "operation",
        [
            lambda s: s.put("k", b"data"),
            lambda s: s.get("k"),
            lambda s: s.get_range("k", 0, 1),  # a HEAD: the server message travels in a header
            lambda s: s.head("k"),
            lambda s: list(s.list()),
            lambda s: s.delete("k"),
        ],
        ids=["put", "get", "get_range", "head", "list", "delete"],
    )
    def test_not_in_errors_or_logs(self, hub: FakeHub, operation: Any, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.DEBUG)
        with pytest.raises(StoreError) as info:
            operation(self._failing_store(hub))
        err = info.value
        assert err.context["backend"] == "hf" and "401" in str(err)  # hf_xet's errors carry no status attribute
        texts = [str(err), repr(err), "".join(traceback.format_exception(err)), caplog.text]
        for text in texts:
            assert SECRET not in text
        assert SECRET.encode() not in pickle.dumps(err)
        if err.__cause__ is not None:  # chained only when the client's own error is clean
            assert SECRET not in "".join(traceback.format_exception(err.__cause__))


class TestBestEffortConditions:
    def test_create_only_refuses_existing(self, store: HFBucketStore) -> None:
        store.put("lease", b"a", mode="create")
        with pytest.raises(PreconditionFailed, match="already exists.*best-effort") as info:
            store.put("lease", b"b", mode="create")
        assert info.value.context == {"key": "lease", "backend": "hf"}
        assert store.get("lease") == b"a"

    def test_if_match(self, store: HFBucketStore) -> None:
        first = store.put("manifest.json", b"v1")
        second = store.put("manifest.json", b"v2", if_match=first.etag)
        with pytest.raises(PreconditionFailed, match="changed since it was read"):
            store.put("manifest.json", b"v3", if_match=first.etag)
        with pytest.raises(PreconditionFailed, match="missing"):
            store.put("absent", b"x", if_match=second.etag)
        assert store.get("manifest.json") == b"v2"

    def test_etag_is_the_content_hash(self, store: HFBucketStore) -> None:
        a = store.put("x", b"same bytes")
        b = store.put("y", b"same bytes")
        assert a.etag == b.etag and a.etag is not None and len(a.etag) == 64


class TestBigObjects:
    def test_multi_megabyte_round_trip(self, store: HFBucketStore, hub: FakeHub) -> None:
        data = _payload(BIG, seed=1)
        info = store.put("anchors/000000.safetensors", data)
        assert info.size == len(data) == store.head("anchors/000000.safetensors").size
        assert store.get("anchors/000000.safetensors") == data

    def test_ranged_read_is_a_ranged_download(self, store: HFBucketStore, hub: FakeHub) -> None:
        data = _payload(BIG, seed=2)
        store.put("big", data)
        before = len(hub.calls)
        start, end = 3_000_000, 3_000_000 + 300_000  # spans several chunks
        assert store.get_range("big", start, end) == data[start:end]
        calls = hub.calls[before:]
        assert any(c.startswith("HEAD ") and "/resolve/" in c for c in calls)
        assert not any("paths-info" in c for c in calls)  # not the download-then-slice fallback
        assert store.get_range("big", BIG - 5, BIG + 100) == data[-5:]  # clamped like a slice
        assert store.get_range("big", BIG + 10, BIG + 20) == b""

    def test_read_after_overwrite_sees_new_bytes(self, store: HFBucketStore, hub: FakeHub) -> None:
        old = _payload(BIG, seed=3)
        new = bytearray(old)
        new[BIG // 2] ^= 0xFF  # one byte: xet dedups all but one chunk, the read must still differ
        other = open_store(store.url, **hub.store_options())  # a second reader, like a subscriber
        first = store.put("manifest.json", old)
        assert other.get("manifest.json") == old
        second = store.put("manifest.json", bytes(new))
        assert second.etag != first.etag
        assert other.get("manifest.json") == bytes(new)
        assert store.get_range("manifest.json", BIG // 2 - 2, BIG // 2 + 2) == bytes(new[BIG // 2 - 2 : BIG // 2 + 2])
        store.put("manifest.json", b"short")
        assert other.get("manifest.json") == b"short"
        changed = other.get_if_changed("manifest.json", second.etag)
        assert changed is not None and changed[0] == b"short"


class TestBuckets:
    def test_missing_bucket_says_how_to_fix(self, hub: FakeHub) -> None:
        s = open_store(hub.store_url("p", bucket="deltasync/nope"), **hub.store_options())
        with pytest.raises(StoreError, match="create=True") as info:
            s.head("k")
        assert not isinstance(info.value, ObjectNotFound)  # a missing bucket is not a missing key

    def test_create(self, hub: FakeHub) -> None:
        bucket = f"deltasync/new-{uuid.uuid4().hex[:6]}"
        s = open_store(hub.store_url("run", bucket=bucket), create=True, **hub.store_options())
        s.put("k", b"v")
        assert s.get("k") == b"v"
        open_store(hub.store_url("run", bucket=bucket), create=True, **hub.store_options())  # exists: fine
        assert f"POST /api/buckets/{bucket}" in hub.calls

    def test_missing_and_empty(self, store: HFBucketStore) -> None:
        with pytest.raises(ObjectNotFound):
            store.get_range("nope", 0, 10)
        store.delete("nope")
        store.put("empty", b"")
        assert store.get_range("empty", 0, 10) == b""
        with pytest.raises(ValueError, match="bad byte range"):
            store.get_range("empty", 5, 2)


FEED_WAKE_S = 5.0  # generous: a pushed change arrives in well under a second on loopback; polling takes 30 s


def _feed_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("deltasync-hf-feed-")]


@pytest.fixture
def feed(store: HFBucketStore) -> Iterator[ChangeFeed]:
    f = store.change_feed()
    assert f is not None
    yield f
    f.close()


@pytest.fixture
def held_events(hub: FakeHub) -> Iterator[FakeHub]:
    """The fake Hub, with new event streams held until the test sets ``hub.events_open`` again."""
    hub.events_open.clear()
    yield hub
    hub.events_open.set()


class TestChangeFeed:
    def test_put_wakes_a_waiter(self, store: HFBucketStore, feed: ChangeFeed) -> None:
        woke: list[tuple[bool, float]] = []
        started = threading.Event()

        def waiter() -> None:
            started.set()
            woke.append((feed.wait("manifest.json", timeout=30), time.monotonic()))

        thread = threading.Thread(target=waiter)
        thread.start()
        started.wait()
        t0 = time.monotonic()
        store.put("manifest.json", b"v1")
        thread.join(30)
        assert woke and woke[0][0] is True
        assert woke[0][1] - t0 < FEED_WAKE_S
        assert feed.wait("manifest.json", timeout=0.2) is False  # consumed: nothing new since

    def test_other_keys_do_not_wake(self, store: HFBucketStore, feed: ChangeFeed, hub: FakeHub) -> None:
        sibling = open_store(store.url + "0", **hub.store_options())  # "run-x0" shares the bucket
        store.put("deltas/000001.dsd", b"delta")
        sibling.put("manifest.json", b"someone else's")
        t0 = time.monotonic()
        assert feed.wait("manifest.json", timeout=1.0) is False
        assert time.monotonic() - t0 >= 0.9  # it blocked for the timeout, not a busy return
        assert feed.wait("deltas/000001.dsd", timeout=0) is True  # that change was seen, per key
        store.delete("manifest.json")  # deleting what is absent changes nothing: no event
        assert feed.wait("manifest.json", timeout=0.5) is False
        store.put("manifest.json", b"v1")
        store.delete("manifest.json")
        assert feed.wait("manifest.json", timeout=FEED_WAKE_S) is True
        assert feed.wait("manifest.json", timeout=0.5) is False  # put + delete since the last call: one wake

    def test_resumes_from_cursor_after_a_dropped_stream(
        self, store: HFBucketStore, feed: ChangeFeed, held_events: FakeHub
    ) -> None:
        hub = held_events
        store.put("a", b"1")
        assert feed.wait("a", timeout=FEED_WAKE_S)
        cursor = str(hub.cursors[store.bucket_id])
        requests = len(hub.event_requests)
        hub.drop_event_streams()
        assert feed.wait("untouched", timeout=FEED_WAKE_S) is True  # a lost stream wakes every key once
        store.put("manifest.json", b"written while the feed was down")
        deadline = time.monotonic() + FEED_WAKE_S
        while len(hub.event_requests) == requests and time.monotonic() < deadline:
            time.sleep(0.05)  # the fake holds the reconnect; only its arrival is awaited here
        assert hub.event_requests[requests:] == [{"cursor": cursor}]
        hub.events_open.set()
        assert feed.wait("manifest.json", timeout=FEED_WAKE_S) is True  # replayed from the cursor
        assert feed.wait("untouched", timeout=0.5) is False  # a resume is not a reset
        store.put("manifest.json", b"live again")
        assert feed.wait("manifest.json", timeout=FEED_WAKE_S) is True

    def test_reset_when_the_cursor_is_too_old(
        self, store: HFBucketStore, feed: ChangeFeed, held_events: FakeHub, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        hub = held_events
        monkeypatch.setattr(hub, "replay_batches", 1)
        store.put("a", b"1")
        assert feed.wait("a", timeout=FEED_WAKE_S)
        old = str(hub.cursors[store.bucket_id])
        hub.drop_event_streams()
        assert feed.wait("untouched", timeout=FEED_WAKE_S) is True
        requests = len(hub.event_requests)
        store.put("b", b"2")
        store.put("c", b"3")  # the fake keeps one batch: "b" can no longer be replayed
        hub.events_open.set()
        assert feed.wait("untouched", timeout=FEED_WAKE_S) is True  # reset: everything may have changed
        deadline = time.monotonic() + FEED_WAKE_S
        while len(hub.event_requests) < requests + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hub.event_requests[requests : requests + 2] == [{"cursor": old}, {}]  # then a fresh stream
        store.put("manifest.json", b"after the reset")
        assert feed.wait("manifest.json", timeout=FEED_WAKE_S) is True

    def test_close_stops_the_thread_at_once(self, store: HFBucketStore) -> None:
        before = len(_feed_threads())
        feed = store.change_feed()
        assert feed is not None and len(_feed_threads()) == before + 1
        t0 = time.monotonic()
        feed.close()
        assert time.monotonic() - t0 < 1.0  # the Hub pings every ~30 s; close does not wait for it
        assert len(_feed_threads()) == before
        assert feed.wait("manifest.json", timeout=0.1) is False
        feed.close()  # idempotent

    def test_store_close_closes_its_feeds(self, hub: FakeHub) -> None:
        before = len(_feed_threads())
        s = open_store(hub.store_url(f"run-{uuid.uuid4().hex[:8]}"), **hub.store_options())
        assert s.change_feed() is not None and s.change_feed() is not None
        assert len(_feed_threads()) == before + 2
        s.close()
        assert len(_feed_threads()) == before

    @pytest.mark.parametrize("case", ["bad token", "no bucket", "no parser"])
    def test_unavailable_feed_means_polling(
        self, hub: FakeHub, case: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        caplog.set_level(logging.DEBUG)
        options = hub.store_options()
        url = hub.store_url("feedless")
        if case == "bad token":
            options["token"] = SECRET
        elif case == "no bucket":
            url = hub.store_url("feedless", bucket="deltasync/nope")
        else:
            monkeypatch.setattr("deltasync.stores.hf._live_follow_reader", lambda: None)
        before = len(_feed_threads())
        assert open_store(url, **options).change_feed() is None
        assert len(_feed_threads()) == before
        assert "polled" in caplog.text and SECRET not in caplog.text

    def test_fake_feed_speaks_huggingface_hubs_format(self, hub: FakeHub) -> None:
        # The fake's wire format, checked by huggingface_hub's own follower (resume via ?since=).
        live = pytest.importorskip("huggingface_hub._bucket_live_follow")
        bucket = f"deltasync/feed-{uuid.uuid4().hex[:6]}"
        s = open_store(hub.store_url("run", bucket=bucket), create=True, **hub.store_options())
        s.put("early", b"before the follower")
        seen: list[Any] = []
        got = threading.Event()

        def on_changes(changes: list[Any]) -> None:
            seen.extend(changes)
            got.set()

        stop = threading.Event()
        follower = live.BucketFollower(
            endpoint=hub.endpoint,
            bucket_id=bucket,
            token=hub.store_options()["token"],
            on_changes=on_changes,
            on_reconcile=lambda: None,
            is_alive=lambda: not stop.is_set(),
        )
        follower.start()
        assert got.wait(FEED_WAKE_S)  # the batch at updatedAt, replayed from ?since=
        assert [(c.path, c.op) for c in seen] == [("run/early", "add")]
        deadline = time.monotonic() + FEED_WAKE_S
        while not follower.subscribed and time.monotonic() < deadline:
            time.sleep(0.02)
        got.clear()
        info = s.put("early", b"overwritten")
        assert got.wait(FEED_WAKE_S)
        change = seen[-1]
        assert (change.path, change.op, change.size, change.xet_hash) == ("run/early", "update", 11, info.etag)
        assert change.uploaded_at is not None and change.mtime is not None
        stop.set()
        s.delete("early")  # the follower notices it should stop when the stream next speaks
        follower.join(FEED_WAKE_S)
        assert not follower.is_alive()
        assert [r for r in hub.event_requests if "since" in r]

    def test_subscriber_wakes_on_publish(self, hub: FakeHub) -> None:
        torch = pytest.importorskip("torch")
        from deltasync.publish.publisher import Publisher
        from deltasync.replica.subscriber import Subscriber
        from tests.test_sync import assert_exact, model, replica, train

        url = hub.store_url(f"run-{uuid.uuid4().hex[:8]}")
        trainer = model()
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
        rep, applier = replica()
        # Polling alone would look again only 30 s after each look; the feed must wake it first.
        sub = Subscriber(url, applier, poll_interval=30, max_poll_interval=30, **hub.store_options())
        with Publisher(trainer, open_store(url, **hub.store_options())) as pub:
            sub.start()
            try:
                time.sleep(0.5)  # let the subscriber find nothing and settle into waiting on the feed
                for step in range(3):
                    train(trainer, opt)
                    pub.publish(step, block=True)
                    pub.flush()
                    t0 = time.monotonic()
                    assert pub.version is not None
                    assert sub.wait_for(pub.version, timeout=20), f"v{pub.version} not seen in 20 s"
                    assert time.monotonic() - t0 < FEED_WAKE_S
                assert_exact(trainer, rep)
                assert sub.stats.polls <= 8  # woken per publish, not polling in a loop
            finally:
                sub.close()


def test_serve_leaves_environment_alone() -> None:
    before = dict(os.environ)
    with serve() as hub:
        s = open_store(hub.store_url("env"), **hub.store_options())
        s.put("k", b"v")
        assert s.get("k") == b"v"
    assert dict(os.environ) == before


def test_an_unresolvable_hub_fails_at_once_with_what_is_missing() -> None:
    """Offline (the Hub's name does not resolve) a call fails in well under a second instead of retrying."""
    import time

    from deltasync.errors import StoreError
    from deltasync.stores import open_store

    store = open_store("hf://buckets/someone/bucket/run1", endpoint="http://deltasync-no-such-hub.invalid")
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"cannot resolve deltasync-no-such-hub\.invalid .*no network"):
        store.head("manifest.json")
    assert time.monotonic() - started < 5
