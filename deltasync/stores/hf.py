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
  private module (see :func:`~deltasync.stores._hf_feed.live_follow_reader`); without it, or where the Hub does not serve the
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

Timeouts: huggingface_hub's shared HTTP client has none by default (``timeout=None``) and its bucket
calls pass none, so a silent server could hold a call forever. The store adds a request hook to that
client (:func:`_bound_timeouts`) giving every request a connect limit of
:data:`HTTP_CONNECT_TIMEOUT_S` and read, write and pool limits of :data:`HTTP_IO_TIMEOUT_S` wherever
the request leaves them unset; limits a caller set are kept (the change feed sets its own). The
bytes themselves move through hf_xet's own (Rust) client, which this store does not configure: its
limits are hf_xet's, set through its environment (``HF_XET_CLIENT_CONNECT_TIMEOUT``,
``HF_XET_CLIENT_READ_TIMEOUT``).

Bounded reads: ``get(key, max_bytes=n)`` and ``get_if_changed`` compare the size the Hub reports
(paths-info) with ``n`` before downloading, and check the downloaded file's size before reading it.

Tokens never appear in ``repr``, log lines or error messages raised here: error texts are scrubbed,
and a client error that quotes the token is not chained.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ConfigError, DeltaSyncError, ObjectNotFound, PreconditionFailed, StoreError, require
from ._hf_feed import BucketFeed, live_follow_reader
from .base import ChangeFeed, HostCheck, ObjectInfo, PutMode, Store, check_key, check_limit, check_prefix, check_size

__all__ = ["HFBucketStore", "parse_bucket_url"]

logger = logging.getLogger("deltasync.stores.hf")

T = TypeVar("T")

# A module global looked up at each change_feed() call, so a test can take huggingface_hub's parser away.
_live_follow_reader = live_follow_reader

_SCHEME = "hf://buckets/"
# Hub names: letters, digits, "-", "_", "." (not first or last), at most 96 characters.
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
_URL_HELP = "expected hf://buckets/<namespace>/<name>[/<prefix>], e.g. hf://buckets/my-org/rl-weights/run-1"

# Limits given to huggingface_hub's HTTP requests that set none (see the module docstring).
HTTP_CONNECT_TIMEOUT_S = 10.0  # huggingface_hub's own DEFAULT_REQUEST_TIMEOUT
HTTP_IO_TIMEOUT_S = 60.0  # longest silence on an open request: two of the Hub's 30 s keep-alive pings
_LIMITS = {
    "connect": HTTP_CONNECT_TIMEOUT_S,
    "read": HTTP_IO_TIMEOUT_S,
    "write": HTTP_IO_TIMEOUT_S,
    "pool": HTTP_IO_TIMEOUT_S,
}


