"""Replica side: follow a store's manifest and apply new versions exactly.

A :class:`Subscriber` polls ``manifest.json`` cheaply (a conditional GET that
transfers nothing while the manifest is unchanged, with exponential backoff
while idle), plans the cheapest route from the version it holds to the latest
(a chain of deltas, or the newest anchor plus deltas), downloads the objects in
parallel, checks each one's size and SHA-256, and hands validated patches to an
applier.

Verify before write (invariant 4): for every version on the route, the file is
parsed, checked against the replica (fingerprint, tensor names, shapes,
dtypes) and fully decoded (index bounds, sizes, value hashes) before its first
element is written. A refused object raises a typed error, is never tried
again, and the replica keeps serving the weights it had; a failure partway
along a route leaves it at the last whole version it reached.

Code that needs a version blocks on :meth:`Subscriber.wait_for` (a condition
variable), never a sleep loop. Replicas may write ``acks/<replica>.json`` so
``deltasync status`` can show the fleet without a control plane.

This module owns the replica's state and loop (which manifest to trust, which
version is held, when to poll); :mod:`deltasync.replica.fetch` downloads and vets a
route's objects, :mod:`deltasync.protocol.acks` reads and writes acknowledgements.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from torch.profiler import record_function

from ..codec import Decoded
from ..errors import ConfigError, DeltaSyncError, FingerprintMismatch, ObjectNotFound, VersionError
from ..protocol.acks import ACK_TTL_S, read_acks, safe_replica_id, write_ack
from ..protocol.keys import MANIFEST_KEY
from ..protocol.manifest import MAX_MANIFEST_BYTES, Manifest, Plan, plan_route
from ..stores import Store
from ..util.checks import check_int, check_number
from ..util.collector import collector_paused
from .applier import Applier
from .cache import open_cached
from .fetch import BAD_AFTER, BAD_RETRY_S, Fetcher
from .pins import Pin
from .ranged import Fetched
from .undo import UNDO_BYTES, UndoEntry, UndoLog

__all__ = ["Subscriber", "UpdateInfo", "Pin", "Applier", "read_acks", "ACK_TTL_S", "BAD_AFTER", "BAD_RETRY_S"]

logger = logging.getLogger("deltasync.subscriber")

POLL_INTERVAL_S = 1.0  # first poll interval after a change
WAITING_LOG_S = 60.0  # while nothing is published, say so this often (and once at the start)
MAX_POLL_INTERVAL_S = 15.0  # idle backoff cap: a change is seen within 15 s at worst
FETCH_WORKERS = 4  # parallel downloads


@dataclass(frozen=True, slots=True)
class UpdateInfo:
    """One completed update of a replica."""

    version: int
    """The version now in force."""
    previous: int | None
    """The version held before."""
    route: tuple[str, ...]
    """Kinds of the hops taken, e.g. ``("delta", "delta")``, ``("anchor",)`` or ``("span", "delta")``."""
    bytes: int
    """Bytes downloaded."""
    t_fetch: float
    t_decode: float
    """Seconds validating and decoding (only validating where the applier decodes the files itself)."""
    t_apply: float
    """Seconds writing (with that decode, where the applier decodes the files itself)."""
    lag_s: float
    """Seconds from the trainer's publish of ``version`` to its application here."""
    step: int | None
    """Trainer step of ``version``."""


@dataclass(slots=True)
class SubscriberStats:
    updates: int = 0
    bytes: int = 0
    polls: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    last_error: str | None = None
    restored: int = 0
    """Applies that failed midway and whose overwritten values were written back."""


