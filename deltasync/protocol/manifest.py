"""The manifest: the one agreement between a trainer and its replicas.

``manifest.json`` at the run prefix lists every available version, where its
objects are, their sizes and hashes, and which writer owns the prefix. It is
written last (invariant 3): a version appears only once all of its objects are
in the store, so a reader never sees a version it cannot fetch.

Everything here is pure: parsing and validating (keys cannot escape the
prefix, versions only go forward), planning the cheapest route from a
replica's version to the latest, and planning retention. The publisher and the
subscriber do the I/O.

Schema 2 adds BLAKE3 object digests, schema 3 objects checked by their header's
per-tensor digests (``blake3-entries``), schema 4 catch-up spans (a version's
``spans``: deltas from an older version, :class:`Span`); otherwise schemas only
add fields with defaults. ``tests/golden/manifest_v1.json`` keeps old manifests
readable.
"""

from __future__ import annotations

import heapq
import itertools
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..errors import ManifestError
from ..format import digests
from ..format.check import intact_by_entries
from ..stores import check_key
from ..util.jsonio import load_json
from .keys import MANIFEST_KEY

__all__ = [
    "MANIFEST_KEY", "ObjectRef", "Span", "VersionEntry", "Manifest", "Step", "Plan", "plan_route", "plan_retention",
]

