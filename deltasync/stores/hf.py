"""Hugging Face Storage Buckets (``hf://buckets/<namespace>/<name>/<prefix>``), through huggingface_hub.

Objects are bucket files under the URL's prefix, written and read with huggingface_hub's native
bucket API (``batch_bucket_files``, ``download_bucket_files``, ``get_bucket_paths_info``,
``list_bucket_tree``, ``get_bucket_file_metadata``); bytes travel through Xet storage (hf_xet), so
unchanged chunks of a re-uploaded object are deduplicated. Install with
``pip install 'deltasync[hf]'``.

Limitations:

- **No atomic conditional writes.** HF buckets are not transactional and always allow overwrite.
  ``put(mode="create")`` and ``put(if_match=...)`` check the current state first and then write:
  best-effort, not atomic, so two writers can both pass the check. ``conditional_writes`` is
  ``False``, and callers that need exclusive ownership of a run prefix must take a lease. The HF
  S3 gateway (``https://s3.hf.co``) honours ``If-None-Match`` / ``If-Match``; use the ``s3`` backend
  against it when atomic writes matter.
- **The etag is the file's xet hash**, a content hash: writing the same bytes again keeps the etag.
  That is exactly "unchanged" for ``get_if_changed`` and ``if_match`` (an ABA write of identical
  bytes is indistinguishable, and harmless).
- **``put`` returns what a follow-up lookup sees**: the batch API does not return the new hash,
  so ``put`` reads the entry back; a concurrent writer's entry could be reported instead.
- **Change feed: HTTP/1.1 streams, one per follower.** :meth:`HFBucketStore.change_feed` follows
  ``GET /api/buckets/{id}/events`` (server-sent, resumable by cursor), so subscribers wake on a
  change instead of at their next poll. It reads events with huggingface_hub's own parser, a
  private module (see :func:`_live_follow_reader`); without it, or where the Hub does not serve the
  feed for this bucket and token, the store returns no feed and subscribers poll. Closing a feed
  shuts its stream's socket down so the thread ends at once (with an HTTP/2 client this would end
  the shared connection; huggingface_hub's default client speaks HTTP/1.1).
- huggingface_hub prints upload progress bars unless ``HF_HUB_DISABLE_PROGRESS_BARS=1`` is set.

Reads never go through a local cache that could be stale: ``get`` downloads into a fresh temporary
directory, and ``get_range`` streams just the requested range through hf_xet (falling back to
download-and-slice with an hf_xet that cannot stream ranges). Xet's chunk cache is keyed by content
hash, so it cannot serve old bytes for a new hash either.

Transient HTTP failures (429, 5xx, timeouts, dropped connections) are retried by huggingface_hub's
own ``http_backoff`` on the calls that use it (batch, paths-info, metadata ``HEAD``, tree pages);
hf_xet retries its CAS transfers itself. What still fails becomes a :class:`StoreError`.

Tokens never appear in ``repr``, log lines or error messages raised here: error texts are scrubbed,
and a client error that quotes the token is not chained.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..errors import (
    DeltaSyncError,
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
    require,
)
from .base import ChangeFeed, ObjectInfo, PutMode, Store, check_key

__all__ = ["HFBucketStore", "parse_bucket_url"]

logger = logging.getLogger("deltasync.stores.hf")

T = TypeVar("T")

# Change feed pacing, after huggingface_hub's own follower (_bucket_live_follow, 2.4): the Hub pings
# idle streams about every 30 s, so 90 s of silence means a dead stream.
FEED_CONNECT_TIMEOUT_S = 10.0
FEED_READ_TIMEOUT_S = 90.0
FEED_RECONNECT_S = 1.0  # pause before reopening a stream that ended normally
FEED_RETRY_BASE_S = 2.0  # then capped exponential backoff while the Hub fails
FEED_RETRY_MAX_S = 60.0
FEED_GIVE_UP_AFTER = 3  # consecutive streams ending before `ready`: the feed is not really served
FEED_MAX_TRACKED = 10_000  # changed keys remembered; past that every key reads as changed once
FEED_CLOSE_JOIN_S = 5.0
_FEED_UNAVAILABLE = (401, 403, 404, 501)  # not served here, or not for this token: poll instead

_SCHEME = "hf://buckets/"
# Hub names: letters, digits, "-", "_", "." (not first or last), at most 96 characters.
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
_URL_HELP = "expected hf://buckets/<namespace>/<name>[/<prefix>], e.g. hf://buckets/my-org/rl-weights/run-1"


def parse_bucket_url(url: str) -> tuple[str, str]:
    """Split an ``hf://buckets/`` URL into bucket id and prefix.

    Args:
        url (`str`): ``hf://buckets/<namespace>/<name>`` with an optional ``/<prefix>``.

    Returns:
        `tuple[str, str]`: the bucket id (``"namespace/name"``) and the prefix (``""`` for the
        bucket root, without leading or trailing ``/``).

    Raises:
        `ValueError`: not a bucket URL, a bad namespace or name, or an unsafe prefix.

    Example:
        ```python
        >>> parse_bucket_url("hf://buckets/my-org/rl-weights/runs/1")
        ('my-org/rl-weights', 'runs/1')
        ```
    """
    if not isinstance(url, str) or not url.startswith(_SCHEME):
        repo = isinstance(url, str) and url.startswith("hf://")
        hint = " (model, dataset and space repos are not stores)" if repo else ""
        raise ValueError(f"not an HF bucket URL: {url!r}{hint}; {_URL_HELP}")
    namespace, _, rest = url[len(_SCHEME) :].partition("/")
    name, _, prefix = rest.partition("/")
    for what, value in (("namespace", namespace), ("bucket name", name)):
        if not _NAME.match(value):
            raise ValueError(f"invalid {what} {value!r} in {url!r}; {_URL_HELP}")
    prefix = prefix.rstrip("/")
    if prefix:
        try:
            check_key(prefix)
        except DeltaSyncError:
            raise ValueError(
                f"invalid prefix {prefix!r} in {url!r}: use '/'-separated segments of [A-Za-z0-9._=+@,-]; {_URL_HELP}"
            ) from None
    return f"{namespace}/{name}", prefix


class HFBucketStore(Store):
    """Objects as files of a Hugging Face bucket, under an optional prefix.

    Args:
        bucket_id (`str`): ``"namespace/name"``.
        prefix (`str`, *optional*, defaults to ``""``): folder inside the bucket holding the keys.
        token (`str`, *optional*): an HF access token; defaults to ``HF_TOKEN`` or the saved login.
        endpoint (`str`, *optional*): the Hub URL; defaults to ``HF_ENDPOINT``, else huggingface.co.
        create (`bool`, *optional*, defaults to `False`): create the bucket (private) if missing.

    Raises:
        `MissingDependency`: huggingface_hub is not installed.
        `StoreError`: ``create=True`` and the bucket could not be created.

    Example:
        ```python
        >>> store = open_store("hf://buckets/my-org/rl-weights/run-1", create=True)
        >>> store.put("manifest.json", b"{}")
        ```
    """

    scheme = "hf"
    conditional_writes = False

    def __init__(
        self,
        bucket_id: str,
        prefix: str = "",
        *,
        token: str | None = None,
        endpoint: str | None = None,
        create: bool = False,
    ) -> None:
        hub = require("huggingface_hub", "hf")
        if bucket_id.count("/") != 1:
            raise ValueError(f"bucket_id must be 'namespace/name', not {bucket_id!r}; {_URL_HELP}")
        self.bucket_id, self.prefix = parse_bucket_url(f"{_SCHEME}{bucket_id}/{prefix}")
        super().__init__(f"{_SCHEME}{self.bucket_id}" + (f"/{self.prefix}" if self.prefix else ""))
        constants = require("huggingface_hub.constants", "hf")
        self.endpoint: str = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        # Resolve the token once, so error texts can be scrubbed of it whatever its source.
        self._token: str | None = token or hub.get_token()
        self._api: Any = hub.HfApi(endpoint=self.endpoint, token=self._token, library_name="deltasync")
        self._errors: Any = require("huggingface_hub.errors", "hf")
        self._build_headers: Callable[..., dict[str, str]] = require("huggingface_hub.utils", "hf").build_hf_headers
        self._xet: Any = None
        self._xet_pid = -1
        self._feeds: list[_BucketFeed] = []
        if create:
            self._call(lambda: self._api.create_bucket(self.bucket_id, private=True, exist_ok=True), "creating bucket")

    @classmethod
    def from_url(
        cls, url: str, *, token: str | None = None, endpoint: str | None = None, create: bool = False
    ) -> HFBucketStore:
        """``hf://buckets/<namespace>/<name>[/<prefix>]``; options as for the constructor.

        Raises:
            `ValueError`: the URL is not a valid bucket URL (the message shows the expected form).
        """
        bucket_id, prefix = parse_bucket_url(url)
        return cls(bucket_id, prefix, token=token, endpoint=endpoint, create=create)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, endpoint={self.endpoint!r})"

    # -- the Store protocol -------------------------------------------------------------------

    def put(self, key: str, data: bytes, *, mode: PutMode = "overwrite", if_match: str | None = None) -> ObjectInfo:
        """Upload ``data`` to ``key`` with ``batch_bucket_files``.

        ``mode="create"`` and ``if_match`` are checked by a lookup just before the upload:
        best-effort, not atomic (see the module docstring); take a lease when writers may race.

        Raises:
            `PreconditionFailed`: the key exists (``mode="create"``) or its xet hash differs from
            ``if_match``. `StoreError`: the upload failed.
        """
        path = self._path(key)
        if mode not in ("overwrite", "create"):
            raise ValueError(f"mode must be 'overwrite' or 'create', not {mode!r}")
        if mode == "create" or if_match is not None:
            current = self._lookup(key, path)
            if mode == "create" and current is not None:
                raise PreconditionFailed(
                    f"{key!r} already exists in {self.url} (best-effort check: HF buckets have no atomic create)",
                    key=key,
                    backend="hf",
                )
            if if_match is not None and (current is None or current.xet_hash != if_match):
                found = "missing" if current is None else current.xet_hash
                raise PreconditionFailed(
                    f"{key!r} in {self.url} changed since it was read (xet hash {found} != {if_match})",
                    key=key,
                    backend="hf",
                )
        payload = data if isinstance(data, bytes) else bytes(data)  # other buffers would be taken as paths
        self._call(lambda: self._api.batch_bucket_files(self.bucket_id, add=[(payload, path)]), "writing", key)
        written = self._lookup(key, path)
        if written is None:
            raise StoreError(f"{key!r} is missing from {self.url} right after writing it", key=key, backend="hf")
        return self._info(key, written)

    def get(self, key: str) -> bytes:
        """Download ``key`` with ``download_bucket_files`` into a fresh temporary directory.

        A new directory per read means no local cache can serve stale bytes after an overwrite.
        """
        found = self._require(key, self._path(key))
        return self._download(key, found)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Read bytes ``[start, end)`` with a ranged Xet download (only the covering chunks move).

        The file's xet hash, size and token route come from one metadata ``HEAD``; ``end`` past the
        end of the object is clamped, as for a slice. With an hf_xet too old for ranged streams
        this downloads the whole object and slices it.

        Raises:
            `ValueError`: ``start`` is negative or ``end < start``.
        """
        if start < 0 or end < start:
            raise ValueError(f"bad byte range [{start}, {end}) for {key!r}: need 0 <= start <= end")
        path = self._path(key)
        meta = self._call(lambda: self._api.get_bucket_file_metadata(self.bucket_id, path), "reading", key)
        end = min(end, meta.size)
        if start >= end:
            return b""
        xet = self._xet_session()
        if not hasattr(xet, "new_download_stream_group"):
            return self.get(key)[start:end]

        def read() -> bytes:
            group = xet.new_download_stream_group(
                token_refresh_url=meta.xet_file_data.refresh_route,
                token_refresh_headers=self._headers(auth=True),
                custom_headers=self._headers(auth=False),
            )
            info = self._hf_xet.XetFileInfo(meta.xet_file_data.file_hash, meta.size)
            return b"".join(group.download_stream(info, start=start, end=end))

        data = self._call(read, "reading", key)
        if len(data) != end - start:  # a hash missing from storage streams nothing rather than failing
            raise StoreError(
                f"short read of {key!r} in {self.url}: {len(data)} of {end - start} bytes", key=key, backend="hf"
            )
        return data

    def head(self, key: str) -> ObjectInfo:
        """Size, xet hash (as etag) and upload time, from ``get_bucket_paths_info``."""
        return self._info(key, self._require(key, self._path(key)))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix``, sorted by key (one recursive tree listing).

        The Hub matches the tree prefix lexically; the store root always ends in ``/`` there, so
        a sibling prefix (``run-1`` vs ``run-10``) never leaks in.
        """
        root = f"{self.prefix}/" if self.prefix else ""
        full = root + prefix

        def listing() -> list[Any]:
            items = self._api.list_bucket_tree(self.bucket_id, prefix=full or None, recursive=True)
            return [item for item in items if item.type == "file" and item.path.startswith(full)]

        try:
            files = self._call(listing, "listing", prefix or None)
        except ObjectNotFound:  # a server answering 404 for an empty folder
            return
        for item in sorted(files, key=lambda item: str(item.path)):
            yield self._info(item.path[len(root) :], item)

    def delete(self, key: str) -> None:
        """Delete ``key`` with a batch delete; deleting a missing key is not an error."""
        path = self._path(key)

        def remove() -> None:
            try:
                self._api.batch_bucket_files(self.bucket_id, delete=[path])
            except self._errors.BucketBatchError:
                if self._lookup(key, path) is not None:  # a server refusing to delete what is absent is fine
                    raise

        self._call(remove, "deleting", key)

    def get_if_changed(self, key: str, etag: str | None) -> tuple[bytes, ObjectInfo] | None:
        """One lookup, then a download only if the xet hash differs from ``etag``.

        The returned info describes exactly the returned bytes (same lookup).
        """
        found = self._require(key, self._path(key))
        if etag is not None and found.xet_hash == etag:
            return None
        return self._download(key, found), self._info(key, found)

    def change_feed(self) -> ChangeFeed | None:
        """Follow the bucket's server-sent change feed (``GET /api/buckets/{id}/events``).

        Blocks until the stream is live (at most ``FEED_CONNECT_TIMEOUT_S``), so no change made after
        this returns is missed. The feed then reconnects by itself, resuming from its cursor, until
        closed; :meth:`close` closes the feeds still open.

        Returns:
            `ChangeFeed` or `None`: ``None`` (callers poll) when this huggingface_hub cannot read the
            feed, or the Hub does not serve it for this bucket and token (401, 403, 404, 501, or an
            answer that is not an event stream).
        """
        read = _live_follow_reader()
        if read is None:
            logger.info("this huggingface_hub cannot follow bucket changes: %s is polled", self.url)
            return None
        feed = _BucketFeed(self, read)
        if not feed.start():
            feed.close()
            return None
        self._feeds = [f for f in self._feeds if not f.closed] + [feed]
        return feed

    def close(self) -> None:
        for feed in self._feeds:
            feed.close()
        self._feeds.clear()
        self._xet = None

    # -- helpers ------------------------------------------------------------------------------

    def _path(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _lookup(self, key: str, path: str) -> Any | None:
        """The ``BucketFile`` at ``path``, or ``None``."""
        found = self._call(lambda: list(self._api.get_bucket_paths_info(self.bucket_id, [path])), "looking up", key)
        return next((item for item in found if item.path == path), None)

    def _require(self, key: str, path: str) -> Any:
        found = self._lookup(key, path)
        if found is None:
            raise ObjectNotFound(f"no object {key!r} in {self.url}", key=key, backend="hf")
        return found

    def _download(self, key: str, found: Any) -> bytes:
        with tempfile.TemporaryDirectory(prefix="deltasync-hf-") as tmp:
            target = Path(tmp, "object")
            self._call(lambda: self._api.download_bucket_files(self.bucket_id, [(found, target)]), "reading", key)
            data = target.read_bytes()
        if len(data) != found.size:
            raise StoreError(
                f"short read of {key!r} in {self.url}: {len(data)} of {found.size} bytes", key=key, backend="hf"
            )
        return data

    def _info(self, key: str, found: Any) -> ObjectInfo:
        when = found.uploaded_at or found.mtime
        return ObjectInfo(key, int(found.size), found.xet_hash, when.timestamp() if when else None)

    def _headers(self, *, auth: bool) -> dict[str, str]:
        headers = self._build_headers(token=self._token, library_name="deltasync")
        return headers if auth else {k: v for k, v in headers.items() if k.lower() != "authorization"}

    @property
    def _hf_xet(self) -> Any:
        return require("hf_xet", "hf")

    def _xet_session(self) -> Any:
        # One session per process: a session inherited through fork() must not be reused.
        if self._xet is None or self._xet_pid != os.getpid():
            self._xet, self._xet_pid = self._hf_xet.XetSession(), os.getpid()
        return self._xet

    def _call(self, fn: Callable[[], T], what: str, key: str | None = None) -> T:
        """Run a client call, translating its errors into ours without leaking the token."""
        try:
            return fn()
        except DeltaSyncError:
            raise
        except Exception as exc:
            error = self._translate(exc, what, key)
            if self._mentions_token(exc):
                raise error from None
            raise error from exc

    def _translate(self, exc: Exception, what: str, key: str | None) -> StoreError:
        errors = self._errors
        target = f"{key!r} in {self.url}" if key is not None else self.url
        if isinstance(exc, errors.BucketNotFoundError):
            return StoreError(
                f"bucket {self.bucket_id!r} not found at {self.endpoint} (or no access): create it, "
                "or open the store with create=True",
                key=key,
                backend="hf",
            )
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, errors.EntryNotFoundError) or status == 404:
            return ObjectNotFound(f"no object {target}", key=key, backend="hf")
        lines = str(exc).strip().splitlines()
        server: str = getattr(exc, "server_message", None) or ""  # HfHubHTTPError: the Hub's own words
        detail = self._scrub("; ".join([lines[0] if lines else type(exc).__name__, *server.splitlines()]))
        return StoreError(f"{what} {target} failed: {detail}", key=key, backend="hf", status=status)

    def _scrub(self, text: str) -> str:
        return text.replace(self._token, "<token>") if self._token else text

    def _mentions_token(self, exc: BaseException | None) -> bool:
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen and self._token:
            seen.add(id(exc))
            if self._token in str(exc) or self._token in repr(exc.args):
                return True
            exc = exc.__cause__ or exc.__context__
        return False


# -- the change feed ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _FeedEvent:
    """One event of a bucket's change feed, reduced to what the store needs."""

    kind: str
    """``"ready"``, ``"changes"``, ``"reset"`` or ``"reconnect"``."""
    cursor: str | None
    """Resume point strictly after this event, where it carries one."""
    paths: tuple[str, ...] = ()
    """Bucket paths a ``changes`` event touched."""


