"""Replica side, one route at a time: download, verify and decode the objects of a plan.

A :class:`Fetcher` serves one :class:`~deltasync.replica.subscriber.Subscriber`. It
downloads a route's objects in parallel, never reading more than the manifest
promises (an endless or oversized object costs nothing), checks each one's size
and SHA-256, then, per version, checks every header against the replica and
against what the manifest claims (version, kind, base) and decodes everything,
so the subscriber hands its applier only patches that were fully validated
(invariant 4).

Refusals stick to the *claim*: an object as one manifest lists it (its ref,
version and kind). A forged manifest that mislabels a good object cannot spoil
that object for the repaired manifest. Objects whose content fails validation
are avoided for good under that claim; objects whose transfer failed
:data:`BAD_AFTER` times are avoided for :data:`BAD_RETRY_S`, then tried again.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..codec import Decoded
from ..errors import DeltaFormatError, DeltaSyncError, IntegrityError, VersionError
from ..format import MAX_HEADER_BYTES, Header, combine, decode, decode_entries, digests, read_header
from ..format.check import verified_header
from ..protocol.manifest import Manifest, ObjectRef, Plan, Step
from ..stores import Store
from ..tensors import describe_differences
from ..util.collector import collector_paused
from .applier import Applier
from .ranged import Fetched, can_read_ranges, fetch_tensors

__all__ = ["Fetcher", "BAD_AFTER", "BAD_RETRY_S"]

logger = logging.getLogger("deltasync.subscriber")

BAD_AFTER = 3  # hash/size failures of one object before routes avoid it
# Routes avoid an object that failed BAD_AFTER transfers for this long, then try it again
# (a flaky link heals; an object that fails validation is avoided for good).
BAD_RETRY_S = 120.0
MAX_ANCHOR_PARTS_READ = 64  # anchor parts whose headers explain a model mismatch: enough to name what differs

# An object as one manifest lists it: its ref, version and kind (``None, None``: any listing).
_Claim = tuple[ObjectRef, int | None, str | None]


class Fetcher:
    """Downloads and vets the objects of a replica's routes.

    Args:
        store (`Store`): the run prefix.
        applier (`Applier`): the replica's weights: what headers are checked against, and
            where base-relative codecs read the current bit patterns.
        workers (`int`): parallel downloads.
    """

    def __init__(
        self, store: Store, applier: Applier, *, workers: int, only: Callable[[str], bool] | None = None
    ) -> None:
        self.store, self.applier, self.only = store, applier, only
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deltasync-fetch")
        self._bad: dict[_Claim, float] = {}  # claim -> monotonic time until which routes avoid it
        self._failures: Counter[ObjectRef] = Counter()
        self._mismatch: tuple[str, str] | None = None  # (fingerprint, what differs), explained once
        # Headers parsed to check objects by their entries, by the manifest's (size, digest) of the header:
        # check() takes them instead of parsing again (an object that passed has exactly those header bytes).
        self._parsed: dict[tuple[int, str], Header] = {}

    def close(self) -> None:
        """Stop the download threads (waits for downloads in flight)."""
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ downloads

    def avoided(self, manifest: Manifest) -> set[str]:
        """Keys of ``manifest`` that routes must not use now."""
        now = time.monotonic()
        out = set()
        for entry in manifest.versions:
            listed = [("delta", entry.delta), ("anchor", entry.anchor), *(("delta", s.objects) for s in entry.spans)]
            for kind, refs in listed:
                for ref in refs:
                    claims = ((ref, entry.version, kind), (ref, None, None))
                    if any(self._bad.get(claim, 0.0) > now for claim in claims):
                        out.add(ref.key)
        return out

    def prefetch(self, plan: Plan) -> dict[str, Future[bytes | memoryview | Fetched]]:
        """Start downloading every object of ``plan``; results by key (verified on completion).

        With ``only``, objects whose manifest reference allows it are read by range:
        just the selected tensors (:mod:`deltasync.replica.ranged`).
        """
        self._parsed = {}  # one plan's at most
        return {
            ref.key: self._pool.submit(self._download_ranged if self._ranged(ref) else self._download, ref)
            for s in plan.steps
            for ref in s.objects
        }

    def release(self, held: list[Any]) -> None:
        """Drop ``held`` (fetched objects, and what views them) on a download thread, once the caller holds
        no other reference. Returning a large anchor's memory is work of its own (unmapping its parts costs a
        fair share of loading them) that an update need not wait for. Once
        :meth:`close` has begun, the caller's thread drops them: the update it finishes stands."""
        try:
            self._pool.submit(held.clear)
        except RuntimeError:  # shut down
            held.clear()

    def _ranged(self, ref: ObjectRef) -> bool:
        return self.only is not None and can_read_ranges(ref)

    def _download(self, ref: ObjectRef) -> bytes | memoryview:
        try:
            data = self.store.get_buffer(ref.key, max_bytes=ref.size)
        except IntegrityError:
            data = b""  # larger than promised: counted below like any other mismatch
        if ref.algorithm == digests.BY_ENTRIES:  # checked by its entries: the header parsed on the way is kept
            with collector_paused():  # tens of thousands of header objects kept: no collector walks amid them
                parsed = verified_header(data, ref.header) if memoryview(data).nbytes == ref.size else None
            if parsed is not None and ref.header is not None:
                self._parsed[ref.header] = parsed
                return data
        elif ref.verify(data):
            return data
        self._count_failure(ref)
        raise IntegrityError(
            f"{ref.key}: {len(data)} bytes with a different hash than the manifest promises "
            f"({ref.size} bytes); object refused",
            key=ref.key,
        )

    def _download_ranged(self, ref: ObjectRef) -> Fetched:
        assert self.only is not None
        try:
            return fetch_tensors(self.store, ref, self.only)
        except IntegrityError:
            self._count_failure(ref)
            raise

    def _count_failure(self, ref: ObjectRef) -> None:
        """A truncated transfer may succeed next time; a third failure marks the object bad."""
        self._failures[ref] += 1
        if self._failures[ref] >= BAD_AFTER:
            self._failures[ref] = 0
            self._bad[(ref, None, None)] = time.monotonic() + BAD_RETRY_S

    # ------------------------------------------------------------------ checks

    def check_and_decode(
        self, step: Step, blobs: list[bytes | memoryview | Fetched], previous_version: int | None
    ) -> dict[str, Decoded]:
        """Validate every file of one version against the replica and the manifest's claim, and
        decode it all (or the tensors range-read from it); nothing is written. Refused objects
        are avoided under this claim."""
        return self.decode_checked(step, blobs, self.check(step, blobs, previous_version))

    def check(
        self, step: Step, blobs: list[bytes | memoryview | Fetched], previous_version: int | None
    ) -> list[Header]:
        """The first half of :meth:`check_and_decode`: every file's header, validated against the replica
        and the manifest's claim (an anchor carries every tensor); refused objects are avoided."""
        headers = [self._header_of(ref, b) for ref, b in zip(step.objects, blobs)]
        for ref, header in zip(step.objects, headers):
            try:
                self.applier.validate(header)
                _check_claim(ref, header, step, previous_version)
            except DeltaSyncError:
                self._refuse(step, ref)
                raise
        if step.kind == "anchor" and {n for h in headers for n in h.tensors} != set(self.applier.specs):
            self._refuse(step, *step.objects)
            raise DeltaFormatError(f"anchor v{step.version} does not carry every tensor")
        return headers

    def _header_of(self, ref: ObjectRef, blob: bytes | memoryview | Fetched) -> Header:
        """A downloaded object's header: a range read's, the one parsed as the object was checked by its
        entries (:meth:`_download`), or parsed now."""
        if isinstance(blob, Fetched):
            return blob.header
        parsed = self._parsed.pop(ref.header, None) if ref.algorithm == digests.BY_ENTRIES and ref.header else None
        return parsed if parsed is not None else read_header(blob)

    def decode_checked(
        self, step: Step, blobs: list[bytes | memoryview | Fetched], headers: list[Header]
    ) -> dict[str, Decoded]:
        """The second half of :meth:`check_and_decode`: decode the files :meth:`check` passed."""
        parts = []
        on_device = self.applier.on_device  # a receiver on an accelerator: rebuild there
        for ref, blob, header in zip(step.objects, blobs, headers):
            try:
                if isinstance(blob, Fetched):
                    parts.append((header, decode_entries(header, blob.entries, base=self.applier.lookup,
                                                         names=blob.names, on_device=on_device)))
                else:
                    parts.append(decode(blob, base=self.applier.lookup, header=header, on_device=on_device))
            except DeltaSyncError:
                self._refuse(step, ref)
                raise
        try:
            # One file per tensor, or a trainer's shards: each element carried at most once,
            # and an anchor carries all of them.
            return combine(parts, whole=step.kind == "anchor")
        except DeltaSyncError:
            self._refuse(step, *step.objects)
            raise

    def refuse(self, step: Step) -> None:
        """Never use ``step``'s objects again as it lists them: a replica that decodes them itself refused them."""
        self._refuse(step, *step.objects)

    def _refuse(self, step: Step, *refs: ObjectRef) -> None:
        """Never use these objects again as ``step`` lists them: their content failed validation."""
        for ref in refs:
            self._bad[(ref, step.version, step.kind)] = math.inf

    # ------------------------------------------------------------------ explaining a refusal

    def explain_mismatch(self, manifest: Manifest) -> str:
        """What differs between the run's model and the replica's, from the newest anchor's headers.

        Read once per run fingerprint, by range (two small reads per part); best effort.
        """
        if self._mismatch is not None and self._mismatch[0] == manifest.fingerprint:
            return self._mismatch[1]
        anchors = manifest.anchors()
        text = f"fingerprint {manifest.fingerprint} there, {self.applier.fingerprint} here"
        if anchors:
            try:
                parts = anchors[-1].anchor[:MAX_ANCHOR_PARTS_READ]
                specs = [e.spec for ref in parts for e in self._header(ref).tensors.values()]
                text = describe_differences(specs, self.applier.specs.values())
            except DeltaSyncError as exc:  # the explanation is best effort; the refusal stands
                logger.debug("could not read the run's anchor to explain a mismatch: %s", exc)
        self._mismatch = (manifest.fingerprint, text)
        return text

    def _header(self, ref: ObjectRef) -> Header:
        length = int.from_bytes(self.store.get_range(ref.key, 0, 8), "little")
        if not 0 < length <= min(MAX_HEADER_BYTES, ref.size - 8):
            raise DeltaFormatError(f"{ref.key}: header length {length} out of range", key=ref.key)
        return read_header(self.store.get_range(ref.key, 0, 8 + length))


def _check_claim(ref: ObjectRef, header: Header, step: Step, previous_version: int | None) -> None:
    """The file is what the manifest says it is: version, kind, and for a delta the base held here."""
    if header.version != step.version or header.kind != step.kind:
        raise VersionError(
            f"{ref.key} holds {header.kind} v{header.version}, manifest says {step.kind} v{step.version}",
            key=ref.key,
        )
    if step.kind == "delta" and header.base_version != step.base:
        raise VersionError(
            f"{ref.key} applies to v{header.base_version}, manifest says v{step.base}", key=ref.key,
        )
    if step.kind == "delta" and header.base_version != previous_version:
        raise VersionError(
            f"{ref.key} applies to v{header.base_version}, replica holds v{previous_version}",
            key=ref.key,
        )