SCHEMA = 4  # 2: BLAKE3 object digests; 3: objects checked by their entries; 4: spans (readers accept 1-4)
SPANS_SCHEMA = 4
FORMAT = "deltasync-manifest"
# Objects dropped from the manifest stay this long before deletion, so a replica
# that read the previous manifest can still finish its download.
RETIRE_GRACE_S = 300.0
# Bounds every number in a manifest must respect; anything outside is corruption, never data.
# A version a millisecond for 34 years stays below 2^40; sizes and element counts stay exact in
# a float64 (what JSON readers elsewhere parse numbers into); times are epoch seconds well past
# any real clock yet far below where float, datetime or time.strftime overflow.
MAX_VERSION = 2**40
MAX_COUNT = 2**53
MAX_RANK = 2**20
MAX_STEP = 2**63
MAX_EPOCH_S = 2.0**36
# A manifest lists live versions only (tens of KB; a 512-rank run with 100 live versions is ~8 MB).
MAX_MANIFEST_BYTES = 64 << 20
MAX_ID_CHARS = 256  # run ids, writer ids and fingerprints are short hex strings


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """One immutable object in the store."""

    key: str
    """Key relative to the run prefix (validated: no traversal, no URLs)."""
    size: int
    """Exact size in bytes."""
    digest: str
    """Hex digest of the bytes (64 lowercase hex digits), under :attr:`algorithm`."""
    rank: int | None = None
    """For a sharded trainer: the rank that wrote this shard of the version (each
    tensor entry in the object's header names the rows of the full tensor it holds)."""
    header: tuple[int, str] | None = None
    """``(size, digest)`` of the object's first bytes: the 8-byte length and the JSON
    header. A reader that range-reads only some tensors verifies the header with it,
    then each tensor with the digest the header lists for it."""
    algorithm: str = digests.WRITE
    """Hash of :attr:`digest` and the header's, their JSON key: ``"blake3"`` (current writers' deltas),
    ``"sha256"``, or ``"blake3-entries"`` (current writers' anchors: :attr:`digest` is the header's, and
    the header's per-tensor digests cover the rest; see :mod:`deltasync.format.check`)."""

    def __post_init__(self) -> None:
        check_key(self.key)
        if self.rank is not None and not _is_int(self.rank, 0, MAX_RANK):
            raise ManifestError(f"bad rank {self.rank!r} for {self.key}", key=self.key)
        if not _is_int(self.size, 0, MAX_COUNT):
            raise ManifestError(f"bad size {self.size!r} for {self.key}", key=self.key)
        if self.algorithm not in digests.OBJECT_ALGORITHMS or not digests.is_hex(self.digest):
            raise ManifestError(f"bad {self.algorithm} for {self.key}", key=self.key)
        if self.header is not None:
            size, digest = self.header
            if not _is_int(size, 8, self.size + 1) or not digests.is_hex(digest):
                raise ManifestError(f"bad header reference for {self.key}", key=self.key)
        if self.algorithm == digests.BY_ENTRIES and (self.header is None or self.header[1] != self.digest):
            raise ManifestError(f"{self.key}: a {digests.BY_ENTRIES} digest is its header's", key=self.key)

    @classmethod
    def of(
        cls, key: str, buffers: Sequence[Any], rank: int | None = None, header: tuple[int, str] | None = None
    ) -> ObjectRef:
        """The reference, with the writing algorithm's digest, of an object written as ``buffers`` one after another."""
        return cls(key, sum(memoryview(b).nbytes for b in buffers), digests.hexdigest(buffers), rank, header)

    def verify(self, data: Any) -> bool:
        """Whether ``data`` (bytes-like) is this object: its size and digest, or its header's and entries'."""
        if memoryview(data).nbytes != self.size:
            return False
        if self.algorithm == digests.BY_ENTRIES:
            return intact_by_entries(data, self.header)  # type: ignore[arg-type]
        return digests.matches([data], self.algorithm, self.digest)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "size": self.size, self.algorithm: self.digest}
        if self.rank is not None:
            out["rank"] = self.rank
        if self.header is not None:
            out["header"] = {"size": self.header[0], self.algorithm: self.header[1]}
        return out

    @classmethod
    def from_json(cls, raw: Any) -> ObjectRef:
        if not isinstance(raw, dict):
            raise ManifestError("object reference must be a JSON object")
        what = f"object reference {raw.get('key')!r}"
        found = digests.read(raw, what, ManifestError, digests.OBJECT_ALGORITHMS)
        if found is None:
            raise ManifestError(f"{what} has no digest ({' or '.join(digests.OBJECT_ALGORITHMS)})")
        algorithm, digest = found
        header = raw.get("header")
        if header is not None:
            if not isinstance(header, dict):
                raise ManifestError("object reference 'header' must be a JSON object")
            head = digests.read(header, f"the header reference of {what}", ManifestError, digests.OBJECT_ALGORITHMS)
            if head is None or head[0] != algorithm:
                raise ManifestError(f"the header reference of {what} must carry its object's {algorithm}")
            header = (header.get("size"), head[1])
        return cls(raw.get("key"), raw.get("size"), digest, raw.get("rank"), header, algorithm)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Span:
    """A catch-up span of a version: one delta from an older version ``base`` straight to it (the elements
    changed in between, at their values in the version), written besides the chain of single deltas."""

    base: int
    """The version the span applies to (at least 2 below its version: one below is the ordinary delta)."""
    objects: tuple[ObjectRef, ...]
    """The span's object(s): delta files whose header says ``base_version = base``."""

    @property
    def nbytes(self) -> int:
        return sum(o.size for o in self.objects)

    def to_json(self) -> dict[str, Any]:
        return {"from": self.base, "objects": [o.to_json() for o in self.objects]}

    @classmethod
    def from_json(cls, raw: Any) -> Span:
        if not isinstance(raw, dict):
            raise ManifestError("a span must be a JSON object")
        objects = tuple(ObjectRef.from_json(o) for o in _list(raw.get("objects"), "objects"))
        return cls(_int(raw.get("from"), "from"), objects)


