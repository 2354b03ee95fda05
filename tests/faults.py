"""Fault injection for the reliability tests: a store wrapper and a wire-level S3 proxy.

:class:`FaultyStore` wraps any real backend (local directory, S3 against the
loopback moto server, memory) and injects, per operation and key prefix, what
deployments see: transient server errors, connection resets, timeouts, stalls,
truncated downloads, torn writes and writes whose answer is lost. Injected
errors are the :class:`~deltasync.errors.StoreError` the real backends raise
after their own retries (same class, ``backend`` and ``key``), with the text of
the real failure and ``(injected)`` appended, so code under test cannot tell
them apart by type. Every rule fails ``times`` matching calls (after letting
``after`` through) and then lets calls pass: "fail N times, then succeed".

The wrapper also taps the real backend (``errors``, ``error_seen``) and can
audit commits (``audit=True``): before a manifest write reaches the store, every
object the manifest names must already be there, whole, with the promised size
and SHA-256 (invariant 3).

:class:`FaultyProxy` sits on the wire in front of an HTTP object store and
answers 503, resets connections or delays answers for chosen requests, so the
S3 client's own retries are exercised too.
"""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from deltasync.errors import DeltaSyncError, StoreError
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest
from deltasync.stores import ObjectInfo, Store
from deltasync.stores.base import PutMode
from deltasync.stores.wrap import DelegatingStore

__all__ = ["Fault", "FaultyStore", "FaultyProxy", "KINDS", "OPS"]

OPS = ("put", "get", "get_range", "head", "list", "delete", "get_if_changed")
KINDS = ("5xx", "reset", "timeout", "stall", "truncate", "lost-ack")
STALL_LIMIT_S = 60.0  # liveness bound: a stall nobody releases fails the call instead of hanging the suite

# What each transient failure reads like once the backend gave up retrying: obstore's
# text for S3 (tests/test_store_s3.py shows the real thing), the errno text for files.
_DETAIL = {
    "s3": {
        "5xx": "GenericError: Generic S3 error: Server returned non-2xx status code: 503 Service Unavailable",
        "reset": "GenericError: Generic S3 error: HTTP error: error sending request: connection reset by peer",
        "timeout": "GenericError: Generic S3 error: HTTP error: operation timed out",
        "lost-ack": "GenericError: Generic S3 error: HTTP error: operation timed out",
    },
    "file": {
        "5xx": "[Errno 5] Input/output error",
        "reset": "[Errno 104] Connection reset by peer",
        "timeout": "[Errno 110] Connection timed out",
        "lost-ack": "[Errno 110] Connection timed out",
    },
}


@dataclass
class Fault:
    """One injection rule; its counters and events let tests wait on it (no sleeps)."""

    op: str
    """Store operation (one of :data:`OPS`, or ``"*"`` for all)."""
    prefix: str = ""
    """Keys starting with this (``list`` matches on its prefix argument)."""
    kind: str = "5xx"
    """One of :data:`KINDS`. ``truncate`` cuts what a read returns, or what a put stores (a torn
    write that still reports success); ``lost-ack`` lets a put reach the store, then raises."""
    times: int | None = 1
    """Matching calls that fail; ``None``: every matching call until :meth:`FaultyStore.clear`."""
    after: int = 0
    """Matching calls let through before the first failure."""
    keep: float = 0.5
    """``truncate``: fraction of the bytes kept."""
    seen: int = 0
    """Matching calls so far."""
    fired: int = 0
    """Failures injected so far."""
    entered: threading.Event = field(default_factory=threading.Event)
    """Set when the rule first fires (for a stall: when a call is blocked in it)."""
    release: threading.Event = field(default_factory=threading.Event)
    """``stall``: set to let blocked calls proceed."""
    stalled: int = 0
    """``stall``: calls blocked right now."""

    def __post_init__(self) -> None:
        if self.op not in (*OPS, "*") or self.kind not in KINDS:
            raise ValueError(f"unknown op {self.op!r} or kind {self.kind!r}; ops {OPS}, kinds {KINDS}")

    @property
    def exhausted(self) -> bool:
        """Whether the rule will fail no more calls."""
        return self.times is not None and self.fired >= self.times


