"""A fake Hugging Face Hub serving the bucket API on loopback, for the real huggingface_hub + hf_xet clients.

Only the endpoints the client calls are implemented (found by reading huggingface_hub 2.4 and
logging its requests; :attr:`FakeHub.calls` keeps that log for tests):

=================================================  ========================================================
request                                            called by
=================================================  ========================================================
``POST /api/buckets/{ns}/{name}``                  ``create_bucket`` (409 if it exists)
``GET  /api/buckets/{id}``                         ``bucket_info``
``GET  /api/buckets/{id}/xet-{read,write}-token``  hf_xet token refresh; ``casUrl`` is a ``local://`` dir
``POST /api/buckets/{id}/batch``                   ``batch_bucket_files`` (NDJSON addFile / deleteFile)
``POST /api/buckets/{id}/paths-info``              ``get_bucket_paths_info``, ``download_bucket_files``
``GET  /api/buckets/{id}/tree[/{prefix}]``         ``list_bucket_tree`` (lexical prefix, like the Hub)
``HEAD /buckets/{id}/resolve/{path}``              ``get_bucket_file_metadata`` (X-Xet-Hash, X-Linked-Size)
``GET  /api/buckets/{id}/events``                  the bucket change feed (server-sent events, see below)
=================================================  ========================================================

File bytes never reach this server: hf_xet writes them to the local CAS directory named by the
token endpoints, and the batch names only a xet hash. The fake learns a file's size by
reconstructing it from that CAS (with hf_xet, the one reader of that format at hand) and refuses
hashes the CAS does not hold. Errors carry the Hub's ``X-Error-Code`` header, which
huggingface_hub turns into ``EntryNotFoundError`` / ``BucketNotFoundError``.

The change feed speaks the wire format huggingface_hub's ``_bucket_live_follow`` reads (2.4):
``Content-Type: text/event-stream``, chunked, one ``event: <name>`` / ``data: <JSON object>`` block
per event, ``: ping`` comments while idle. Every batch that changed something is one ``changes``
event ``{"cursor", "changes": [{"path", "op": "add"|"update"|"delete", "size", "xetHash",
"uploadedAt", "mtime"}]}``; the cursor (the bucket's change count, opaque to clients) resumes
strictly after it. ``?cursor=`` replays the retained batches after it, ``?since=<ISO8601>`` those
uploaded since, no parameter none; then ``ready {"cursor"?}`` and live changes follow. A cursor
older than the replay buffer (or unknown) gets ``reset {"reason"}`` and the stream ends; shutting
the fake down ends open streams with ``reconnect {"cursor"}``. Tests can drop streams abruptly
(:meth:`FakeHub.drop_event_streams`) and hold new ones (:attr:`FakeHub.events_open`).

A request with a wrong token gets a 401 whose body *echoes the rejected token*: the real Hub does
not, but it lets tests check that the store never repeats a token that came back in an error.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

FAKE_TOKEN = "hf_fake_loopback_token"
"""The one token the fake accepts (sent as ``Authorization: Bearer ...``)."""
DEFAULT_BUCKET = "deltasync/test"
"""Bucket that exists from the start; :meth:`FakeHub.store_url` points into it."""
EMPTY_XET_HASH = "0" * 64
"""hf_xet's hash of an empty file: nothing is stored in the CAS for it."""
REPLAY_BATCHES = 1000
"""Change batches a bucket keeps for feeds resuming from a cursor (older cursors get ``reset``)."""
PING_S = 30.0
"""Keep-alive interval of idle event streams, as the Hub's (about 30 s)."""

Answer = tuple[int, Any, dict[str, str]]
"""What a handler returns: HTTP status, JSON body (``None`` for none) and extra headers."""

_BUCKET = r"(?P<bucket>[^/]+/[^/]+)"
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    (method, re.compile(pattern), handler)
    for method, pattern, handler in [
        ("POST", rf"/api/buckets/{_BUCKET}", "create"),
        ("GET", rf"/api/buckets/{_BUCKET}", "info"),
        ("GET", rf"/api/buckets/{_BUCKET}/xet-(?P<kind>read|write)-token", "xet_token"),
        ("POST", rf"/api/buckets/{_BUCKET}/batch", "batch"),
        ("POST", rf"/api/buckets/{_BUCKET}/paths-info", "paths_info"),
        ("GET", rf"/api/buckets/{_BUCKET}/tree(?:/(?P<prefix>.*))?", "tree"),
        ("HEAD", rf"/buckets/{_BUCKET}/resolve/(?P<path>.+)", "resolve"),
        ("GET", rf"/api/buckets/{_BUCKET}/events", "events"),
    ]
]