@dataclass(frozen=True, slots=True)
class VersionEntry:
    """One published version: a delta from ``version - 1``, an anchor, or both."""

    version: int
    """Version number; consecutive versions differ by one publish."""
    step: int | None = None
    """Trainer step the weights come from."""
    time: float = 0.0
    """Publish time (seconds since the epoch, the writer's clock)."""
    nnz: int = 0
    """Elements changed since ``version - 1``; all elements for a version first published as an anchor.

    A version keeps its count when retention drops its delta (docs/PROTOCOL.md, "nnz of a version")."""
    delta: tuple[ObjectRef, ...] = ()
    """Delta object(s) from ``version - 1``; empty when only an anchor exists."""
    anchor: tuple[ObjectRef, ...] = ()
    """Anchor object(s): the full weights at ``version``, split in parts."""
    spans: tuple[Span, ...] = ()
    """Catch-up spans to this version from older ones, by ascending length (schema 4)."""
    restores: int | None = None
    """A rollback: this version's weights equal version ``restores``'s, and the versions after that one and
    before this one are retracted (:func:`deltasync.publish.rollback.rollback`)."""

    def __post_init__(self) -> None:
        if not _is_int(self.version, 0, MAX_VERSION):
            raise ManifestError(f"bad version {self.version!r}: a non-negative integer below 2^40")
        if self.step is not None and not _is_int(self.step, 0, MAX_STEP):
            raise ManifestError(f"bad step {self.step!r} of version {self.version}", version=self.version)
        if not _is_int(self.nnz, 0, MAX_COUNT):
            raise ManifestError(f"bad nnz {self.nnz!r} of version {self.version}", version=self.version)
        _check_time(self.time, f"time of version {self.version}")
        if not self.delta and not self.anchor:
            raise ManifestError(f"version {self.version} has neither delta nor anchor", version=self.version)
        if self.delta and self.version == 0:
            raise ManifestError("version 0 cannot be a delta", version=0)
        bases = [span.base for span in self.spans]
        if any(not 0 <= b <= self.version - 2 for b in bases) or bases != sorted(set(bases), reverse=True):
            raise ManifestError(
                f"the spans of version {self.version} must start at least 2 versions below it, each at its own "
                f"version, longest last (from {bases[:5]})", version=self.version,
            )
        if any(not span.objects for span in self.spans):
            raise ManifestError(f"a span of version {self.version} lists no object", version=self.version)
        restores = self.restores
        if restores is not None and not (_is_int(restores, 0, MAX_VERSION) and restores <= self.version - 2):
            raise ManifestError(f"version {self.version} restores {self.restores!r}: a rollback restores a version at "
                                "least 2 below it", version=self.version)

    @property
    def delta_bytes(self) -> int:
        return sum(o.size for o in self.delta)

    @property
    def anchor_bytes(self) -> int:
        return sum(o.size for o in self.anchor)

    @property
    def span_bytes(self) -> int:
        return sum(span.nbytes for span in self.spans)

    def objects(self) -> tuple[ObjectRef, ...]:
        """Every object of the version: delta, anchor and spans."""
        return self.delta + self.anchor + tuple(o for span in self.spans for o in span.objects)

    def with_spans(self, spans: tuple[Span, ...]) -> VersionEntry:
        """A copy with ``spans`` added (kept longest last)."""
        return replace(self, spans=tuple(sorted(self.spans + spans, key=lambda span: -span.base)))

    def span(self, base: int) -> Span | None:
        """The span from ``base`` to this version, if listed."""
        return next((span for span in self.spans if span.base == base), None)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "step": self.step, "time": self.time, "nnz": self.nnz}
        if self.delta:
            out["delta"] = [o.to_json() for o in self.delta]
        if self.anchor:
            out["anchor"] = [o.to_json() for o in self.anchor]
        if self.spans:
            out["spans"] = [span.to_json() for span in self.spans]
        if self.restores is not None:
            out["restores"] = self.restores
        return out

    @classmethod
    def from_json(cls, raw: Any) -> VersionEntry:
        if not isinstance(raw, dict):
            raise ManifestError("version entry must be a JSON object")
        refs = {k: tuple(ObjectRef.from_json(o) for o in _list(raw.get(k, []), k)) for k in ("delta", "anchor")}
        return cls(
            version=_int(raw.get("version"), "version"),
            step=raw.get("step"),
            time=_time(raw.get("time", 0.0), "time"),
            nnz=_int(raw.get("nnz", 0), "nnz"),
            delta=refs["delta"],
            anchor=refs["anchor"],
            spans=tuple(Span.from_json(span) for span in _list(raw.get("spans", []), "spans")),
            restores=None if raw.get("restores") is None else _int(raw.get("restores"), "restores"),
        )