class FaultyStore(DelegatingStore):
    """Delegates to ``inner``; fails, stalls, truncates or audits operations on request.

    Args:
        inner (`Store`): the real backend.
        audit (`bool`, *optional*): check every manifest write against the objects it names.

    The older knobs stay: ``fail_puts[prefix] = n`` fails the next ``n`` puts under
    ``prefix``; ``gate`` (a cleared Event) blocks every put until it is set;
    ``corrupt[prefix] = fn`` rewrites what ``get`` returns; ``puts`` lists written keys.
    """

    def __init__(self, inner: Store, *, audit: bool = False) -> None:
        super().__init__(inner)
        self.fail_puts: dict[str, int] = {}
        self.gate: threading.Event | None = None
        self.corrupt: dict[str, object] = {}
        self.puts: list[str] = []
        self.faults: list[Fault] = []
        self.errors: list[StoreError] = []
        """Errors the real backend raised (not injected ones)."""
        self.error_seen = threading.Event()
        """Set whenever the real backend raises a :class:`StoreError`."""
        self.audit = audit
        self.violations: list[str] = []
        """Manifest writes that named a missing or different object."""
        self.commits = 0
        """Manifest writes audited."""
        self.calls: list[tuple[str, str, str]] = []
        """``(op, key, thread name)`` of every call, to see who touches the store."""
        self._verified: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ rules

    def inject(
        self, op: str, prefix: str = "", *, kind: str = "5xx", times: int | None = 1, after: int = 0, keep: float = 0.5
    ) -> Fault:
        """Add a rule (see :class:`Fault`) and return it."""
        fault = Fault(op, prefix, kind, times, after, keep)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear(self) -> None:
        """Drop every rule and release every stall: the outage is over."""
        with self._lock:
            faults, self.faults = self.faults, []
        for fault in faults:
            fault.release.set()

    def _match(self, op: str, key: str) -> Fault | None:
        with self._lock:
            self.calls.append((op, key, threading.current_thread().name))
            for fault in self.faults:
                if fault.op not in (op, "*") or not key.startswith(fault.prefix) or fault.exhausted:
                    continue
                fault.seen += 1
                if fault.seen <= fault.after:
                    continue
                fault.fired += 1
                return fault
        return None

    def _before(self, op: str, key: str) -> Fault | None:
        """Raise or stall for a matching rule; return a rule that acts on the data instead."""
        fault = self._match(op, key)
        if fault is None:
            return None
        if fault.kind == "stall":
            with self._lock:
                fault.stalled += 1
            fault.entered.set()
            try:
                released = fault.release.wait(STALL_LIMIT_S)
            finally:
                with self._lock:
                    fault.stalled -= 1
            if not released:
                raise self._error("timeout", op, key)
            return None
        fault.entered.set()
        if fault.kind in ("truncate", "lost-ack"):
            return fault
        raise self._error(fault.kind, op, key)

    def _error(self, kind: str, op: str, key: str) -> StoreError:
        backend = self.inner.scheme
        detail = _DETAIL.get(backend, _DETAIL["file"])[kind]
        return StoreError(f"{op} {key!r} in {self.url} failed: {detail} (injected)", key=key, backend=backend)

    def _call(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except StoreError as exc:
            self.errors.append(exc)
            self.error_seen.set()
            raise

    # ------------------------------------------------------------------ operations

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        if self.gate is not None:
            self.gate.wait(30)
        for prefix, remaining in self.fail_puts.items():
            if key.startswith(prefix) and remaining > 0:
                self.fail_puts[prefix] = remaining - 1
                raise StoreError(f"injected failure writing {key}", key=key, backend="faulty")
        fault = self._before("put", key)
        if fault is not None and fault.kind == "truncate":
            data = data[: int(len(data) * fault.keep)]
        if self.audit and key == MANIFEST_KEY:
            self._audit(data)
        self.puts.append(key)
        info = self._call(lambda: self.inner.put(key, data, mode=mode, if_match=if_match))
        if fault is not None and fault.kind == "lost-ack":
            raise self._error("lost-ack", "put", key)  # written, but the writer never hears so
        return info

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        fault = self._before("get", key)
        data: bytes = self._call(lambda: self.inner.get(key, max_bytes=max_bytes))
        for prefix, fn in self.corrupt.items():
            if key.startswith(prefix):
                data = fn(data)  # type: ignore[operator]
        return _cut(data, fault)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        fault = self._before("get_range", key)
        return _cut(self._call(lambda: self.inner.get_range(key, start, end)), fault)

    def head(self, key: str) -> ObjectInfo:
        self._before("head", key)
        return self._call(lambda: self.inner.head(key))  # type: ignore[no-any-return]

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._before("list", prefix)
        try:
            yield from self.inner.list(prefix)
        except StoreError as exc:
            self.errors.append(exc)
            self.error_seen.set()
            raise

    def delete(self, key: str) -> None:
        self._before("delete", key)
        self._call(lambda: self.inner.delete(key))

    def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, ObjectInfo] | None:
        fault = self._before("get_if_changed", key)
        got = self._call(lambda: self.inner.get_if_changed(key, etag, max_bytes=max_bytes))
        if got is None or fault is None:
            return got  # type: ignore[no-any-return]
        return _cut(got[0], fault), got[1]

    # ------------------------------------------------------------------ audit

    def _audit(self, data: bytes) -> None:
        """Invariant 3: everything a manifest names is in the store, whole, before the manifest."""
        self.commits += 1
        try:
            manifest = Manifest.from_bytes(data)
        except DeltaSyncError as exc:
            self.violations.append(f"unreadable manifest written: {exc}")
            return
        for entry in manifest.versions:
            for ref in entry.objects():
                if ref.key in self._verified:
                    continue
                try:
                    body = self.inner.get(ref.key)
                except StoreError as exc:
                    self.violations.append(f"v{entry.version} names {ref.key}, which is not readable: {exc}")
                    continue
                if not ref.verify(body):
                    self.violations.append(f"v{entry.version} names {ref.key}, whose bytes differ")
                    continue
                self._verified.add(ref.key)


