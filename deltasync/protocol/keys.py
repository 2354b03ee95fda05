"""Where objects live in a store: the key layout of a run prefix, defined once.

A run prefix holds the manifest (the commit point), version objects and
replica acks::

    manifest.json
    retired.json
    deltas/<version:010d>-<writer:8>-<random:4>[-r<rank:05d>].safetensors
    anchors/<version:010d>-<writer:8>-<random:4>[-r<rank:05d>]-part<part:04d>.safetensors
    spans/<version:010d>-from<base:010d>-<writer:8>-<random:4>.safetensors
    acks/<replica>.json

``<writer>`` is the first 8 hex digits of the uploading publisher's writer id
(the manifest records rank 0's; each rank of a sharded run has its own), so a
key says whose it is: a trainer restarted after a crash publishes version 108
under its own id, never mistaken for the dead one's uncommitted 108.
``<random>`` makes a key unique even when one writer uploads a version twice (a
retried upload). Keys of older writers have 8 random hex digits in place of
``<writer>``; readers never parse keys (they take them from the manifest), so
both kinds coexist. ``-r<rank>`` names the rank of a sharded trainer that
uploaded the object. Keys are ``/``-separated paths relative to the run prefix;
:func:`~deltasync.stores.check_key` refuses anything that could escape it.
"""

from __future__ import annotations

import uuid

__all__ = [
    "MANIFEST_KEY",
    "RETIRED_KEY",
    "DELTAS",
    "ANCHORS",
    "SPANS",
    "ACKS",
    "VERSION_PREFIXES",
    "delta_key",
    "anchor_prefix",
    "anchor_part_key",
    "span_key",
    "ack_key",
    "writer_suffix",
]

MANIFEST_KEY = "manifest.json"
"""The manifest's key: the one object that is rewritten, and the commit point."""
RETIRED_KEY = "retired.json"
"""Objects retention dropped, waiting out their grace period (:mod:`deltasync.protocol.retired`); writers and gc
read it."""
DELTAS = "deltas/"
"""Prefix of delta objects."""
ANCHORS = "anchors/"
"""Prefix of anchor parts."""
SPANS = "spans/"
"""Prefix of catch-up spans (deltas from further back than the previous version)."""
ACKS = "acks/"
"""Prefix of replica acks (rewritten by their replicas)."""
VERSION_PREFIXES = (DELTAS, ANCHORS, SPANS)
"""Prefixes of version objects: immutable once written, named by a manifest or orphaned."""

OBJECT_SUFFIX = ".safetensors"
SUFFIX_HEX = 8  # random hex digits in a version object's key

def writer_suffix(writer: str) -> str:
    """A key suffix naming ``writer`` (its first 8 characters) plus 4 random hex digits."""
    return f"{writer[:SUFFIX_HEX]}-{uuid.uuid4().hex[:4]}"


def _version_stem(prefix: str, version: int, rank: int | None, suffix: str | None) -> str:
    suffix = uuid.uuid4().hex[:SUFFIX_HEX] if suffix is None else suffix
    shard = "" if rank is None else f"-r{rank:05d}"
    return f"{prefix}{version:010d}-{suffix}{shard}"


def delta_key(version: int, *, rank: int | None = None, suffix: str | None = None) -> str:
    """The key of a new delta object of ``version``.

    Args:
        version (`int`): the version the delta leads to.
        rank (`int`, *optional*): the uploading rank of a sharded trainer.
        suffix (`str`, *optional*, defaults to 8 random hex digits): what makes the key unique.

    Returns:
        `str`: e.g. ``"deltas/0000000007-1a2b3c4d.safetensors"``.
    """
    return _version_stem(DELTAS, version, rank, suffix) + OBJECT_SUFFIX


def anchor_prefix(version: int, *, rank: int | None = None, suffix: str | None = None) -> str:
    """The common stem of the parts of a new anchor of ``version`` (see :func:`anchor_part_key`).

    Args:
        version (`int`): the version the anchor holds.
        rank (`int`, *optional*): the uploading rank of a sharded trainer.
        suffix (`str`, *optional*, defaults to 8 random hex digits): what makes the keys unique.

    Returns:
        `str`: e.g. ``"anchors/0000000007-1a2b3c4d"``.
    """
    return _version_stem(ANCHORS, version, rank, suffix)


def anchor_part_key(prefix: str, part: int) -> str:
    """The key of part ``part`` of the anchor whose stem is ``prefix`` (from :func:`anchor_prefix`).

    Returns:
        `str`: e.g. ``"anchors/0000000007-1a2b3c4d-part0000.safetensors"``.
    """
    return f"{prefix}-part{part:04d}{OBJECT_SUFFIX}"


def span_key(version: int, base: int, *, suffix: str | None = None) -> str:
    """The key of a new catch-up span from ``base`` to ``version``.

    Returns:
        `str`: e.g. ``"spans/0000000008-from0000000004-1a2b3c4d-9f0e.safetensors"``.
    """
    suffix = uuid.uuid4().hex[:SUFFIX_HEX] if suffix is None else suffix
    return f"{SPANS}{version:010d}-from{base:010d}-{suffix}{OBJECT_SUFFIX}"


def ack_key(replica_id: str) -> str:
    """The key a replica writes its ack to, e.g. ``"acks/replica-1.json"``."""
    return f"{ACKS}{replica_id}.json"