@dataclass(frozen=True, slots=True)
class Manifest:
    """The state of a run prefix."""

    run_id: str
    """Identity of the version chain; a new chain gets a new id."""
    fingerprint: str
    """Model fingerprint every object must carry."""
    numel: int
    """Elements in the model."""
    writer: str
    """Id of the publisher that owns the prefix."""
    lease_until: float
    """Until when ``writer`` holds the prefix without renewing (epoch seconds)."""
    versions: tuple[VersionEntry, ...] = ()
    """Available versions, ascending."""
    retired: tuple[tuple[str, float], ...] = ()
    """Keys dropped from ``versions`` and when; deleted after a grace period."""
    updated: float = 0.0
    """Time of this write."""
    schema: int = 2
    """Schema it was read with (2 for a new manifest); written as the lowest that names every object's algorithm,
    and at least 2 unless it was read at 1."""

    def __post_init__(self) -> None:
        for what in ("run_id", "fingerprint", "writer"):
            value = getattr(self, what)
            if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
                raise ManifestError(f"manifest field {what!r} must be a non-empty string, got {value!r:.80}")
        if not _is_int(self.numel, 0, MAX_COUNT):
            raise ManifestError(f"manifest field 'numel' is out of range: {self.numel!r}")
        _check_time(self.lease_until, "lease_until")
        _check_time(self.updated, "updated")
        numbers = [v.version for v in self.versions]
        if numbers != sorted(set(numbers)):
            raise ManifestError("manifest versions must be strictly increasing")
        if numbers and numbers[-1] - numbers[0] + 1 != len(numbers):  # strictly increasing: no range built
            missing = list(itertools.islice((n for a, b in zip(numbers, numbers[1:]) for n in range(a + 1, b)), 5))
            raise ManifestError(
                f"manifest skips versions {missing} between v{numbers[0]} and v{numbers[-1]}: versions are "
                "consecutive (each one is a delta from the one before)",
                missing=missing,
            )
        if self.versions and not self.versions[0].anchor:
            raise ManifestError("the oldest listed version must have an anchor")
        for entry in self.versions:
            if entry.spans and entry.spans[-1].base < numbers[0]:
                raise ManifestError(
                    f"version {entry.version} lists a span from v{entry.spans[-1].base}, older than the oldest "
                    f"listed version v{numbers[0]} (spans are retired with their chain)", version=entry.version,
                )
        for entry in self.versions:
            if entry.nnz > self.numel:
                raise ManifestError(
                    f"version {entry.version} claims {entry.nnz} changed elements of a {self.numel}-element model",
                    version=entry.version,
                )
        keys = [o.key for v in self.versions for o in v.objects()]
        if len(keys) != len(set(keys)):
            twice = sorted({k for k in keys if keys.count(k) > 1})
            raise ManifestError(f"manifest names object {twice[0]!r} twice", key=twice[0])
        retired = {k for k, _ in self.retired}
        for key, when in self.retired:
            check_key(key)
            _check_time(when, f"retirement time of {key}")
        if retired & set(keys):
            raise ManifestError(f"object {sorted(retired & set(keys))[0]!r} is both retired and in use")

    @property
    def latest(self) -> int | None:
        """Newest version, or ``None`` before the first publish."""
        return self.versions[-1].version if self.versions else None

    def entry(self, version: int) -> VersionEntry | None:
        """The entry of ``version`` if listed."""
        for v in reversed(self.versions):
            if v.version == version:
                return v
        return None

    def anchors(self) -> list[VersionEntry]:
        """Versions that have an anchor, ascending."""
        return [v for v in self.versions if v.anchor]

    def retracted(self) -> set[int]:
        """Versions a later rollback took back (:attr:`VersionEntry.restores`): listed, never rewritten."""
        return {v for e in self.versions if e.restores is not None for v in range(e.restores + 1, e.version)}

    def amended(self, version: int, change: Callable[[VersionEntry], VersionEntry]) -> Manifest:
        """A copy with the entry of ``version`` replaced by ``change(entry)`` (an anchor or spans added)."""
        return replace(self, versions=tuple(change(e) if e.version == version else e for e in self.versions))

    def with_version(self, entry: VersionEntry, *, now: float, lease_s: float) -> Manifest:
        """A copy with ``entry`` appended and the lease renewed."""
        if self.latest is not None and entry.version <= self.latest:
            raise ManifestError(f"version {entry.version} does not follow {self.latest}", version=entry.version)
        return replace(self, versions=self.versions + (entry,), updated=now, lease_until=now + lease_s)

    def to_bytes(self) -> bytes:
        # The lowest schema that names every object's algorithm: an older reader says "upgrade" instead of failing.
        body = {
            "format": FORMAT,
            "schema": max(_schema_needed(self.versions), min(self.schema, 2)),
            "run_id": self.run_id,
            "fingerprint": self.fingerprint,
            "numel": self.numel,
            "writer": self.writer,
            "lease_until": self.lease_until,
            "updated": self.updated,
            "latest": self.latest,
            "versions": [v.to_json() for v in self.versions],
            "retired": [[k, t] for k, t in self.retired],
        }
        return json.dumps(body).encode()  # one line: the C encoder, several times faster

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse and validate a manifest.

        Raises:
            `ManifestError`: malformed JSON, unknown schema, unsafe keys, versions out of order.
        """
        raw = load_json(data, what="manifest", error=ManifestError)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ManifestError("not a deltasync manifest (missing format 'deltasync-manifest')")
        schema = raw.get("schema")
        if not _is_int(schema, 1, SCHEMA + 1):
            raise ManifestError(f"manifest schema {schema!r} is not supported; upgrade deltasync")
        try:
            retired = tuple(_retired(item) for item in _list(raw.get("retired", []), "retired"))
            manifest = cls(
                run_id=raw["run_id"],
                fingerprint=raw["fingerprint"],
                numel=_int(raw["numel"], "numel"),
                writer=raw["writer"],
                lease_until=_time(raw.get("lease_until", 0.0), "lease_until"),
                versions=tuple(VersionEntry.from_json(v) for v in _list(raw.get("versions", []), "versions")),
                retired=retired,
                updated=_time(raw.get("updated", 0.0), "updated"),
                schema=schema,
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ManifestError(f"malformed manifest: {exc!r}") from None
        if "latest" in raw and (raw["latest"] != manifest.latest or type(raw["latest"]) not in (int, type(None))):
            raise ManifestError(
                f"manifest says latest is {raw['latest']!r:.40} but lists versions up to {manifest.latest}"
            )
        if schema < _schema_needed(manifest.versions):  # a reader of that schema would misread a reference
            raise ManifestError(
                f"manifest schema {schema} lists digests of schema {_schema_needed(manifest.versions)}"
            )
        return manifest


def _schema_needed(versions: Iterable[VersionEntry]) -> int:
    """The lowest schema that names every object of ``versions``: spans 4; else by digest, ``sha256`` 1,
    ``blake3`` 2, ``blake3-entries`` 3. A reader of an older schema says "upgrade" instead of ignoring spans
    (its gc would take their objects for orphans)."""
    versions = tuple(versions)
    if any(v.spans for v in versions):
        return SPANS_SCHEMA
    algorithms = {ref.algorithm for v in versions for ref in v.objects()}
    return 3 if digests.BY_ENTRIES in algorithms else 2 if algorithms - {"sha256"} else 1


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"manifest field {what!r} must be a list")
    return value


def _is_int(value: Any, low: int, high: int) -> bool:
    """Whether ``value`` is a real integer (not a bool) in ``[low, high)``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _int(value: Any, what: str) -> int:
    if not _is_int(value, 0, MAX_COUNT):
        raise ManifestError(f"manifest field {what!r} must be a non-negative integer below 2^53, got {value!r:.40}")
    return value  # type: ignore[no-any-return]