def _cut(data: bytes, fault: Fault | None) -> bytes:
    if fault is None or fault.kind != "truncate":
        return data
    return data[: int(len(data) * fault.keep)]


# ---------------------------------------------------------------------- wire level


@dataclass
class WireFault:
    """One rule of :class:`FaultyProxy`."""

    method: str
    """HTTP method (``"*"``: any)."""
    contains: str
    """Substring of the request path (``""``: any)."""
    kind: str
    """``"503"``, ``"reset"`` (close without answering) or ``"delay"`` (answer after ``delay`` seconds)."""
    times: int = 1
    delay: float = 0.0
    fired: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    """Set once a faulted request was fully handled (a delayed one forwarded upstream too)."""


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _handle(self) -> None:
        proxy: FaultyProxy = self.server.proxy  # type: ignore[attr-defined]
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        rule = proxy._take(self.command, self.path)
        if rule is not None and rule.kind == "503":
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            rule.done.set()
            return
        if rule is not None and rule.kind == "reset":
            self.close_connection = True
            self.connection.close()
            rule.done.set()
            return
        if rule is not None and rule.kind == "delay":
            proxy._wake.wait(rule.delay)  # set only at shutdown: a stall that ends with the proxy
        try:
            status, headers, payload = proxy._forward(self.command, self.path, dict(self.headers), body)
        finally:
            if rule is not None:
                rule.done.set()
        try:
            self.send_response(status)
            for name, value in headers:
                if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
        except OSError:  # the client gave up waiting (a delayed answer): nobody to answer
            self.close_connection = True

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _handle

    def log_message(self, format: str, *args: Any) -> None:
        pass


class FaultyProxy:
    """A loopback HTTP proxy in front of ``upstream`` (``host:port``) that injects wire faults.

    Requests are forwarded unchanged (the ``Host`` header too, so SigV4 signatures made
    for the proxy's address reach moto intact). Use as a context manager.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.rules: list[WireFault] = []
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ProxyHandler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def inject(
        self, method: str, contains: str = "", *, kind: str = "503", times: int = 1, delay: float = 0.0
    ) -> WireFault:
        rule = WireFault(method, contains, kind, times, delay)
        with self._lock:
            self.rules.append(rule)
        return rule

    def _take(self, method: str, path: str) -> WireFault | None:
        with self._lock:
            self.requests.append((method, path))
            for rule in self.rules:
                if rule.fired < rule.times and rule.method in (method, "*") and rule.contains in path:
                    rule.fired += 1
                    return rule
        return None

    def _forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, list, bytes]:
        host, _, port = self.upstream.partition(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            response = conn.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            conn.close()

    def __enter__(self) -> FaultyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._wake.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