def parse_bucket_url(url: str) -> tuple[str, str]:
    """Split an ``hf://buckets/`` URL into bucket id and prefix.

    Args:
        url (`str`): ``hf://buckets/<namespace>/<name>`` with an optional ``/<prefix>``.

    Returns:
        `tuple[str, str]`: the bucket id (``"namespace/name"``) and the prefix (``""`` for the
        bucket root, without leading or trailing ``/``).

    Raises:
        `ConfigError`: not a bucket URL, a bad namespace or name, or an unsafe prefix.

    Example:
        ```python
        >>> parse_bucket_url("hf://buckets/my-org/rl-weights/runs/1")
        ('my-org/rl-weights', 'runs/1')
        ```
    """
    if not isinstance(url, str) or not url.startswith(_SCHEME):
        repo = isinstance(url, str) and url.startswith("hf://")
        hint = " (model, dataset and space repos are not stores)" if repo else ""
        raise ConfigError(f"not an HF bucket URL: {url!r}{hint}; {_URL_HELP}", argument="url")
    namespace, _, rest = url[len(_SCHEME) :].partition("/")
    name, _, prefix = rest.partition("/")
    for what, value in (("namespace", namespace), ("bucket name", name)):
        if not _NAME.match(value):
            raise ConfigError(f"invalid {what} {value!r} in {url!r}; {_URL_HELP}", argument="url")
    prefix = check_prefix(
        prefix,
        invalid=lambda bad: ConfigError(
            f"invalid prefix {bad!r} in {url!r}: use '/'-separated segments of [A-Za-z0-9._=+@,-]; {_URL_HELP}",
            argument="url",
        ),
    )
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
        `ConfigError`: ``bucket_id`` or ``prefix`` is malformed.
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
        if not isinstance(bucket_id, str) or bucket_id.count("/") != 1:
            raise ConfigError(
                f"bucket_id must be 'namespace/name', not {bucket_id!r}; {_URL_HELP}", argument="bucket_id"
            )
        self.bucket_id, self.prefix = parse_bucket_url(f"{_SCHEME}{bucket_id}/{prefix}")
        super().__init__(f"{_SCHEME}{self.bucket_id}" + (f"/{self.prefix}" if self.prefix else ""))
        constants = require("huggingface_hub.constants", "hf")
        self.endpoint: str = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        # Resolve the token once, so error texts can be scrubbed of it whatever its source.
        self._token: str | None = token or hub.get_token()
        self._api: Any = hub.HfApi(endpoint=self.endpoint, token=self._token, library_name="deltasync")
        self._host_check = HostCheck(self.endpoint)
        self._errors: Any = require("huggingface_hub.errors", "hf")
        utils = require("huggingface_hub.utils", "hf")
        self._build_headers: Callable[..., dict[str, str]] = utils.build_hf_headers
        self._session: Callable[[], Any] = utils.get_session
        self._xet: Any = None
        self._xet_pid = -1
        self._feeds: list[BucketFeed] = []
        if create:
            self._call(lambda: self._api.create_bucket(self.bucket_id, private=True, exist_ok=True), "creating bucket")

    @classmethod
    def from_url(
        cls, url: str, *, token: str | None = None, endpoint: str | None = None, create: bool = False
    ) -> HFBucketStore:
        """``hf://buckets/<namespace>/<name>[/<prefix>]``; options as for the constructor.

        Raises:
            `ConfigError`: the URL is not a valid bucket URL (the message shows the expected form).
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

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """Download ``key`` with ``download_bucket_files`` into a fresh temporary directory.

        A new directory per read means no local cache can serve stale bytes after an overwrite. An
        object whose listed size exceeds ``max_bytes`` is refused before anything is downloaded.
        """
        check_limit(max_bytes)
        found = self._require(key, self._path(key))
        return self._download(key, found, max_bytes)

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
        root = self._root
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

    def get_if_changed(
        self, key: str, etag: str | None, *, max_bytes: int | None = None
    ) -> tuple[bytes, ObjectInfo] | None:
        """One lookup, then a download only if the xet hash differs from ``etag``.

        The returned info describes exactly the returned bytes (same lookup). An object whose listed
        size exceeds ``max_bytes`` is refused before anything is downloaded.
        """
        check_limit(max_bytes)
        found = self._require(key, self._path(key))
        if etag is not None and found.xet_hash == etag:
            return None
        return self._download(key, found, max_bytes), self._info(key, found)

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
        feed = BucketFeed(
            read,
            events_url=f"{self.endpoint}/api/buckets/{self.bucket_id}/events",
            bucket_id=self.bucket_id,
            root=self._root,
            store_url=self.url,
            headers=lambda: self._headers(auth=True),
            scrub=self._scrub,
        )
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

    @property
    def _root(self) -> str:
        """The bucket path the keys sit under: the prefix and ``/`` (``""`` at the bucket root)."""
        return f"{self.prefix}/" if self.prefix else ""

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

    def _download(self, key: str, found: Any, max_bytes: int | None = None) -> bytes:
        """The bytes of ``found``, refused before downloading when its size exceeds ``max_bytes``."""
        check_size(key, int(found.size), max_bytes, where=self.url, backend="hf")
        with tempfile.TemporaryDirectory(prefix="deltasync-hf-") as tmp:
            target = Path(tmp, "object")
            self._call(lambda: self._api.download_bucket_files(self.bucket_id, [(found, target)]), "reading", key)
            size = target.stat().st_size
            if size != found.size:  # checked before reading, so a runaway download is never loaded
                raise StoreError(
                    f"{'short' if size < found.size else 'long'} read of {key!r} in {self.url}: "
                    f"{size} of {found.size} bytes",
                    key=key,
                    backend="hf",
                )
            return target.read_bytes()

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
        target = f"{what} {key!r} in {self.url}" if key is not None else f"{what} {self.url}"
        self._host_check(target, key=key, backend="hf", hint=" (a Hub elsewhere: set HF_ENDPOINT)")
        _bound_timeouts(self._session())
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


def _finite_timeouts(request: Any) -> None:
    """httpx request hook: fill in the timeouts a request leaves unset (``None``) with finite ones."""
    current = request.extensions.get("timeout") or {}
    filled = {phase: limit if current.get(phase) is None else current[phase] for phase, limit in _LIMITS.items()}
    request.extensions = {**request.extensions, "timeout": filled}


def _bound_timeouts(session: Any) -> None:
    """Install :func:`_finite_timeouts` on huggingface_hub's shared client (once per client).

    The client is created lazily and re-created after ``close_session()``, so this runs before every
    call; it is a list lookup when the hook is in place.
    """
    hooks = session.event_hooks.get("request", [])
    if _finite_timeouts not in hooks:
        session.event_hooks = {**session.event_hooks, "request": [*hooks, _finite_timeouts]}