def _check_time(value: Any, what: str) -> None:
    """Epoch seconds: a finite number in ``[0, MAX_EPOCH_S]`` (a NaN lease would compare false both ways)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_EPOCH_S:
        raise ManifestError(f"manifest field {what!r} must be epoch seconds in [0, 2^36], got {value!r:.40}")


def _time(value: Any, what: str) -> float:
    _check_time(value, what)
    return float(value)


def _retired(item: Any) -> tuple[str, float]:
    if not isinstance(item, list) or len(item) != 2:
        raise ManifestError("manifest field 'retired' holds [key, time] pairs")
    return check_key(item[0]), _time(item[1], "retired time")


@dataclass(frozen=True, slots=True)
class Step:
    """One hop of a plan: apply ``objects`` to reach ``version``."""

    version: int
    kind: Literal["delta", "anchor"]
    """What the objects' headers say they are (a span's objects are deltas)."""
    objects: tuple[ObjectRef, ...]
    base: int | None = None
    """The version a delta applies to: ``version - 1``, or further back for a span; ``None`` for an anchor."""

    def __post_init__(self) -> None:
        if self.kind == "delta" and self.base is None:
            object.__setattr__(self, "base", self.version - 1)

    @property
    def nbytes(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def label(self) -> str:
        """``"anchor"``, ``"delta"`` or ``"span"`` (a delta from further back than one version)."""
        return "span" if self.kind == "delta" and self.base != self.version - 1 else self.kind


@dataclass(frozen=True, slots=True)
class Plan:
    """The cheapest route from a replica's version to a target version."""

    start: int | None
    """The replica's version (``None``: no weights from this run yet)."""
    target: int
    """The version the plan ends at."""
    steps: tuple[Step, ...] = field(default_factory=tuple)
    """Hops in order; empty when already at ``target``."""

    @property
    def nbytes(self) -> int:
        """Bytes to download."""
        return sum(s.nbytes for s in self.steps)