def _live_follow_reader() -> Callable[[Any], Iterator[_FeedEvent]] | None:
    """A reader of a feed response's events built on huggingface_hub's own parser, or ``None``.

    The one use of a private huggingface_hub module in this store: ``_bucket_live_follow`` (since
    2.3; its public face, ``HfFileSystem(live_follow=True)``, refreshes listings and calls nobody),
    checked against huggingface_hub 2.4.0. Its ``parse_follow_event`` interprets the payloads; its
    ``BucketFollower`` thread is not used because its stream cannot be interrupted, so closing would
    wait for the Hub's next ping (~30 s). SSE framing is httpx2's public ``EventSource`` (the HTTP
    client of huggingface_hub 2.x). A missing module or name returns ``None``: callers then poll.
    """
    try:
        import httpx2
        from huggingface_hub import _bucket_live_follow as live

        parse, event_source = live.parse_follow_event, httpx2.EventSource
        kinds = {live._Ready: "ready", live._Changes: "changes", live._Reset: "reset", live._Reconnect: "reconnect"}
    except (ImportError, AttributeError):
        return None

    def read(response: Any) -> Iterator[_FeedEvent]:
        for sse in event_source(response, max_event_size=None):  # one batch may touch many files
            event = parse(sse.event, sse.data)
            kind = kinds.get(type(event))
            if kind is not None:
                paths = tuple(change.path for change in getattr(event, "changes", ()))
                yield _FeedEvent(kind, getattr(event, "cursor", None), paths)

    return read