class HubError(Exception):
    """An HTTP error answer: status, the Hub's ``X-Error-Code``, a message, and body-only detail."""

    def __init__(self, status: int, code: str | None, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.detail = status, code, message, detail


class FakeHub:
    """State of the fake Hub: buckets of file entries, plus the local CAS they point into."""

    def __init__(self, root: Path) -> None:
        self.cas_dir = root / "cas"
        self.endpoint = ""
        self.buckets: dict[str, dict[str, dict[str, Any]]] = {DEFAULT_BUCKET: {}}
        self.created: dict[str, str] = {DEFAULT_BUCKET: _iso(time.time())}
        self.calls: list[str] = []
        """``"METHOD /path"`` of every request, in arrival order."""
        self.lock = threading.Lock()
        self._xet: Any = None
        # The change feed: per bucket, the retained batches (cursor, time, changes) and the last cursor.
        self.changed = threading.Condition(self.lock)
        self.batches: dict[str, deque[tuple[int, float, list[dict[str, Any]]]]] = {}
        self.cursors: dict[str, int] = {}
        self.replay_batches = REPLAY_BATCHES
        self.ping_interval = PING_S
        self.event_requests: list[dict[str, str]] = []
        """Query parameters of every events request, in arrival order."""
        self.events_open = threading.Event()
        """Cleared, new event streams wait before answering (as if the Hub were unreachable)."""
        self.events_open.set()
        self.streams = 0
        """Event streams being served right now."""
        self._drops = 0
        self._closing = False

    def store_url(self, prefix: str, bucket: str = DEFAULT_BUCKET) -> str:
        """``hf://buckets/<ns>/<name>/<prefix>`` for ``open_store``."""
        return f"hf://buckets/{bucket}/{prefix}"

    def store_options(self) -> dict[str, Any]:
        """Options that point the real client at this server."""
        return {"endpoint": self.endpoint, "token": FAKE_TOKEN}

    # -- handlers, one per route ----------------------------------------------------------------

    def create(self, bucket: str, body: bytes, query: dict[str, str]) -> Answer:
        answer = {"url": f"{self.endpoint}/buckets/{bucket}", "id": bucket}
        with self.lock:
            if bucket in self.buckets:  # create_bucket(exist_ok=True) reads "url" from this 409
                return 409, {**answer, "error": "You already created this bucket"}, {}
            self.buckets[bucket], self.created[bucket] = {}, _iso(time.time())
        return 200, answer, {}

    def info(self, bucket: str, body: bytes, query: dict[str, str]) -> Answer:
        files = self._files(bucket)
        size = sum(entry["size"] for entry in files.values())
        info = {"id": bucket, "private": True, "createdAt": self.created[bucket], "size": size}
        with self.lock:  # huggingface_hub's follower resumes a feed from updatedAt (?since=) after a reset
            batches = self.batches.get(bucket)
            info["updatedAt"] = _iso(batches[-1][1]) if batches else self.created[bucket]
        return 200, {**info, "totalFiles": len(files)}, {}

    def xet_token(self, bucket: str, kind: str, body: bytes, query: dict[str, str]) -> Answer:
        self._files(bucket)
        cas_url, exp = f"local://{self.cas_dir}", int(time.time()) + 3600
        headers = {"X-Xet-Cas-Url": cas_url, "X-Xet-Access-Token": f"xet-{kind}", "X-Xet-Token-Expiration": str(exp)}
        return 200, {"accessToken": f"xet-{kind}", "exp": exp, "casUrl": cas_url}, headers

    def batch(self, bucket: str, body: bytes, query: dict[str, str]) -> Answer:
        files = self._files(bucket)
        ops = [json.loads(line) for line in body.splitlines() if line.strip()]
        failed, changes = [], []
        for op in ops:
            if op["type"] == "addFile":
                size = self.size_in_cas(op["xetHash"])
                if size is None:
                    failed.append({"path": op["path"], "error": f"xet hash {op['xetHash']} not found"})
                    continue
                entry = {"type": "file", "path": op["path"], "size": size, "xetHash": op["xetHash"]}
                entry.update(mtime=_iso(op["mtime"] / 1000), uploadedAt=_iso(time.time()))
                with self.lock:
                    kind = "update" if op["path"] in files else "add"
                    files[op["path"]] = entry
                changes.append({"path": op["path"], "op": kind, **{k: entry[k] for k in _CHANGE_FIELDS}})
            elif op["type"] == "deleteFile":
                with self.lock:
                    if files.pop(op["path"], None) is not None:  # like S3: deleting a missing path succeeds
                        changes.append({"path": op["path"], "op": "delete"})
            else:
                failed.append({"path": op.get("path", ""), "error": f"unsupported operation {op['type']!r}"})
        if changes:
            self._publish(bucket, changes)
        status = 422 if ops and len(failed) == len(ops) else 200
        return status, {"success": not failed, "failed": failed}, {}

    def paths_info(self, bucket: str, body: bytes, query: dict[str, str]) -> Answer:
        files = self._files(bucket)
        with self.lock:
            found = [files[path] for path in json.loads(body)["paths"] if path in files]
        return 200, found, {}

    def tree(self, bucket: str, prefix: str | None, body: bytes, query: dict[str, str]) -> Answer:
        files, prefix = self._files(bucket), prefix or ""
        with self.lock:
            entries = sorted((entry for path, entry in files.items() if path.startswith(prefix)), key=_path)
        if query.get("recursive", "false").lower() != "true":  # direct children, folders collapsed
            depth = prefix.count("/")
            folders = {e["path"].split("/")[depth] for e in entries if e["path"].count("/") > depth}
            base = prefix.rpartition("/")[0]
            entries = [e for e in entries if e["path"].count("/") == depth] + [
                {"type": "directory", "path": f"{base}/{name}" if base else name} for name in sorted(folders)
            ]
        return 200, entries, {}

    def resolve(self, bucket: str, path: str, body: bytes, query: dict[str, str]) -> Answer:
        with self.lock:
            entry = self._files(bucket).get(path)
        if entry is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist in bucket {bucket}")
        refresh = f"{self.endpoint}/api/buckets/{bucket}/xet-read-token"
        headers = {"X-Xet-Hash": entry["xetHash"], "X-Linked-Size": str(entry["size"])}
        return 200, None, {**headers, "Link": f'<{refresh}>; rel="xet-auth"', "Content-Length": str(entry["size"])}

    def events(self, bucket: str, body: bytes, query: dict[str, str]) -> Answer:
        self._files(bucket)
        self.event_requests.append(dict(query))
        cursor, since = query.get("cursor"), query.get("since")
        if cursor is not None and not cursor.isdigit():
            raise HubError(400, None, f"invalid cursor {cursor!r}")
        try:
            start = datetime.fromisoformat(since).timestamp() if since else None
        except ValueError:
            raise HubError(400, None, f"invalid since {since!r}") from None
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        return 200, self._follow(bucket, None if cursor is None else int(cursor), start), headers

    # -- the change feed ------------------------------------------------------------------------

    def drop_event_streams(self) -> None:
        """Cut every open event stream without a word, as a crashed pod would (no ``reconnect``)."""
        with self.changed:
            self._drops += 1
            self.changed.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """End open event streams with ``reconnect`` (as a Hub pod rotating) and wait for them."""
        with self.changed:
            self._closing = True
            self.events_open.set()
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.streams == 0, timeout)

    def _publish(self, bucket: str, changes: list[dict[str, Any]]) -> None:
        with self.changed:
            cursor = self.cursors[bucket] = self.cursors.get(bucket, 0) + 1
            batches = self.batches.setdefault(bucket, deque())
            batches.append((cursor, time.time(), changes))
            while len(batches) > self.replay_batches:
                batches.popleft()
            self.changed.notify_all()

    def _follow(self, bucket: str, cursor: int | None, since: float | None) -> Iterator[bytes | None]:
        """The SSE byte blocks of one stream; ``None`` asks the handler to drop the connection."""
        self.events_open.wait()
        with self.changed:
            self.streams += 1
            drops, last = self._drops, self.cursors.get(bucket, 0)
            batches = list(self.batches.get(bucket, ()))
        try:
            oldest = batches[0][0] if batches else last + 1  # the oldest batch still replayable
            if cursor is not None:
                after = cursor
                if not oldest - 1 <= after <= last:
                    yield _sse("reset", {"reason": f"cursor {after} is outside the replay buffer"})
                    return
            elif since is not None:
                if oldest > 1 and (not batches or since < batches[0][1]):
                    yield _sse("reset", {"reason": "since is older than the replay buffer"})
                    return
                after = next((c - 1 for c, at, _ in batches if at >= since), last)
            else:
                after = last
            for number, _, changes in batches:
                if number > after:
                    yield _sse("changes", {"cursor": str(number), "changes": changes})
            yield _sse("ready", {"cursor": str(last)} if last else {})
            while True:
                with self.changed:
                    self.changed.wait_for(
                        lambda: self.cursors.get(bucket, 0) > last or self._closing or self._drops != drops,
                        self.ping_interval,
                    )
                    fresh = [b for b in self.batches.get(bucket, ()) if b[0] > last]
                    closing, dropped = self._closing, self._drops != drops
                if dropped:
                    yield None
                    return
                for number, _, changes in fresh:
                    yield _sse("changes", {"cursor": str(number), "changes": changes})
                    last = number
                if closing:
                    yield _sse("reconnect", {"cursor": str(last)} if last else {})
                    return
                if not fresh:
                    yield b": ping\n\n"
        finally:
            with self.changed:
                self.streams -= 1
                self.changed.notify_all()

    # -- helpers --------------------------------------------------------------------------------

    def _files(self, bucket: str) -> dict[str, dict[str, Any]]:
        files = self.buckets.get(bucket)
        if files is None:
            raise HubError(404, "RepoNotFound", f"Bucket {bucket} not found")
        return files

    def size_in_cas(self, xet_hash: str) -> int | None:
        """Size of the file ``xet_hash`` names, reconstructed from the local CAS; ``None`` if absent."""
        if xet_hash == EMPTY_XET_HASH:
            return 0
        import hf_xet  # type: ignore[import-untyped]

        if self._xet is None:
            self._xet = hf_xet.XetSession()
        group = self._xet.new_download_stream_group(
            endpoint=f"local://{self.cas_dir}", token="fake", token_expiry_unix_secs=int(time.time()) + 3600
        )
        # A hash the CAS lacks streams zero bytes rather than failing, hence "0 means absent".
        size = sum(len(chunk) for chunk in group.download_stream(hf_xet.XetFileInfo(xet_hash)))
        return size or None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx pools connections
    hub: FakeHub

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.hub.calls.append(f"{method} {url.path}")
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        try:
            given = self.headers.get("Authorization", "").removeprefix("Bearer ")
            if given != FAKE_TOKEN:  # the echo goes in the body only: httpx logs headers at DEBUG
                raise HubError(401, None, "Invalid credentials", f"Invalid credentials: token {given!r} is not valid")
            for route_method, pattern, name in _ROUTES:
                match = pattern.fullmatch(url.path)
                if route_method == method and match:
                    args = {key: unquote(value) if value else value for key, value in match.groupdict().items()}
                    status, payload, headers = getattr(self.hub, name)(**args, body=body, query=query)
                    break
            else:
                raise HubError(404, None, f"no route for {method} {url.path}")
        except HubError as exc:
            status, payload = exc.status, {"error": exc.detail or exc.message}
            headers = {"X-Error-Message": exc.message}
            if exc.code:
                headers["X-Error-Code"] = exc.code
        self._answer(method, status, payload, headers)

    def _answer(self, method: str, status: int, payload: Any, headers: dict[str, str]) -> None:
        if isinstance(payload, Iterator):
            self._stream(payload, headers)
            return
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        headers.setdefault("Content-Length", str(len(data)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)

    def _stream(self, blocks: Iterator[bytes | None], headers: dict[str, str]) -> None:
        """Send server-sent events as they come, chunked; ``None`` drops the connection mid-stream."""
        self.send_response(200)
        for key, value in {**headers, "Transfer-Encoding": "chunked"}.items():
            self.send_header(key, value)
        self.end_headers()
        try:
            for block in blocks:
                if block is None:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            self.close_connection = True
        finally:
            close = getattr(blocks, "close", None)
            if close is not None:
                close()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # requests are recorded in FakeHub.calls instead of spamming stderr


@contextlib.contextmanager
def serve() -> Iterator[FakeHub]:
    """Run a fake Hub on 127.0.0.1 (a free port) in a thread; stop it and delete its CAS on exit.

    Nothing process-wide is changed: the endpoint and token reach the client through
    :meth:`FakeHub.store_options`, not through ``HF_ENDPOINT`` / ``HF_TOKEN``.
    """
    with tempfile.TemporaryDirectory(prefix="fake-hf-hub-") as tmp:
        hub = FakeHub(Path(tmp))
        handler = type("Handler", (_Handler,), {"hub": hub})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        thread = threading.Thread(target=server.serve_forever, name="fake-hf-hub", daemon=True)
        thread.start()
        try:
            yield hub
        finally:
            hub.close()  # open event streams end first, so no handler thread outlives the server
            server.shutdown()
            server.server_close()
            thread.join()


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _path(entry: dict[str, Any]) -> str:
    return str(entry["path"])


_CHANGE_FIELDS = ("size", "xetHash", "uploadedAt", "mtime")


def _sse(event: str, data: dict[str, Any]) -> bytes:
    # huggingface_hub's SSE reader dispatches only events with a data line: an empty payload is "{}".
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