def plan_route(
    manifest: Manifest, current: int | None, *, avoid: Iterable[str] = (), target: int | None = None
) -> Plan | None:
    """Cheapest route (fewest bytes, then fewest objects) from ``current`` to ``target`` (the latest version by
    default).

    A route starts at ``current`` or at an anchor after it (at or before the target) and moves forward by deltas
    (one version) and spans (from a span's base to its version). A target behind ``current`` is reached the only
    way files allow: again from an anchor at or before it. Objects in ``avoid`` (keys that failed verification)
    are never used.

    Returns:
        `Plan`, or ``None`` when the target is unreachable: no usable anchor, or a target the manifest does
        not list.
    """
    latest = manifest.latest if target is None else target
    if latest is None or manifest.latest is None or manifest.entry(latest) is None:
        return None
    if current == latest:
        return Plan(current, latest)
    bad = set(avoid)
    usable = lambda refs: bool(refs) and not any(o.key in bad for o in refs)  # noqa: E731
    # Hops out of each version: the delta to the next one, and every span that starts there.
    hops: dict[int, list[Step]] = {}
    for entry in manifest.versions:
        if entry.version > latest:
            break
        if usable(entry.delta):
            hops.setdefault(entry.version - 1, []).append(Step(entry.version, "delta", entry.delta))
        for span in entry.spans:
            if usable(span.objects):
                hops.setdefault(span.base, []).append(Step(entry.version, "delta", span.objects, span.base))
    # Shortest paths over versions (Dijkstra on (bytes, objects)); sources: ``current`` and the anchors after it.
    best: set[int] = set()
    order = itertools.count()  # equal costs: the route found first (from the replica's version before anchors)
    queue: list[tuple[tuple[int, int], int, int, tuple[Step, ...]]] = []
    if current is not None and current < latest:
        queue.append(((0, 0), next(order), current, ()))
    for entry in manifest.anchors():
        if entry.version > latest:
            break  # anchors come in version order: the rest lie past the target
        if current is not None and current <= latest and entry.version <= current:
            continue  # never go back to an anchor older than the weights we hold
        if usable(entry.anchor):
            step = Step(entry.version, "anchor", entry.anchor)
            queue.append(((step.nbytes, len(step.objects)), next(order), entry.version, (step,)))
    heapq.heapify(queue)
    while queue:
        cost, _, version, route = heapq.heappop(queue)
        if version in best:
            continue
        best.add(version)
        if version == latest:
            return Plan(current, latest, route)
        for step in hops.get(version, ()):
            if step.version <= latest and step.version not in best:
                heapq.heappush(queue, ((cost[0] + step.nbytes, cost[1] + len(step.objects)), next(order),
                                       step.version, (*route, step)))
    return None