class Subscriber:
    """Follows a run prefix and keeps an applier at the latest version.

    Args:
        store (`str` or `Store`): the run prefix the trainer publishes to.
        applier (`Applier`): e.g. :class:`~deltasync.appliers.TorchModuleApplier`.
        replica_id (`str`, *optional*): name in acks and logs; defaults to ``host-pid-random``.
        ack (`bool`, *optional*, defaults to True): write ``acks/<replica_id>.json`` after each update.
        poll_interval (`float`, *optional*): seconds between polls after a change.
        max_poll_interval (`float`, *optional*): idle backoff cap.
        on_update (`Callable[[UpdateInfo], None]`, *optional*): called after each update.
        start_version (`int`, *optional*): the version the applier already holds (weights restored
            from disk, for instance); pass it with ``run_id``. Routes then start from it, so a
            restarted replica catches up by deltas instead of an anchor.
        run_id (`str`, *optional*): the run ``start_version`` belongs to. A manifest of another run
            is followed from one of its anchors, as without a start version.
        only (`Collection[str]` or `Callable[[str], bool]`, *optional*): fetch and apply only these
            checkpoint tensors (an expert-parallel rank's experts, say). Objects are then read by
            byte range, just the selected tensors, each verified against the hash its header lists
            (:mod:`deltasync.replica.ranged`); objects written without those hashes are downloaded whole.
            The other tensors are left as they are.
        undo_bytes (`int`, *optional*, defaults to 64 MiB): what the newest applies overwrote, kept for
            :meth:`undo` (:mod:`deltasync.replica.undo`). An apply is all or nothing whatever this is: a
            delta's overwritten values are read before it is written, and written back if a write fails.
        cache_dir (`str`, *optional*): read the run's objects through a cache in this directory, shared by
            the node's replicas that name it (:class:`~deltasync.replica.cache.CachedStore`, docs/FLEET.md).
        cache_max_bytes (`int`, *optional*): that cache's size cap (its own default when unset).
        **store_options: passed to :func:`~deltasync.stores.open_store` when ``store`` is a URL.

    Example:
        ```python
        >>> sub = Subscriber("./run1", TorchModuleApplier(model))
        >>> sub.start()                 # follows in a background thread
        >>> sub.wait_for(10, timeout=60)
        >>> sub.stop()
        ```
    """

    def __init__(
        self,
        store: str | Store,
        applier: Applier,
        *,
        replica_id: str | None = None,
        ack: bool = True,
        poll_interval: float = POLL_INTERVAL_S,
        max_poll_interval: float = MAX_POLL_INTERVAL_S,
        fetch_workers: int = FETCH_WORKERS,
        on_update: Callable[[UpdateInfo], None] | None = None,
        start_version: int | None = None,
        run_id: str | None = None,
        only: Collection[str] | Callable[[str], bool] | None = None,
        undo_bytes: int = UNDO_BYTES,
        **store_options: Any,
    ) -> None:
        _check_options(applier, poll_interval, max_poll_interval, fetch_workers, on_update, start_version, run_id)
        if only is not None and not callable(only):
            if isinstance(only, str) or not isinstance(only, Collection):
                raise ConfigError("only must be a collection of tensor names or a callable", argument="only")
            unknown = sorted(set(only) - set(applier.specs))
            if unknown:
                raise ConfigError(f"only names tensors the applier does not hold: {unknown[:5]}", argument="only")
            only = frozenset(only).__contains__
        self.store = open_cached(
            store, store_options.pop("cache_dir", None), max_bytes=store_options.pop("cache_max_bytes", None),
            **store_options,
        )
        self.applier = applier
        self.replica_id = safe_replica_id(replica_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self.ack = ack
        self.poll_interval, self.max_poll_interval = poll_interval, max_poll_interval
        self.stats = SubscriberStats()
        self._hooks: list[Callable[[UpdateInfo], None]] = [on_update] if on_update else []
        self._version: int | None = start_version
        self._run_id: str | None = run_id
        self._etag: str | None = None
        self._waiting_since: float | None = None  # when "waiting for a first version" was last logged
        self._refused: FingerprintMismatch | None = None  # the run is another model's: wait_for raises it
        self._manifest: Manifest | None = None
        self._fetcher = Fetcher(self.store, applier, workers=fetch_workers, only=only)
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._following = False  # a loop (run) polls the store, or start() is about to begin one
        self._pin = Pin("follow")
        check_int("undo_bytes", undo_bytes, low=0)
        self._undo = UndoLog(undo_bytes)
        self._apply_lock = threading.Lock()

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int | None:
        """The version in force, or ``None`` before the first update."""
        return self._version

    @property
    def run_id(self) -> str | None:
        """The run the version in force belongs to (``None`` before the first update)."""
        return self._run_id

    @property
    def following(self) -> str | None:
        """The run id of the manifest this subscriber follows now (known before its first update)."""
        return self._manifest.run_id if self._manifest is not None else None

    @property
    def latest(self) -> int | None:
        """The newest version seen in the manifest."""
        return self._manifest.latest if self._manifest else None

    @property
    def pin(self) -> Pin:
        """Where updates go without an explicit version: the newest (the default), at most a version, exactly
        one, or nowhere (hold)."""
        return self._pin

    def follow(self, at_most: int | None = None) -> None:
        """Follow the newest version, or the newest up to ``at_most`` (never back: a replica past it stays)."""
        self._pin = Pin.following(at_most)

    def hold(self) -> None:
        """Stay at the version held: polls still read the manifest, nothing is applied until :meth:`follow` or
        :meth:`go_to`."""
        self._pin = Pin("hold")

    def go_to(self, version: int) -> None:
        """Go to exactly ``version`` at the next update (ahead or back) and stay there."""
        self._pin = Pin.exactly(version)

    def add_hook(self, hook: Callable[[UpdateInfo], None]) -> None:
        """Call ``hook(info)`` after every update."""
        self._hooks.append(hook)

    def wait_for(self, version: int, timeout: float | None = None) -> bool:
        """Block until the version in force is at least ``version``; ``False`` on timeout.

        Someone must be following the store meanwhile: :meth:`start` (or :meth:`run` on a thread of yours).

        Raises:
            `FingerprintMismatch`: the store publishes another model than this replica holds, so the
                wait could never end (raised as soon as a poll finds it, not at the timeout).
            `RuntimeError`: nothing follows the store and the version is not held yet, so the wait could
                only time out.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while self._version is None or self._version < version:
                if not self._following:
                    raise RuntimeError(
                        f"subscriber holds version {self._version} and is not following the store, so version "
                        f"{version} cannot arrive: call start() first (or update() to apply the newest once)"
                    )
                if self._refused is not None:
                    raise self._refused
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(remaining)
        return True

    # ------------------------------------------------------------------ loop

    def start(self) -> Subscriber:
        """Follow the store in a background thread."""
        if self._thread is not None:
            raise RuntimeError("subscriber already started")
        self._stop.clear()
        self._following = True
        self._thread = threading.Thread(target=self.run, name=f"deltasync-follow-{self.replica_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30) -> None:
        """Stop following (the current update finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        """Stop and release threads and the store."""
        self.stop()
        self._fetcher.close()
        self.store.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, stop: threading.Event | None = None) -> None:
        """Poll until ``stop`` (or :meth:`stop`) is set, backing off while idle."""
        stop = stop or self._stop
        interval = self.poll_interval
        with self._changed:
            self._following = True
        feed = None
        try:
            feed = self.store.change_feed()
            while not stop.is_set() and not self._stop.is_set():
                updated = self.poll()
                interval = self.poll_interval if updated else min(self.max_poll_interval, interval * 2)
                if feed is None:
                    stop.wait(interval)
                    continue
                # Pushed changes wake us at once; the timeout keeps a slow poll as a safety net.
                deadline = time.monotonic() + self.max_poll_interval
                while not stop.is_set() and time.monotonic() < deadline:
                    if feed.wait(MANIFEST_KEY, timeout=min(1.0, self.max_poll_interval)):
                        break
        finally:
            if feed is not None:
                feed.close()
            with self._changed:  # waiters learn that nothing follows the store any more
                self._following = False
                self._changed.notify_all()

    def poll(self) -> UpdateInfo | None:
        """One round: read the manifest and apply whatever is new. Never raises on bad input.

        Returns:
            `UpdateInfo` if the replica moved to a newer version, else ``None``.
        """
        self.stats.polls += 1
        try:
            info = self.update()
            self._refused = None  # the store (now) publishes this replica's model
            return info
        except DeltaSyncError as exc:
            self.stats.rejected[type(exc).__name__] += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, FingerprintMismatch):  # waiting cannot end: tell whoever waits
                with self._changed:
                    self._refused = exc
                    self._changed.notify_all()
            logger.warning("replica %s keeps version %s: %s", self.replica_id, self._version, self.stats.last_error)
            return None
        except Exception as exc:  # an applier or device failure: keep following, resync later
            self.stats.rejected[type(exc).__name__] += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"
            logger.exception("replica %s failed to update from v%s", self.replica_id, self._version)
            return None

    def update(self, version: int | None = None) -> UpdateInfo | None:
        """Like :meth:`poll` but raises typed errors instead of counting them.

        Without ``version`` the subscriber's pin decides where to go (:meth:`follow`, :meth:`hold`,
        :meth:`go_to`; the newest version by default).

        Args:
            version (`int`, *optional*): go to exactly this version, one the manifest lists, ahead of the version
                held or behind it (back by an anchor at or before it), whatever the pin.

        Raises:
            `VersionError`: no usable route, or the version asked for is not published (yet) or no longer
                listed.
        """
        with self._apply_lock:
            manifest = self._read_manifest()
            exact = version if version is not None else self._pin.exact
            if manifest is None or manifest.latest is None:
                if exact is not None:
                    raise VersionError(f"nothing is published at {self.store.url} yet: version {exact} is not "
                                       "there", current=self._version, latest=None)
                self._note_waiting(manifest is None)
                return None
            current = self._held(manifest)
            target = exact if exact is not None else self._pin.target(manifest.latest, current)
            if target is None or current == target:
                return None
            if exact is not None:
                self._check_target(manifest, exact, current)
            plan = plan_route(manifest, current, avoid=self._fetcher.avoided(manifest), target=target)
            if plan is None:
                back = (" (going back starts again from an anchor at or before it; the oldest listed is "
                        f"v{manifest.versions[0].version})") if current is not None and target < current else ""
                raise VersionError(
                    f"no usable route from version {current} to {target} in {self.store.url}{back}",
                    current=current,
                    latest=manifest.latest,
                )
            self.applier.accept_route(plan)
            info = self._execute(manifest, plan)
        for hook in self._hooks:
            try:
                hook(info)
            except Exception:  # a user's hook must not stop the replica from following
                logger.exception("on_update hook %r failed", hook)
        return info

    # ------------------------------------------------------------------ internals

    def _check_target(self, manifest: Manifest, version: int, current: int | None) -> None:
        """Refuse a version this replica cannot go to, saying why."""
        if version > manifest.latest:  # type: ignore[operator]
            raise VersionError(f"{self.store.url}'s newest version is {manifest.latest}: version {version} is not "
                               "published (yet)", current=current, latest=manifest.latest)
        if manifest.entry(version) is None:
            oldest = manifest.versions[0].version if manifest.versions else None
            raise VersionError(f"version {version} is no longer listed at {self.store.url} (retention keeps "
                               f"{oldest} to {manifest.latest})", current=current, latest=manifest.latest)

    def _note_waiting(self, empty: bool) -> None:
        """Say, once and then every :data:`WAITING_LOG_S`, that nothing has been published yet."""
        now = time.monotonic()
        if self._waiting_since is not None and now - self._waiting_since < WAITING_LOG_S:
            return
        self._waiting_since = now
        logger.info(
            "replica %s: waiting for a first version at %s (%s)", self.replica_id, self.store.url,
            "no manifest yet: is the trainer publishing to this URL?" if empty else "a trainer holds it, none committed",
        )

    def _read_manifest(self) -> Manifest | None:
        """The newest acceptable manifest. A refused one raises and is not kept: the next poll
        reads the store again, so a repaired manifest is taken up as soon as it appears."""
        try:
            got = self.store.get_if_changed(MANIFEST_KEY, self._etag, max_bytes=MAX_MANIFEST_BYTES)
        except ObjectNotFound:
            return None
        if got is not None:
            data, info = got
            manifest = Manifest.from_bytes(data)
            if manifest.fingerprint != self.applier.fingerprint:
                raise FingerprintMismatch(
                    f"{self.store.url} publishes another model than this replica holds "
                    f"({self._fetcher.explain_mismatch(manifest)}): point the replica at the run of its "
                    "model, or give it that model",
                    expected=self.applier.fingerprint,
                    found=manifest.fingerprint,
                )
            held = self._held(manifest)
            if held is not None and (manifest.latest is None or manifest.latest < held):
                # Measured against what this replica verified and applied, not against the last
                # manifest it saw: that one may itself have been a forgery (say v10^12).
                raise VersionError(
                    f"{self.store.url} ends at v{manifest.latest} of run {manifest.run_id[:8]}, but this "
                    f"replica already holds v{held} of it: the manifest went backwards (corrupt, or the store "
                    f"was rolled back); keeping v{held} until a manifest that reaches it appears (restart the "
                    "replica without a start version to resync from an anchor)",
                    current=held,
                    latest=manifest.latest,
                )
            self._manifest, self._etag = manifest, info.etag
        return self._manifest

    def _execute(self, manifest: Manifest, plan: Plan) -> UpdateInfo:
        started = time.perf_counter()
        futures = self._fetcher.prefetch(plan)
        t_decode = t_apply = 0.0
        previous = self._held(manifest)
        nbytes = 0
        blobs: list[bytes | memoryview | Fetched] = []
        decoded: dict[str, Decoded] | None = None
        for step in plan.steps:
            with record_function("deltasync.fetch"):  # named ranges in a torch profiler's trace
                blobs = [futures[ref.key].result() for ref in step.objects]
            nbytes += sum(b.bytes_read if isinstance(b, Fetched) else len(b) for b in blobs)
            with collector_paused():  # decode and apply: no collector walks amid them (see there)
                t0 = time.perf_counter()
                with record_function("deltasync.decode"):
                    headers = self._fetcher.check(step, blobs, previous_version=self._held(manifest))
                    whole = self.applier.takes_files(step.kind) and (
                        self.applier.takes_ranges() or not any(isinstance(b, Fetched) for b in blobs))
                    decoded = None if whole else (
                        self._fetcher.decode_checked(step, blobs, headers))
                    # Freed inside the pause: a dozen small objects a tensor that, alive when it ends, the
                    # collection its end starts would walk.
                    del headers
                t1 = time.perf_counter()
                refused = None
                with record_function("deltasync.apply"):
                    if decoded is None:
                        self._undo.clear()  # written where the weights live: nothing here to undo it with
                        try:
                            refused = self.applier.apply_files(step.kind, blobs)
                        except BaseException:
                            # Weights may be partly written: only an anchor can make them whole again.
                            self._set_version(None, None)
                            raise
                    else:
                        self._apply_all_or_nothing(decoded, step.version)
            if refused is not None:  # the applier's own checks failed before any write: its version stands
                self._fetcher.refuse(step)
                raise refused
            t_apply += time.perf_counter() - t1
            t_decode += t1 - t0
            self._set_version(manifest.run_id, step.version)
        # The weights are written: the fetched objects go back on a download thread, which then holds them alone.
        held = [futures, blobs, decoded]
        del futures, blobs, decoded
        self._fetcher.release(held)
        entry = manifest.entry(plan.target)
        info = UpdateInfo(
            version=plan.target,
            previous=previous,
            route=tuple(s.label for s in plan.steps),
            bytes=nbytes,
            t_fetch=max(0.0, time.perf_counter() - started - t_decode - t_apply),
            t_decode=t_decode,
            t_apply=t_apply,
            lag_s=max(0.0, time.time() - entry.time) if entry else 0.0,
            step=entry.step if entry else None,
        )
        self.stats.updates += 1
        self.stats.bytes += info.bytes
        logger.info(
            "replica %s at v%d (from %s via %s): %s bytes, decode %.0f ms, apply %.0f ms, lag %.2f s",
            self.replica_id, info.version, previous, "+".join(info.route), f"{info.bytes:,}",
            1e3 * t_decode, 1e3 * t_apply, info.lag_s,
        )
        if self.ack:
            self._write_ack(info)
        return info

    def _apply_all_or_nothing(self, decoded: dict[str, Decoded], version: int) -> None:
        """Write one version's patches; if a write fails midway, write back what they overwrote (the replica
        stays at the version it held), or, where that was not kept (an anchor beyond ``undo_bytes``, an applier
        without :attr:`~Applier.local_reads`), mark the replica as needing an anchor. Raises the write's error
        either way."""
        undo = self._undo.capture(self.applier, decoded, run_id=self._run_id, previous=self._version,
                                  version=version) if self.applier.local_reads else None
        try:
            self.applier.apply(decoded)
        except BaseException as exc:
            if undo is not None and self._restore(undo, exc):
                raise
            self._set_version(None, None)  # partly written: only an anchor can make the weights whole again
            raise
        if undo is not None:
            self._undo.keep(undo)

    def _restore(self, undo: UndoEntry, error: BaseException) -> bool:
        """Write back the values ``undo`` holds after ``error`` interrupted a write; whether that succeeded."""
        try:
            self.applier.restore(undo.patches, undo.run_id, undo.previous)
        except BaseException:
            logger.exception("replica %s: could not restore v%s after a failed write; it needs an anchor",
                             self.replica_id, undo.previous)
            return False
        self.stats.restored += 1
        logger.warning("replica %s: writing v%d failed (%s: %s); the values it overwrote are back, v%s stands",
                       self.replica_id, undo.version, type(error).__name__, error, undo.previous)
        return True

    def undo(self, steps: int = 1) -> int | None:
        """Take back the last ``steps`` applies from the undo log, without the store, and hold there.

        The log keeps what the newest applies overwrote, within ``undo_bytes``. The replica then holds the
        version it reached (:meth:`follow` or :meth:`go_to` moves it again).

        Returns:
            The version now held.

        Raises:
            `VersionError`: the log does not reach that far back (nothing is taken back then).
        """
        check_int("steps", steps, low=1)
        with self._apply_lock:
            if self._undoable() < steps:
                raise VersionError(
                    f"replica {self.replica_id} can take back {self._undoable()} applies from v{self._version}, not "
                    f"{steps}: its undo log keeps the newest applies within undo_bytes={self._undo.max_bytes:,}",
                    current=self._version, latest=self.latest)
            self.hold()
            for _ in range(steps):
                entry = self._undo.pop()
                assert entry is not None
                try:
                    self.applier.restore(entry.patches, entry.run_id, entry.previous)
                except BaseException:
                    self._set_version(None, None)
                    raise
                self._set_version(entry.run_id, entry.previous)
            logger.info("replica %s: took back %d applies, holds v%s", self.replica_id, steps, self._version)
            return self._version

    def _undoable(self) -> int:
        """How many of the newest applies the undo log can take back from the version held."""
        count, at = 0, (self._run_id, self._version)
        for entry in reversed(self._undo.entries):
            if (entry.run_id, entry.version) != at:
                break
            count, at = count + 1, (entry.run_id, entry.previous)
        return count

    def _held(self, manifest: Manifest) -> int | None:
        return self._version if manifest.run_id == self._run_id else None

    def _set_version(self, run_id: str | None, version: int | None) -> None:
        with self._changed:
            self._run_id, self._version = run_id, version
            self._changed.notify_all()

    def _write_ack(self, info: UpdateInfo) -> None:
        write_ack(self.store, self.replica_id, {
            "replica": self.replica_id,
            "version": info.version,
            "run_id": self._run_id,
            "time": time.time(),
            "lag_s": info.lag_s,
            "bytes": info.bytes,
            "apply_ms": 1e3 * info.t_apply,
            "rejected": dict(self.stats.rejected),
        })


def _check_options(
    applier: Any, poll_interval: float, max_poll_interval: float, fetch_workers: int,
    on_update: Any, start_version: int | None, run_id: str | None,
) -> None:
    """Refuse arguments that cannot work, naming the argument, before the store is opened."""
    if not isinstance(applier, Applier):
        raise ConfigError(
            f"applier {type(applier).__name__} is not a deltasync.replica.applier.Applier: pass an applier such "
            "as TorchModuleApplier(model), or subclass Applier",
            argument="applier",
        )
    check_number("poll_interval", poll_interval)
    check_number("max_poll_interval", max_poll_interval)
    if max_poll_interval < poll_interval:
        raise ConfigError(
            f"max_poll_interval ({max_poll_interval}) must be at least poll_interval ({poll_interval})",
            argument="max_poll_interval",
        )
    check_int("fetch_workers", fetch_workers, low=1)
    if on_update is not None and not callable(on_update):
        raise ConfigError("on_update must be callable", argument="on_update")
    if (start_version is None) != (run_id is None) or (
        start_version is not None
        and (isinstance(start_version, bool) or not isinstance(start_version, int) or start_version < 0)
    ):
        raise ConfigError(
            "pass start_version (a non-negative version) and run_id together, or neither", argument="start_version"
        )
