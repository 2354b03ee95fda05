"""The change feed of an HF bucket: a follower thread behind ``HFBucketStore.change_feed``.

``GET /api/buckets/{id}/events`` is a server-sent event stream, resumable by cursor. One
:class:`BucketFeed` per follower reads it in a daemon thread over its own HTTP/1.1 stream and wakes
:meth:`~deltasync.stores.base.ChangeFeed.wait` callers when a key under the store's prefix changes;
a reset, a lost stream or too many tracked keys count as a change of every key. It reconnects by
itself (capped exponential backoff while the Hub fails) and gives up, leaving the store to be
polled, when the Hub does not serve the feed for this bucket and token. Closing shuts the stream's
socket down so the thread ends at once.

Limitations: events are parsed with huggingface_hub's private ``_bucket_live_follow`` module, the
one private API this store uses, isolated in :func:`live_follow_reader` (``None`` when it is
missing or changed: callers then poll). The feed knows nothing of the store class: the store hands
it the events URL, the key root, a header factory and a scrubber (see :class:`BucketFeed`), so this
module sits below ``hf.py``. Closing by socket shutdown assumes HTTP/1.1 (huggingface_hub's
default client); with HTTP/2 it would end the shared connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import require
from .base import ChangeFeed, check_key

__all__ = ["BucketFeed", "FeedEvent", "live_follow_reader"]

# The store's logger: feed messages read as the store's.
logger = logging.getLogger("deltasync.stores.hf")

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


@dataclass(frozen=True, slots=True)
class FeedEvent:
    """One event of a bucket's change feed, reduced to what the store needs."""

    kind: str
    """``"ready"``, ``"changes"``, ``"reset"`` or ``"reconnect"``."""
    cursor: str | None
    """Resume point strictly after this event, where it carries one."""
    paths: tuple[str, ...] = ()
    """Bucket paths a ``changes`` event touched."""


def live_follow_reader() -> Callable[[Any], Iterator[FeedEvent]] | None:
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

    def read(response: Any) -> Iterator[FeedEvent]:
        for sse in event_source(response, max_event_size=None):  # one batch may touch many files
            event = parse(sse.event, sse.data)
            kind = kinds.get(type(event))
            if kind is not None:
                paths = tuple(change.path for change in getattr(event, "changes", ()))
                yield FeedEvent(kind, getattr(event, "cursor", None), paths)

    return read


class _FeedError(Exception):
    """The events endpoint answered with an error, or with something that is not an event stream."""

    def __init__(self, message: str, *, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.retry_after = status, retry_after
        self.final = status in _FEED_UNAVAILABLE or status is None


class BucketFeed(ChangeFeed):
    """Follows one bucket's change feed in a daemon thread, for the keys under one store prefix.

    Every relevant event bumps a generation counter; ``wait(key)`` returns ``True`` once the
    generation of ``key``'s latest change (or of the latest reset, lost stream or overflow, which
    count as a change of every key) passes the one its previous call saw.

    Args:
        read (`Callable`): turns an events response into :class:`FeedEvent` objects
            (:func:`live_follow_reader`).
        events_url (`str`): ``{endpoint}/api/buckets/{bucket_id}/events``.
        bucket_id (`str`): ``"namespace/name"``, for the thread's name and log lines.
        root (`str`): the bucket path of the store's keys (its prefix and ``/``; ``""`` for the bucket root).
        store_url (`str`): the store's URL, for log lines.
        headers (`Callable[[], dict[str, str]]`): the request headers, authorization included.
        scrub (`Callable[[str], str]`): removes the token from text bound for a log line.
    """

    def __init__(
        self,
        read: Callable[[Any], Iterator[FeedEvent]],
        *,
        events_url: str,
        bucket_id: str,
        root: str,
        store_url: str,
        headers: Callable[[], dict[str, str]],
        scrub: Callable[[str], str],
    ) -> None:
        self._read, self._url, self._root = read, events_url, root
        self._bucket_id, self._store_url = bucket_id, store_url
        self._headers, self._scrub_text = headers, scrub
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
        self._thread = threading.Thread(target=self._run, name=f"deltasync-hf-feed-{bucket_id}", daemon=True)

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
                logger.debug("change feed of %s: %s; retrying in %.1f s", self._store_url, exc, delay)
            except Exception as exc:  # cannot connect, or the connection broke before any answer
                failures += 1
                delay = FEED_RETRY_BASE_S * 2 ** (failures - 1)
                outcome, live = "failed", False
                logger.debug("change feed of %s: %s; retrying in %.1f s", self._store_url, self._scrub(exc), delay)
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
        headers = {**self._headers(), "Accept": "text/event-stream", "Cache-Control": "no-store"}
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
                logger.debug("change feed of %s lost: %s", self._store_url, self._scrub(exc))
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
        logger.log(level, "cannot follow changes of bucket %s (%s): %s is polled", self._bucket_id, why, self._store_url)
        self._available = False
        self._signal(everything=True)
        self._settled.set()

    def _scrub(self, exc: BaseException) -> str:
        return self._scrub_text(f"{type(exc).__name__}: {exc}")


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
