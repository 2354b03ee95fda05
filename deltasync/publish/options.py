"""A publisher's options: their defaults, and the one place that refuses ones that cannot work.

:class:`PublishOptions` holds them for both publishers; :func:`check_options` runs when one is made,
in the publisher's constructor, before anything is read or written, and names the argument to fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..codec import DEFAULT_CODEC, codec_names
from ..errors import ConfigError
from ..format import ANCHOR_VERSION, DEFAULT_LEVEL, FORMAT_VERSION
from ..protocol.manifest import RETIRE_GRACE_S
from ..tensors import check_cast_dtype
from ..util.checks import check_int, check_number
from .spans import MAX_SPAN

__all__ = [
    "ANCHOR_EVERY", "ANCHOR_RATIO", "KEEP_ANCHORS", "MAX_SPAN", "PART_BYTES", "LEASE_S", "RETIRE_GRACE_S",
    "PublishOptions",
    "check_options",
]

ANCHOR_EVERY = 100  # versions; the public TRL prototype anchors every 10 syncs, adaptive anchors cover drift
ANCHOR_RATIO = 1.0  # deltas since the last anchor may add up to one anchor: catch-up <= 2 anchors of bytes
KEEP_ANCHORS = 2  # the newest anchor and the one before, so a replica mid-catch-up is never stranded
PART_BYTES = 64 << 20  # anchor part size: parts encode, hash, upload and verify in parallel (see device_sync.py)
LEASE_S = 600.0  # a writer that stops publishing for this long can be taken over

ZSTD_MIN_LEVEL, ZSTD_MAX_LEVEL = -(1 << 17), 22  # zstd's own bounds (ZSTD_minCLevel, ZSTD_maxCLevel)


def check_options(
    *, codec: str, level: int, dtype: torch.dtype | None, anchor_every: int, anchor_ratio: float,
    keep_anchors: int, part_bytes: int, lease_s: float, retire_grace_s: float, chunk: int | None,
    on_publish: Callable[..., object] | None, format_version: int = FORMAT_VERSION, max_span: int = MAX_SPAN,
) -> None:
    """Refuse options that cannot work, naming the argument, before anything is read or written.

    Raises:
        `ConfigError`: an option is out of range or of the wrong type (``argument`` names it).
    """
    if codec not in codec_names() or codec == "dense":
        sparse = [c for c in codec_names() if c != "dense"]
        raise ConfigError(f"unknown codec {codec!r}; choose one of {sparse}", argument="codec")
    if dtype is not None:
        check_cast_dtype(dtype)
    check_int("level", level, low=ZSTD_MIN_LEVEL, high=ZSTD_MAX_LEVEL)
    for name, value in (("anchor_every", anchor_every), ("keep_anchors", keep_anchors), ("part_bytes", part_bytes)):
        check_int(name, value, low=1)
    check_int("max_span", max_span, low=0)
    if chunk is not None:  # None: the diff's default for the weights' device
        check_int("chunk", chunk, low=1)
    check_number("anchor_ratio", anchor_ratio)
    check_number("lease_s", lease_s)
    check_number("retire_grace_s", retire_grace_s, zero_ok=True)
    # Deltas of format 3 (ANCHOR_VERSION) stay readable by replicas that do not read format 4.
    check_int("format_version", format_version, low=ANCHOR_VERSION, high=FORMAT_VERSION)
    if on_publish is not None and not callable(on_publish):
        raise ConfigError(f"on_publish must be callable, got {type(on_publish).__name__}", argument="on_publish")


@dataclass(frozen=True, slots=True)
class PublishOptions:
    """Every option a publisher takes besides its model and store (see :class:`~deltasync.Publisher`),
    checked when made."""

    codec: str = DEFAULT_CODEC
    """Codec for sparse tensors."""
    level: int = DEFAULT_LEVEL
    """zstd level."""
    dtype: torch.dtype | None = torch.bfloat16
    """Published dtype (``None``: each tensor's own)."""
    anchor_every: int = ANCHOR_EVERY
    """Anchor at least every this many versions."""
    anchor_ratio: float = ANCHOR_RATIO
    """Anchor when the deltas since the last anchor exceed this fraction of it."""
    keep_anchors: int = KEEP_ANCHORS
    """Anchors (and the versions after them) kept by retention."""
    part_bytes: int = PART_BYTES
    """Size of an anchor's parts."""
    lease_s: float = LEASE_S
    """How long each manifest write holds the prefix."""
    retire_grace_s: float = RETIRE_GRACE_S
    """How long objects dropped by retention stay in the store."""
    takeover: bool = False
    """Take the prefix over even if another writer's lease is live."""
    chunk: int | None = None
    """Elements the diff compares per step (``None``: the default for the weights' device)."""
    format_version: int = FORMAT_VERSION
    """File format of deltas."""
    max_span: int = MAX_SPAN
    """Longest catch-up span, in versions (0 or 1: none; sharded publishers write none)."""
    on_publish: Callable[..., object] | None = None
    """Called with each committed version's ``PublishInfo``."""

    def __post_init__(self) -> None:
        check_options(
            codec=self.codec, level=self.level, dtype=self.dtype, anchor_every=self.anchor_every,
            anchor_ratio=self.anchor_ratio, keep_anchors=self.keep_anchors, part_bytes=self.part_bytes,
            lease_s=self.lease_s, retire_grace_s=self.retire_grace_s, chunk=self.chunk, on_publish=self.on_publish,
            format_version=self.format_version, max_span=self.max_span,
        )

    @classmethod
    def split(cls, options: dict[str, Any]) -> tuple[PublishOptions, dict[str, Any]]:
        """The publisher's options among ``options``, checked, and the rest (the store's)."""
        names = {f.name for f in fields(cls)}
        mine = {k: v for k, v in options.items() if k in names}
        return cls(**mine), {k: v for k, v in options.items() if k not in names}
