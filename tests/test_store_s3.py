"""S3 backend beyond the conformance suite: URLs, configuration, secrets, conditional GET, size.

Everything runs against real loopback servers: moto (tests/servers/s3.py) and, for
what moto does not do (echo credentials back), a small HTTP server in this file.
"""

from __future__ import annotations

import http.server
import os
import pickle
import traceback
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from deltasync.errors import ObjectNotFound, PreconditionFailed, StoreError
from deltasync.stores import open_store
from deltasync.stores.s3 import S3Store
from tests.http_helpers import serving, url_of
from tests.servers.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY, S3Server

pytest.importorskip("obstore")

NO_RETRY = {"max_retries": 0}
SESSION_TOKEN = "deltasync-test-session-token-0123456789"
MiB = 1024 * 1024


@pytest.fixture
def s3(servers: dict[str, Any]) -> S3Server:
    """The session's moto server."""
    return servers["get"]("s3")  # type: ignore[no-any-return]


@pytest.fixture
def store(s3: S3Server) -> S3Store:
    """A fresh prefix in the session bucket."""
    s = open_store(s3.store_url(f"t-{uuid.uuid4().hex[:8]}"), **s3.store_options())
    assert isinstance(s, S3Store)
    return s


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No AWS_* variables from the machine; monkeypatch restores them afterwards."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    return monkeypatch


def _everything_said(err: BaseException) -> str:
    """All a user could see of an error: message, repr, traceback, pickled form."""
    return "\n".join(
        [str(err), repr(err), "".join(traceback.format_exception(err)), repr(pickle.loads(pickle.dumps(err)).__dict__)]
    )


class TestUrl:
    def test_bucket_only(self, s3: S3Server) -> None:
        bucket = s3.create_bucket()
        store = S3Store.from_url(f"s3://{bucket}", **s3.store_options())
        assert (store.bucket, store.prefix, store.url) == (bucket, "", f"s3://{bucket}")
        store.put("manifest.json", b"{}")
        assert [i.key for i in store.list()] == ["manifest.json"]

    def test_nested_prefix_joins_and_strips(self, s3: S3Server) -> None:
        bucket = s3.create_bucket()
        store = S3Store.from_url(f"s3://{bucket}/runs/exp-1/", **s3.store_options())
        assert (store.prefix, store.url) == ("runs/exp-1", f"s3://{bucket}/runs/exp-1")
        store.put("deltas/000001", b"d")
        root = S3Store.from_url(f"s3://{bucket}", **s3.store_options())
        assert [i.key for i in root.list()] == ["runs/exp-1/deltas/000001"]
        assert [i.key for i in store.list()] == ["deltas/000001"]
        assert root.get("runs/exp-1/deltas/000001") == b"d"

    def test_prefix_is_a_directory_not_a_string_prefix(self, s3: S3Server) -> None:
        bucket = s3.create_bucket()
        S3Store.from_url(f"s3://{bucket}/run-10", **s3.store_options()).put("m", b"other run")
        store = S3Store.from_url(f"s3://{bucket}/run-1", **s3.store_options())
        assert list(store.list()) == []
        with pytest.raises(ObjectNotFound):
            store.get("0/m")

    def test_open_store_dispatches(self, s3: S3Server) -> None:
        store = open_store(s3.store_url("x"), **s3.store_options())
        assert isinstance(store, S3Store) and store.scheme == "s3"

    @pytest.mark.parametrize(
        ("url", "match"),
        [
            ("s3://", "no bucket"),
            ("s3:///prefix", "no bucket"),
            ("http://bucket/prefix", "not an S3 URL"),
            ("bucket/prefix", "not an S3 URL"),
            ("s3://bad bucket/x", "invalid S3 bucket name"),
            ("s3://bucket//x", "invalid S3 prefix"),
            ("s3://bucket/a/../b", "invalid S3 prefix"),
            ("s3://bucket/a b", "invalid S3 prefix"),
            ("s3://bucket/p?versionId=1", "query or fragment"),
        ],
    )
    def test_bad_urls(self, url: str, match: str) -> None:
        with pytest.raises(ValueError, match=match) as info:
            S3Store.from_url(url, access_key_id="a", secret_access_key="b")
        # Every message says what a good URL looks like.
        assert "s3://bucket/prefix" in str(info.value) or "segments of" in str(info.value)

    def test_credentials_in_url_refused_without_echo(self) -> None:
        with pytest.raises(ValueError, match="must not carry credentials") as info:
            S3Store.from_url(f"s3://{ACCESS_KEY_ID}:{SECRET_ACCESS_KEY}@bucket/p")
        assert SECRET_ACCESS_KEY not in _everything_said(info.value)
        assert ACCESS_KEY_ID not in str(info.value)

    def test_unknown_option(self, s3: S3Server) -> None:
        with pytest.raises(TypeError, match="bucket_name"):
            open_store(s3.store_url("x"), bucket_name="y", **s3.store_options())

    def test_half_credentials(self, s3: S3Server) -> None:
        with pytest.raises(ValueError, match="together"):
            open_store(s3.store_url("x"), endpoint=s3.endpoint, allow_http=True, access_key_id="only-the-id")

    def test_plain_http_needs_allow_http(self, s3: S3Server, clean_env: pytest.MonkeyPatch) -> None:
        with pytest.raises(ValueError, match="allow_http=True"):
            open_store(s3.store_url("x"), **s3.store_options(allow_http=None))