def plan_retention(manifest: Manifest, *, keep_anchors: int, now: float) -> Manifest:
    """Drop versions older than the ``keep_anchors``-th newest anchor.

    Every replica can still reach the latest version from any kept anchor, and
    from any kept version by deltas. Spans from a dropped version go with it.
    Dropped objects go to ``retired`` and are
    deleted by :func:`deletable` after :data:`RETIRE_GRACE_S`.
    """
    anchors = manifest.anchors()
    if keep_anchors < 1:
        raise ValueError("keep_anchors must be at least 1")
    if len(anchors) <= keep_anchors:
        return manifest
    oldest_kept = anchors[-keep_anchors].version
    kept, dropped = [], []
    for entry in manifest.versions:
        (kept if entry.version >= oldest_kept else dropped).append(entry)
    if kept and kept[0].delta:  # the new oldest version is reached by its anchor only
        first = kept[0]
        dropped.append(VersionEntry(first.version, delta=first.delta))
        kept[0] = replace(first, delta=())
    objects = [o for e in dropped for o in e.objects()]
    for i, entry in enumerate(kept):  # spans are retired with the chain they start from
        if any(span.base < oldest_kept for span in entry.spans):
            objects += [o for span in entry.spans if span.base < oldest_kept for o in span.objects]
            kept[i] = replace(entry, spans=tuple(span for span in entry.spans if span.base >= oldest_kept))
    retired = manifest.retired + tuple((o.key, now) for o in objects)
    return replace(manifest, versions=tuple(kept), retired=retired)


def deletable(manifest: Manifest, *, now: float, grace: float = RETIRE_GRACE_S) -> tuple[list[str], Manifest]:
    """Retired keys whose grace period is over, and the manifest without them."""
    due = [k for k, t in manifest.retired if now - t >= grace]
    keep = tuple((k, t) for k, t in manifest.retired if now - t < grace)
    return due, replace(manifest, retired=keep)


def referenced_keys(manifest: Manifest) -> set[str]:
    """Every key the manifest still needs or will delete itself."""
    keys = {o.key for v in manifest.versions for o in v.objects()}
    return keys | {k for k, _ in manifest.retired}


def new_manifest(*, run_id: str, fingerprint: str, numel: int, writer: str, lease_s: float) -> Manifest:
    """An empty manifest for a fresh run."""
    now = time.time()
    return Manifest(run_id, fingerprint, numel, writer, now + lease_s, updated=now)


def summarize(manifest: Manifest) -> Mapping[str, Any]:
    """Counts and sizes for status displays."""
    return {
        "versions": len(manifest.versions),
        "latest": manifest.latest,
        "anchors": [v.version for v in manifest.anchors()],
        "delta_bytes": sum(v.delta_bytes for v in manifest.versions),
        "anchor_bytes": sum(v.anchor_bytes for v in manifest.versions),
        "span_bytes": sum(v.span_bytes for v in manifest.versions),
    }
