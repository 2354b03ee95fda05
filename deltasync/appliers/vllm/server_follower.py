"""A replica process that keeps a vLLM server at a run's newest version through vLLM's standard endpoints.

The server runs with the ``deltasync`` weight-transfer backend and nothing else of ours
(``vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}'``, dev mode for the endpoints).
:class:`ServerFollower` tells it, once, which store to follow (``/init_weight_transfer_engine``), then
polls the run's manifest (a conditional read that transfers nothing while it is unchanged, backing off
while idle) and, for each new version, drives the round trip: ``/start_weight_update``,
``/update_weights`` with the version, ``/finish_weight_update`` with its label. The engine's ranks fetch,
check and apply the version themselves (:mod:`.backend`); nothing of the weights passes through here.

Modes (how generation meets an update):

- ``"inflight"`` (default): requests keep running; the engine applies a version between two of its steps,
  so no step mixes versions, and vLLM's per-request weight-version spans are exact.
- ``"pause"``: ``/pause?mode=wait`` (or ``abort``) first, so no request spans two versions; ``/resume`` after.

A version the backend refuses (a damaged object, another model's run) is logged with its reason and tried
again at the next change of the manifest: the engine keeps serving the version it holds.

The command line is ``deltasync follow --store URL --server URL`` (:mod:`deltasync.cli.follow`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ...errors import DeltaSyncError, ObjectNotFound
from ...protocol.keys import MANIFEST_KEY
from ...protocol.manifest import MAX_MANIFEST_BYTES, Manifest
from ...replica.pins import Pin
from ...stores import Store, open_store
from .rpc import ServerEngine, parse_version_label, version_label

__all__ = ["ServerFollower", "ServerUpdate"]

logger = logging.getLogger("deltasync.vllm")

POLL_INTERVAL_S = 1.0  # first poll interval after a change
MAX_POLL_INTERVAL_S = 15.0  # idle backoff cap

Mode = Literal["inflight", "pause"]


@dataclass(frozen=True, slots=True)
class ServerUpdate:
    """One version the server now serves."""

    version: int
    """The version the server holds."""
    label: str
    """Its weight-version label (``/weight_info``)."""
    seconds: float
    """From ``/start_weight_update`` to the end of ``/finish_weight_update``."""
    paused_s: float
    """How long generation was paused (0 in flight)."""


class ServerFollower:
    """Keeps a vLLM server that runs the ``deltasync`` backend at the newest version of a run.

    Args:
        server (`str` or `ServerEngine`): the server's base URL, e.g. ``"http://127.0.0.1:8000"``.
        store (`str` or `Store`): the run prefix the trainer publishes to; the server's workers must reach
            the same URL (they read the objects themselves).
        mode (`"inflight"` or `"pause"`, *optional*, defaults to ``"inflight"``): see the module docstring.
        pause_mode (`"wait"` or `"abort"`, *optional*): how ``"pause"`` drains requests.
        init_info (`dict`, *optional*): more of the backend's ``init_info`` (``cache_dir``, ``start_version``
            with ``run_id``, ``store_options``...).
        on_update (`Callable[[ServerUpdate], None]`, *optional*): called after each version.
    """

    def __init__(
        self,
        server: str | ServerEngine,
        store: str | Store,
        *,
        mode: Mode = "inflight",
        pause_mode: Literal["wait", "abort"] = "wait",
        init_info: dict[str, Any] | None = None,
        poll_interval: float = POLL_INTERVAL_S,
        max_poll_interval: float = MAX_POLL_INTERVAL_S,
        on_update: Callable[[ServerUpdate], None] | None = None,
    ) -> None:
        if mode not in ("inflight", "pause"):
            raise ValueError(f"mode must be 'inflight' or 'pause', not {mode!r}")
        self.server = ServerEngine(server) if isinstance(server, str) else server
        self.store = open_store(store)
        self.mode, self.pause_mode = mode, pause_mode
        self.init_info = {"store": self.store.url, **(init_info or {})}
        self.poll_interval, self.max_poll_interval = poll_interval, max_poll_interval
        self.on_update = on_update
        self.served: int | None = None
        """The version the server holds, as of the last round trip (or the label it reported at start)."""
        self.last_error: DeltaSyncError | None = None
        self.updates: list[ServerUpdate] = []
        self.pin = Pin("follow")
        """Where :meth:`update` goes without a version (:meth:`follow`, :meth:`hold`, :meth:`go_to`)."""
        self._etag: str | None = None
        self._manifest: Manifest | None = None
        self._refused: set[int] = set()  # versions refused since the manifest last changed
        self._initialised = False

    def follow(self, at_most: int | None = None) -> None:
        """Follow the newest version, or the newest up to ``at_most`` (a server past it stays)."""
        self.pin = Pin.following(at_most)

    def hold(self) -> None:
        """Keep the version served until :meth:`follow` or :meth:`go_to`."""
        self.pin = Pin("hold")

    def go_to(self, version: int) -> None:
        """Serve exactly ``version`` (ahead of the one served or behind it) from the next update on."""
        self.pin = Pin.exactly(version)

    def initialise(self) -> None:
        """Tell the server's backend which store to follow (``/init_weight_transfer_engine``), once."""
        self.server.init_weight_transfer_engine(self.init_info)
        self._initialised = True

    def poll(self) -> ServerUpdate | None:
        """Read the manifest; if a newer version is committed, have the server apply it. Never raises on a
        refusal or an unreachable store (both logged, and kept in :attr:`last_error`)."""
        try:
            return self.update()
        except DeltaSyncError as exc:
            self.last_error = exc
            logger.warning("deltasync: the server keeps %s: %s: %s", self.served, type(exc).__name__, exc)
            return None

    def update(self, version: int | None = None) -> ServerUpdate | None:
        """Have the server apply ``version`` (without one, where :attr:`pin` says: the newest by default); ``None``
        when it holds it already.

        Raises:
            `DeltaSyncError`: the typed refusal the server answered with (its weights untouched), or an
                unreachable store or server.
        """
        if not self._initialised:
            self.initialise()
        manifest = self._read_manifest()
        if manifest is None or manifest.latest is None:
            return None
        version = version if version is not None else self.pin.exact
        target = self.pin.target(manifest.latest, self.served) if version is None else version
        if target is None or self.served == target or (version is None and target in self._refused):
            return None
        label = version_label(target, manifest.run_id)
        started = time.perf_counter()
        paused = 0.0
        if self.mode == "pause":
            self.server.pause(self.pause_mode)
            paused = time.perf_counter()
        try:
            self.server.start_weight_update()
            try:
                self.server.update_weights({"version": target})
            except DeltaSyncError:
                self._refused.add(target)
                raise
            self.server.finish_weight_update(label)
        finally:
            if self.mode == "pause":
                self.server.resume()
                paused = time.perf_counter() - paused
        update = ServerUpdate(target, label, time.perf_counter() - started, paused)
        self.served = target
        self.last_error = None
        self.updates.append(update)
        logger.info("deltasync: the server serves v%d (%s) after %.0f ms", target, label, 1e3 * update.seconds)
        if self.on_update is not None:
            try:
                self.on_update(update)
            except Exception:  # a user's hook must not stop the follower
                logger.exception("on_update hook failed for v%d", target)
        return update

    def run(self, stop: threading.Event) -> None:
        """Poll until ``stop`` is set, backing off while nothing changes."""
        interval = self.poll_interval
        while not stop.is_set():
            changed = self.poll() is not None
            interval = self.poll_interval if changed else min(self.max_poll_interval, interval * 2)
            stop.wait(interval)

    def close(self) -> None:
        """Close the store (the server keeps serving what it holds)."""
        self.store.close()

    def served_label(self) -> int | None:
        """The version the server reports serving for this run (``/weight_info``), or ``None``."""
        manifest = self._manifest
        return parse_version_label(self.server.weight_version(), manifest.run_id if manifest else None)

    def _read_manifest(self) -> Manifest | None:
        try:
            got = self.store.get_if_changed(MANIFEST_KEY, self._etag, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFound:
            return None
        if got is not None:
            data, info = got
            manifest = Manifest.from_bytes(data)
            self._etag = info.etag
            if self._manifest is None or manifest.latest != self._manifest.latest:
                self._refused.clear()  # a new version, or a repaired manifest: try again
            self._manifest = manifest
        return self._manifest