class TestEnvironment:
    def test_environment_alone(self, s3: S3Server, clean_env: pytest.MonkeyPatch) -> None:
        clean_env.setenv("AWS_ENDPOINT_URL", s3.endpoint)
        clean_env.setenv("AWS_ALLOW_HTTP", "true")
        clean_env.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
        clean_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
        clean_env.setenv("AWS_REGION", "eu-west-1")
        store = open_store(s3.store_url("env-only"))
        store.put("k", b"from env")
        assert open_store(s3.store_url("env-only"), **s3.store_options()).get("k") == b"from env"

    def test_options_beat_environment(self, s3: S3Server, clean_env: pytest.MonkeyPatch) -> None:
        dead = "http://127.0.0.1:1"  # nothing listens there
        clean_env.setenv("AWS_ENDPOINT_URL", dead)
        clean_env.setenv("AWS_ENDPOINT_URL_S3", dead)  # outranks AWS_ENDPOINT_URL in obstore
        clean_env.setenv("AWS_ALLOW_HTTP", "true")
        clean_env.setenv("AWS_ACCESS_KEY_ID", "AKIAENVIRONMENTKEY")
        clean_env.setenv("AWS_SECRET_ACCESS_KEY", "environment-secret")
        store = open_store(s3.store_url("opts"), **s3.store_options(retry_config=NO_RETRY))
        store.put("k", b"via options")
        assert store.get("k") == b"via options"

    def test_environment_endpoint_is_used(self, s3: S3Server, clean_env: pytest.MonkeyPatch) -> None:
        clean_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
        options = s3.store_options(retry_config=NO_RETRY)
        del options["endpoint"]
        store = open_store(s3.store_url("env-endpoint"), **options)
        with pytest.raises(StoreError) as info:
            store.get("k")
        assert not isinstance(info.value, ObjectNotFound)
        assert "127.0.0.1:1" in str(info.value)

    def test_environment_http_needs_allow_http(self, s3: S3Server, clean_env: pytest.MonkeyPatch) -> None:
        clean_env.setenv("AWS_ENDPOINT_URL", s3.endpoint)
        with pytest.raises(ValueError, match="AWS_ALLOW_HTTP"):
            open_store(s3.store_url("x"), access_key_id="a", secret_access_key="b")


