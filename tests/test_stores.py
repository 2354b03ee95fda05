"""One conformance suite for every store backend, real loopback servers included."""

from __future__ import annotations

import threading

import pytest

from deltasync.errors import ManifestError, ObjectNotFound, PreconditionFailed, StoreError
from deltasync.stores import Store, open_store
from deltasync.stores.base import check_key, retry


class TestReadWrite:
    def test_put_get_roundtrip(self, store: Store) -> None:
        data = bytes(range(256)) * 41
        info = store.put("deltas/000001.safetensors", data)
        assert info.size == len(data)
        assert store.get("deltas/000001.safetensors") == data
        assert store.head("deltas/000001.safetensors").size == len(data)

    def test_empty_object(self, store: Store) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""

    def test_overwrite_replaces(self, store: Store) -> None:
        store.put("manifest.json", b"one")
        store.put("manifest.json", b"two")
        assert store.get("manifest.json") == b"two"

    def test_range(self, store: Store) -> None:
        store.put("a/b", b"0123456789")
        assert store.get_range("a/b", 2, 5) == b"234"
        assert store.get_range("a/b", 8, 10) == b"89"

    def test_missing(self, store: Store) -> None:
        with pytest.raises(ObjectNotFound):
            store.get("nope")
        with pytest.raises(ObjectNotFound):
            store.head("nope")
        with pytest.raises(FileNotFoundError):  # the builtin it also is
            store.get("nope")
        assert not store.exists("nope")

    def test_list_and_delete(self, store: Store) -> None:
        for key in ["deltas/2", "deltas/1", "anchors/1", "manifest.json"]:
            store.put(key, key.encode())
        assert sorted(i.key for i in store.list("deltas/")) == ["deltas/1", "deltas/2"]
        assert {i.key for i in store.list()} == {"deltas/2", "deltas/1", "anchors/1", "manifest.json"}
        store.delete("deltas/1")
        store.delete("deltas/1")  # missing is fine
        assert [i.key for i in store.list("deltas/")] == ["deltas/2"]

    def test_etag_changes_on_write(self, store: Store) -> None:
        first = store.put("m", b"1")
        second = store.put("m", b"2")
        if first.etag is not None:
            assert first.etag != second.etag
            assert store.head("m").etag == second.etag

    def test_get_if_changed(self, store: Store) -> None:
        info = store.put("m", b"v1")
        got = store.get_if_changed("m", None)
        assert got is not None and got[0] == b"v1"
        assert store.get_if_changed("m", got[1].etag) is None
        store.put("m", b"v2")
        again = store.get_if_changed("m", got[1].etag)
        assert again is not None and again[0] == b"v2"
        assert info.etag is None or again[1].etag != info.etag


class TestConditionalWrites:
    def test_create_only(self, store: Store) -> None:
        if not store.conditional_writes:
            pytest.skip(f"{store.scheme} has no conditional writes")
        store.put("lease", b"a", mode="create")
        with pytest.raises(PreconditionFailed):
            store.put("lease", b"b", mode="create")
        assert store.get("lease") == b"a"

    def test_compare_and_swap(self, store: Store) -> None:
        if not store.conditional_writes:
            pytest.skip(f"{store.scheme} has no conditional writes")
        info = store.put("manifest.json", b"v1")
        store.put("manifest.json", b"v2", if_match=info.etag)
        with pytest.raises(PreconditionFailed):
            store.put("manifest.json", b"v3", if_match=info.etag)
        assert store.get("manifest.json") == b"v2"

    def test_racing_creators_one_wins(self, store: Store) -> None:
        if not store.conditional_writes:
            pytest.skip(f"{store.scheme} has no conditional writes")
        wins, losses = [], []

        def attempt(i: int) -> None:
            try:
                store.put("owner", str(i).encode(), mode="create")
                wins.append(i)
            except PreconditionFailed:
                losses.append(i)

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(wins) == 1 and len(losses) == 5
        assert store.get("owner") == str(wins[0]).encode()


class TestKeys:
    @pytest.mark.parametrize(
        "key", ["", "/abs", "a/../b", "..", "a//b", "./a", "s3://x/y", "a\\b", "a b", "x" * 2000]
    )
    def test_unsafe_keys_refused(self, key: str) -> None:
        with pytest.raises(ManifestError, match="key"):
            check_key(key)

    def test_unsafe_key_refused_by_backend(self, store: Store) -> None:
        with pytest.raises(ManifestError):
            store.put("../escape", b"x")


class TestOpenStore:
    def test_plain_path_is_local(self, tmp_path) -> None:
        store = open_store(str(tmp_path / "run"))
        assert store.scheme == "file"
        assert open_store(store.url).url == store.url

    def test_unknown_scheme(self) -> None:
        with pytest.raises(ValueError, match="registered"):
            open_store("gopher://x")


class TestRetry:
    def test_retries_transient_then_succeeds(self) -> None:
        calls = []

        def flaky() -> str:
            calls.append(1)
            if len(calls) < 3:
                raise ConnectionError("reset")
            return "ok"

        assert retry(flaky, what="t", transient=lambda e: isinstance(e, ConnectionError), base_delay=0.001) == "ok"
        assert len(calls) == 3

    def test_non_transient_propagates(self) -> None:
        def broken() -> None:
            raise StoreError("denied")

        with pytest.raises(StoreError, match="denied"):
            retry(broken, what="t", transient=lambda e: False)
