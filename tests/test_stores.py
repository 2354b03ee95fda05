"""One conformance suite for every store backend, real loopback servers included."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from deltasync.errors import ConfigError, IntegrityError, ManifestError, ObjectNotFound, PreconditionFailed, StoreError
from deltasync.stores import LocalStore, MemoryStore, Store, open_store
from deltasync.stores.base import URL_FORMS, check_key, retry


class TestReadWrite:
    def test_put_get_roundtrip(self, store: Store) -> None:
        data = bytes(range(256)) * 41
        info = store.put("deltas/000001.safetensors", data)
        assert info.size == len(data)
        assert store.get("deltas/000001.safetensors") == data
        assert store.head("deltas/000001.safetensors").size == len(data)

    def test_parts_and_buffers(self, store: Store) -> None:
        """``put_parts`` writes the buffers one after another; ``get_buffer`` reads the same bytes."""
        parts = [b"head", memoryview(bytearray(b"0123456789")), memoryview(b"")[0:0], bytearray(b"tail")]
        store.put_parts("p/obj", parts)
        assert store.get("p/obj") == b"head0123456789tail"
        buffer = store.get_buffer("p/obj")
        assert bytes(buffer) == b"head0123456789tail"
        if isinstance(store, LocalStore):
            assert not memoryview(buffer).readonly  # viewed by the decoder, not copied
        with pytest.raises(IntegrityError):
            store.get_buffer("p/obj", max_bytes=4)
        with pytest.raises(ObjectNotFound):
            store.get_buffer("p/missing")

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

    # Bounded reads: every backend refuses an object larger than max_bytes (the size a manifest declares).

    def test_get_max_bytes(self, store: Store) -> None:
        data = bytes(range(256)) * 4
        store.put("deltas/000001.safetensors", data)
        assert store.get("deltas/000001.safetensors", max_bytes=len(data)) == data
        assert store.get("deltas/000001.safetensors", max_bytes=len(data) * 10) == data
        with pytest.raises(IntegrityError, match=rf"more than the {len(data) - 1} bytes this read allows") as info:
            store.get("deltas/000001.safetensors", max_bytes=len(data) - 1)
        assert info.value.key == "deltas/000001.safetensors" and info.value.limit == len(data) - 1
        store.put("empty", b"")
        assert store.get("empty", max_bytes=0) == b""
        with pytest.raises(IntegrityError):
            store.get("deltas/000001.safetensors", max_bytes=0)

    def test_get_if_changed_max_bytes(self, store: Store) -> None:
        store.put("manifest.json", b"m" * 100)
        with pytest.raises(IntegrityError, match="'manifest.json'.*more than the 10 bytes") as info:
            store.get_if_changed("manifest.json", None, max_bytes=10)
        assert info.value.limit == 10
        got = store.get_if_changed("manifest.json", None, max_bytes=100)
        assert got is not None and got[0] == b"m" * 100
        if got[1].etag is not None:  # unchanged: nothing is read, so no size is checked
            assert store.get_if_changed("manifest.json", got[1].etag, max_bytes=10) is None

    def test_max_bytes_of_missing_object(self, store: Store) -> None:
        with pytest.raises(ObjectNotFound):
            store.get("nope", max_bytes=10)
        with pytest.raises(ObjectNotFound):
            store.get_if_changed("nope", None, max_bytes=10)

    def test_bad_max_bytes(self, store: Store) -> None:
        store.put("k", b"v")
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="max_bytes must be a non-negative int"):
                store.get("k", max_bytes=bad)  # type: ignore[arg-type]


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

    @pytest.mark.parametrize(
        ("url", "match"),
        [
            ("", "must be a non-empty string"),
            (None, "must be a non-empty string"),
            (42, "must be a non-empty string"),
            (b"/tmp/run", "must be a non-empty string"),
            ("gs://x", "unknown store scheme 'gs' in 'gs://x'; registered:"),
            ("ftp://x", "unknown store scheme 'ftp'"),
            ("http://x", "unknown store scheme 'http'"),
            ("https://example.com/run", "unknown store scheme 'https'"),
            ("gs:/x", r"unknown store scheme 'gs'.*write '\./gs:/x'"),
            ("s3:/bucket", r"'s3:/bucket' needs '//' after 's3:' \(did you mean 's3://bucket'\?\)"),
            ("memory:run", r"needs '//' after 'memory:' \(did you mean 'memory://run'\?\)"),
            ("hf:buckets/a/b", "needs '//' after 'hf:'"),
        ],
    )
    def test_bad_urls_list_the_accepted_forms(self, url: Any, match: str) -> None:
        with pytest.raises(ConfigError, match=match) as info:
            open_store(url)
        assert URL_FORMS in str(info.value)
        assert isinstance(info.value, ValueError) and info.value.argument == "url"

    @pytest.mark.parametrize(
        ("url", "match"),
        [
            ("s3://", "S3 URL has no bucket; expected 's3://bucket' or 's3://bucket/prefix'"),
            ("s3:///prefix", "S3 URL has no bucket"),
            ("s3://bad bucket/x", "invalid S3 bucket name"),
            ("s3://bucket/a/../b", "invalid S3 prefix"),
            ("s3://bucket/p?versionId=1", "query or fragment"),
            ("hf://my-org/my-model", "not an HF bucket URL.*repos are not stores"),
            ("hf://buckets/only-namespace", "invalid bucket name ''"),
            ("hf://buckets//name", "invalid namespace ''"),
            ("hf://buckets/ns/name/../escape", "invalid prefix '../escape'"),
            ("hf://buckets/ns/name/a?b=1", "invalid prefix"),
            ("memory:/x", "needs '//'"),
        ],
    )
    def test_bad_backend_urls(self, url: str, match: str) -> None:
        # Refused while parsing the URL: no client is built, nothing is contacted.
        with pytest.raises(ConfigError, match=match):
            open_store(url)

    @pytest.mark.parametrize(
        ("url", "match"),
        [
            (
                "file://run1",
                r"in 'file://run1', 'run1' was read as a host name \(file://HOST/path\): "
                r"write 'file:run1' or '\./run1' for a relative path, or 'file:///abs/path'",
            ),
            ("file://run1/sub", r"'run1' was read as a host name.*'file:run1/sub' or '\./run1/sub'"),
            ("file://", "names no path"),
            ("file:", "names no path"),
            ("file:///tmp/x?y=1", "query or fragment"),
            ("file:///tmp/x#frag", "query or fragment"),
        ],
    )
    def test_bad_file_urls(self, url: str, match: str) -> None:
        with pytest.raises(ConfigError, match=match):
            open_store(url)
        with pytest.raises(ConfigError, match=match):
            LocalStore.from_url(url)

    def test_file_urls(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        here = tmp_path.resolve()
        cases = {
            f"file://{here}/a": here / "a",
            f"file://localhost{here}/b": here / "b",
            f"file:{here}/c": here / "c",
            "file:run1": here / "run1",
            "file:run1/sub": here / "run1" / "sub",
            f"file://{here}/with%20space": here / "with space",
        }
        for url, root in cases.items():
            store = open_store(url)
            assert isinstance(store, LocalStore) and store.root == root, url

    def test_paths_with_colons_are_paths(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        here = tmp_path.resolve()
        for path in ["./a:b", "runs:7", "t=10:00", f"{here}/x:y", "2024-01-01T10:00"]:
            store = open_store(path)
            assert isinstance(store, LocalStore) and store.root == here / path.removeprefix("./").split("/")[-1]

    def test_path_objects_and_stores(self, tmp_path: Path) -> None:
        store = open_store(tmp_path / "run")
        assert isinstance(store, LocalStore) and store.root == (tmp_path / "run").resolve()
        memory = MemoryStore("open-store-passthrough")
        assert open_store(memory) is memory

    def test_cache_options_are_a_replicas(self, tmp_path: Path) -> None:
        with pytest.raises(ConfigError, match="open_store takes no cache_max_bytes"):
            open_store(str(tmp_path / "run"), cache_max_bytes=1 << 20)


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