class _EchoCredentials(http.server.BaseHTTPRequestHandler):
    """Answers every request 403 with what it was sent, as AWS echoes a bad key id."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        auth = self.headers.get("Authorization", "")
        key_id = auth.partition("Credential=")[2].partition("/")[0]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?><Error><Code>InvalidAccessKeyId</Code>'
            f"<Message>The AWS Access Key Id you provided does not exist in our records.</Message>"
            f"<AWSAccessKeyId>{key_id}</AWSAccessKeyId><Header>{auth}</Header>"
            f"<Token>{self.headers.get('x-amz-security-token', '')}</Token>"
            f"<Leak>{self.server.leak}</Leak></Error>"  # type: ignore[attr-defined]
        ).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def echo_server() -> Iterator[str]:
    """A loopback endpoint that echoes credentials (and the secret, as a broken proxy might)."""
    with serving(_EchoCredentials, leak=SECRET_ACCESS_KEY) as server:
        yield url_of(server)


class _FlakyThenServe(http.server.BaseHTTPRequestHandler):
    """Answers 503 to the first ``server.failures`` requests, then serves one object."""

    BODY = b"survived the outage"

    def do_GET(self) -> None:
        self.server.seen += 1  # type: ignore[attr-defined]
        if self.server.seen <= self.server.failures:  # type: ignore[attr-defined]
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.BODY)))
        self.send_header("ETag", '"abc"')
        self.send_header("Last-Modified", "Sun, 22 Nov 2026 06:00:00 GMT")
        self.end_headers()
        self.wfile.write(self.BODY)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class TestRetries:
    def test_defaults_are_capped(self, store: S3Store) -> None:
        config = store._store.retry_config
        assert config["max_retries"] == 4
        assert config["backoff"]["max_backoff"] == timedelta(seconds=8)

    def test_transient_failures_are_retried_by_the_client(self) -> None:
        with serving(_FlakyThenServe, seen=0, failures=2) as server:
            fast = {"backoff": {"init_backoff": timedelta(milliseconds=5), "max_backoff": timedelta(milliseconds=20)}}
            store = open_store(
                "s3://bucket/p",
                endpoint=url_of(server),
                allow_http=True,
                access_key_id="a",
                secret_access_key="b",
                retry_config=fast,
            )
            assert store.get("k") == _FlakyThenServe.BODY
            assert server.seen == 3  # type: ignore[attr-defined]


class TestSecrets:
    SECRETS = (ACCESS_KEY_ID, SECRET_ACCESS_KEY, SESSION_TOKEN)

    def _assert_clean(self, text: str) -> None:
        for secret in self.SECRETS:
            assert secret not in text

    def test_repr_and_str_show_only_the_url(self, s3: S3Server) -> None:
        store = open_store(s3.store_url("r/x"), **s3.store_options(session_token=SESSION_TOKEN))
        assert repr(store) == f"S3Store('s3://{s3.bucket}/r/x')"
        self._assert_clean(repr(store) + str(store))

    def test_server_error_is_translated_and_clean(self, s3: S3Server) -> None:
        store = open_store(f"s3://missing-{uuid.uuid4().hex[:8]}/p", **s3.store_options(retry_config=NO_RETRY))
        with pytest.raises(StoreError, match=r"bucket .* not found") as info:
            store.put("k", b"x")
        err = info.value
        assert not isinstance(err, ObjectNotFound)
        assert (err.backend, err.key) == ("s3", "k")  # type: ignore[attr-defined]
        assert err.__cause__ is None and err.__context__ is None
        self._assert_clean(_everything_said(err))

    @pytest.mark.parametrize("op", ["get", "head", "put", "list", "get_if_changed"])
    def test_echoed_credentials_are_redacted(self, echo_server: str, op: str) -> None:
        store = open_store(
            "s3://bucket/p",
            endpoint=echo_server,
            allow_http=True,
            access_key_id=ACCESS_KEY_ID,
            secret_access_key=SECRET_ACCESS_KEY,
            session_token=SESSION_TOKEN,
            retry_config=NO_RETRY,
        )
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: store.get("k"),
            "head": lambda: store.head("k"),
            "put": lambda: store.put("k", b"x"),
            "list": lambda: list(store.list()),
            "get_if_changed": lambda: store.get_if_changed("k", '"e"'),
        }
        with pytest.raises(StoreError) as info:
            calls[op]()
        err = info.value
        assert err.backend == "s3"  # type: ignore[attr-defined]
        assert err.__cause__ is None and err.__context__ is None
        self._assert_clean(_everything_said(err))
        if op != "head":  # HEAD answers carry no body
            assert "InvalidAccessKeyId" in str(err)
            assert "<AWSAccessKeyId>***</AWSAccessKeyId>" in str(err)

    def test_environment_credentials_are_redacted(self, echo_server: str, clean_env: pytest.MonkeyPatch) -> None:
        clean_env.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
        clean_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
        clean_env.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
        store = open_store("s3://bucket/p", endpoint=echo_server, allow_http=True, retry_config=NO_RETRY)
        with pytest.raises(StoreError) as info:
            store.get("k")
        self._assert_clean(_everything_said(info.value))


class TestConditionalGet:
    def test_unchanged_is_none_without_a_body(self, store: S3Store, monkeypatch: pytest.MonkeyPatch) -> None:
        import obstore

        info = store.put("manifest.json", b"v1")
        sent: list[dict[str, Any]] = []
        outcomes: list[str] = []
        real_get = obstore.get

        def spy(s: Any, path: str, *, options: Any = None) -> Any:
            sent.append(dict(options or {}))
            try:
                result = real_get(s, path, options=options)
            except obstore.exceptions.NotModifiedError:  # only a 304 raises this
                outcomes.append("304")
                raise
            outcomes.append("200")
            return result

        def no_head(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("get_if_changed must not HEAD first")

        monkeypatch.setattr(obstore, "get", spy)
        monkeypatch.setattr(obstore, "head", no_head)
        assert store.get_if_changed("manifest.json", info.etag) is None
        assert sent == [{"if_none_match": info.etag}] and outcomes == ["304"]

        new = store.put("manifest.json", b"v2")
        got = store.get_if_changed("manifest.json", info.etag)
        assert got is not None and got[0] == b"v2"
        assert got[1].etag == new.etag and got[1].size == 2 and got[1].modified is not None
        assert outcomes == ["304", "200"]

    def test_no_etag_reads(self, store: S3Store) -> None:
        store.put("m", b"abc")
        got = store.get_if_changed("m", None)
        assert got is not None and got[0] == b"abc" and got[1].etag == store.head("m").etag

    def test_missing(self, store: S3Store) -> None:
        with pytest.raises(ObjectNotFound):
            store.get_if_changed("m", '"whatever"')


class TestBehaviour:
    def test_large_object_roundtrip(self, store: S3Store) -> None:
        data = os.urandom(20 * MiB)  # above obstore's 5 MiB part size: a multipart upload
        info = store.put("anchors/000000.safetensors", data)
        assert info.size == len(data)
        head = store.head("anchors/000000.safetensors")
        assert head.size == len(data) and head.etag == info.etag
        assert store.get("anchors/000000.safetensors") == data
        # A range that crosses a part boundary.
        start, end = 5 * MiB - 7, 5 * MiB + 9
        assert store.get_range("anchors/000000.safetensors", start, end) == data[start:end]

    def test_large_conditional_put_is_one_request(self, store: S3Store) -> None:
        data = os.urandom(12 * MiB)
        store.put("big", data, mode="create")
        with pytest.raises(PreconditionFailed):
            store.put("big", b"x", mode="create")
        assert store.get("big") == data

    def test_if_match_on_missing_key(self, store: S3Store) -> None:
        with pytest.raises(PreconditionFailed):
            store.put("m", b"x", if_match='"0123"')

    def test_create_and_if_match_exclusive(self, store: S3Store) -> None:
        with pytest.raises(ValueError, match="exclude"):
            store.put("m", b"x", mode="create", if_match='"0123"')

    def test_ranges_follow_slicing(self, store: S3Store) -> None:
        store.put("r", b"0123456789")
        assert store.get_range("r", 3, 3) == b""
        assert store.get_range("r", 8, 100) == b"89"
        assert store.get_range("r", 20, 30) == b""
        with pytest.raises(ObjectNotFound):
            store.get_range("missing", 0, 4)
        with pytest.raises(ObjectNotFound):
            store.get_range("missing", 2, 2)

    def test_list_is_a_string_prefix(self, store: S3Store) -> None:
        for key in ["deltas/000001", "deltas/000002", "delta-notes", "anchors/000000", "a=b+c@d,e"]:
            store.put(key, b"x")
        assert sorted(i.key for i in store.list("delta")) == ["delta-notes", "deltas/000001", "deltas/000002"]
        assert [i.key for i in store.list("deltas/000002")] == ["deltas/000002"]
        assert [i.key for i in store.list("a=")] == ["a=b+c@d,e"]
        assert store.get("a=b+c@d,e") == b"x"
        info = next(iter(store.list("anchors/")))
        assert info.size == 1 and info.etag and info.modified

    def test_delete_missing_is_fine(self, store: S3Store) -> None:
        store.delete("never/written")


def test_no_credentials_is_said_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without any credentials the chain ends at the instance metadata service: the error says what to set."""
    from deltasync.errors import StoreError
    from deltasync.stores import open_store

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
    store = open_store("s3://some-bucket/run1", retry_config={"max_retries": 0})
    with pytest.raises(StoreError) as raised:
        store.head("manifest.json")
    message = str(raised.value)
    if "169.254.169.254" not in message and "no S3 credentials" not in message:
        pytest.skip(f"this machine's credential chain ends elsewhere: {message[:200]}")
    assert "no S3 credentials found" in message and "AWS_ACCESS_KEY_ID" in message