class _FeedError(Exception):
    """The events endpoint answered with an error, or with something that is not an event stream."""

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after
        self.final = status in _FEED_UNAVAILABLE or status is None


class _BucketFeed(ChangeFeed):
    """Follows one bucket's change feed in a daemon thread, for the keys under one store prefix.

    Every relevant event bumps a generation counter; ``wait(key)`` returns ``True`` once the
    generation of ``key``'s latest change (or of the latest reset, lost stream or overflow, which
    count as a change of every key) passes the one its previous call saw.
    """

    def __init__(self, store: HFBucketStore, read: Callable[[Any], Iterator[_FeedEvent]]) -> None:
        self._store, self._read = store, read
        self._url = f"{store.endpoint}/api/buckets/{store.bucket_id}/events"
        self._root = f"{store.prefix}/" if store.prefix else ""
        self._cond = threading.Condition()
        self._gen = 0
        self._changed: dict[str, int] = {}  # key -> generation of its latest change
        self._all = 0  # generation after which every key may have changed
        self._seen: dict[str, int] = {}  # key -> generation its previous wait() returned at
        self._cursor: str | None = None
        self._response: Any = None
        self._live = False  # the current stream reached `ready`
        self._available = True
        self._settled = threading.Event()  # the first stream is live, failed, or start() stopped waiting
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"deltasync-hf-feed-{store.bucket_id}", daemon=True)

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def start(self) -> bool:
        """Open the first stream; ``False`` if the Hub does not serve the feed."""
        self._thread.start()
        self._settled.wait(FEED_CONNECT_TIMEOUT_S)
        self._settled.set()  # a slow first stream still counts: a later `ready` then wakes every key
        return self._available

    def wait(self, key: str, timeout: float) -> bool:
        check_key(key)
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = self._seen.get(key, 0)
            while max(self._changed.get(key, 0), self._all) <= seen:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._seen[key] = self._gen
            return True

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            response = self._response
        if response is not None:
            _interrupt(response)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(FEED_CLOSE_JOIN_S)

    # -- the follower thread ----------------------------------------------------------------------

    def _run(self) -> None:
        failures = unready = 0
        while not self._stop.is_set():
            delay = FEED_RECONNECT_S
            try:
                outcome, live = self._session()
            except _FeedError as exc:
                if exc.final or (exc.status == 400 and self._cursor is None):
                    return self._give_up(str(exc))
                if exc.status == 400:  # the cursor is refused: start over, as after a reset
                    self._cursor = None
                else:
                    failures += 1
                    delay = exc.retry_after or FEED_RETRY_BASE_S * 2 ** (failures - 1)
                outcome, live = "failed", False
                logger.debug("change feed of %s: %s; retrying in %.1f s", self._store.url, exc, delay)
            except Exception as exc:  # cannot connect, or the connection broke before any answer
                failures += 1
                delay = FEED_RETRY_BASE_S * 2 ** (failures - 1)
                outcome, live = "failed", False
                logger.debug("change feed of %s: %s; retrying in %.1f s", self._store.url, self._scrub(exc), delay)
            if live or outcome in ("reset", "reconnect"):
                failures = unready = 0
            elif outcome == "lost":
                unready += 1
                if unready >= FEED_GIVE_UP_AFTER:
                    return self._give_up(f"{unready} streams in a row ended before 'ready'")
                delay = FEED_RETRY_BASE_S * 2 ** (unready - 1)
            if outcome == "lost" and live:
                self._signal(everything=True)  # the reader re-reads once; the replay fills the gap
            self._settled.set()
            self._stop.wait(min(delay, FEED_RETRY_MAX_S))

    def _session(self) -> tuple[str, bool]:
        """Follow one stream to its end: how it ended, and whether it went live."""
        session = require("huggingface_hub.utils", "hf").get_session()  # honours set_client_factory
        headers = {**self._store._headers(auth=True), "Accept": "text/event-stream", "Cache-Control": "no-store"}
        params = {"cursor": self._cursor} if self._cursor is not None else {}
        timeout = (FEED_CONNECT_TIMEOUT_S, FEED_READ_TIMEOUT_S, FEED_CONNECT_TIMEOUT_S, FEED_CONNECT_TIMEOUT_S)
        with session.stream("GET", self._url, params=params, headers=headers, timeout=timeout) as response:
            _check_events_response(response)
            with self._cond:
                self._response = response
            if self._stop.is_set():  # close() ran before the response could be interrupted
                return "stopped", False
            self._live = False
            try:
                return self._consume(response, resumed=bool(params)), self._live
            except Exception as exc:  # read timeout, dropped connection, or close() shutting the socket
                if self._stop.is_set():
                    return "stopped", self._live
                logger.debug("change feed of %s lost: %s", self._store.url, self._scrub(exc))
                return "lost", self._live
            finally:
                with self._cond:
                    self._response = None

    def _consume(self, response: Any, *, resumed: bool) -> str:
        for event in self._read(response):
            if self._stop.is_set():
                break
            if event.kind == "changes":
                self._cursor = event.cursor
                self._signal(self._keys(event.paths))
            elif event.kind == "ready":
                self._cursor = event.cursor or self._cursor
                if not resumed and self._settled.is_set():  # changes since the last stream were not replayed
                    self._signal(everything=True)
                self._live = True
                self._settled.set()
            elif event.kind == "reset":  # the cursor is older than the Hub's replay buffer
                self._cursor = None
                self._signal(everything=True)
                return "reset"
            else:  # "reconnect": the Hub ends the stream on purpose (pod rotation)
                self._cursor = event.cursor or self._cursor
                return "reconnect"
        return "stopped" if self._stop.is_set() else "lost"

    def _keys(self, paths: Iterable[str]) -> list[str]:
        root = self._root
        return [path[len(root) :] for path in paths if path.startswith(root) and len(path) > len(root)]

    def _signal(self, keys: Iterable[str] = (), *, everything: bool = False) -> None:
        keys = list(keys)
        if not keys and not everything:
            return
        with self._cond:
            self._gen += 1
            if everything or len(self._changed) + len(keys) > FEED_MAX_TRACKED:
                self._changed.clear()
                self._all = self._gen
            self._changed.update(dict.fromkeys(keys, self._gen))
            self._cond.notify_all()

    def _give_up(self, why: str) -> None:
        level = logging.WARNING if self._settled.is_set() else logging.INFO  # a feed in use stops
        logger.log(level, "cannot follow changes of bucket %s (%s): %s is polled", self._store.bucket_id, why, self._store.url)
        self._available = False
        self._signal(everything=True)
        self._settled.set()

    def _scrub(self, exc: BaseException) -> str:
        return self._store._scrub(f"{type(exc).__name__}: {exc}")


def _check_events_response(response: Any) -> None:
    """Raise `_FeedError` unless ``response`` is a live event stream (the body is never read)."""
    status = int(response.status_code)
    if status >= 400:
        hint = response.headers.get("retry-after")
        retry_after = float(hint) if hint and hint.replace(".", "", 1).isdigit() else None
        raise _FeedError(f"HTTP {status} from the events endpoint", status=status, retry_after=retry_after)
    content_type = response.headers.get("content-type") or "no content type"
    if not content_type.startswith("text/event-stream"):
        raise _FeedError(f"the events endpoint answered {content_type}, not an event stream")


def _interrupt(response: Any) -> None:
    """Wake a thread blocked reading ``response`` by shutting its socket down (closing would not)."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain method: no TLS state is touched
