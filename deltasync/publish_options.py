"""A publisher's options: their defaults, and the one place that refuses ones that cannot work.

:func:`check_options` runs in the constructor of
:class:`~deltasync.publisher.Publisher` before anything is read or written, and
names the argument to fix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .codec import codec_names
from .errors import ConfigError
from .format import ANCHOR_VERSION, FORMAT_VERSION
from .options import check_int, check_number
from .tensors import dtype_name

__all__ = ["ANCHOR_EVERY", "ANCHOR_RATIO", "KEEP_ANCHORS", "PART_BYTES", "LEASE_S", "check_options"]

ANCHOR_EVERY = 100  # versions; the public TRL prototype anchors every 10 syncs, adaptive anchors cover drift
ANCHOR_RATIO = 1.0  # deltas since the last anchor may add up to one anchor: catch-up <= 2 anchors of bytes
KEEP_ANCHORS = 2  # the newest anchor and the one before, so a replica mid-catch-up is never stranded
PART_BYTES = 64 << 20  # anchor part size: parts encode, hash, upload and verify in parallel (see device_sync.py)
LEASE_S = 600.0  # a writer that stops publishing for this long can be taken over

ZSTD_MIN_LEVEL, ZSTD_MAX_LEVEL = -(1 << 17), 22  # zstd's own bounds (ZSTD_minCLevel, ZSTD_maxCLevel)


def check_options(
    *, codec: str, level: int, dtype: torch.dtype | None, anchor_every: int, anchor_ratio: float,
    keep_anchors: int, part_bytes: int, lease_s: float, retire_grace_s: float, chunk: int | None,
    on_publish: Callable[..., object] | None, format_version: int = FORMAT_VERSION,
) -> None:
    """Refuse options that cannot work, naming the argument, before anything is read or written.

    Raises:
        `ConfigError`: an option is out of range or of the wrong type (``argument`` names it).
    """
    if codec not in codec_names() or codec == "dense":
        sparse = [c for c in codec_names() if c != "dense"]
        raise ConfigError(f"unknown codec {codec!r}; choose one of {sparse}", argument="codec")
    if dtype is not None:
        dtype_name(dtype)  # bf16, fp16 or fp32
    check_int("level", level, low=ZSTD_MIN_LEVEL, high=ZSTD_MAX_LEVEL)
    for name, value in (("anchor_every", anchor_every), ("keep_anchors", keep_anchors), ("part_bytes", part_bytes)):
        check_int(name, value, low=1)
    if chunk is not None:  # None: the diff's default for the weights' device
        check_int("chunk", chunk, low=1)
    check_number("anchor_ratio", anchor_ratio)
    check_number("lease_s", lease_s)
    check_number("retire_grace_s", retire_grace_s, zero_ok=True)
    # Deltas of format 3 (ANCHOR_VERSION) keep replicas of the release before format 4 reading.
    check_int("format_version", format_version, low=ANCHOR_VERSION, high=FORMAT_VERSION)
    if on_publish is not None and not callable(on_publish):
        raise ConfigError(f"on_publish must be callable, got {type(on_publish).__name__}", argument="on_publish")
