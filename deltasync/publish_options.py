"""A publisher's options: their defaults, and the one place that refuses ones that cannot work.

:func:`check_options` runs in the constructor of
:class:`~deltasync.publisher.Publisher` before anything is read or written, and
names the argument to fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .codec import codec_names
from .errors import ConfigError
from .tensors import dtype_name

__all__ = ["ANCHOR_EVERY", "ANCHOR_RATIO", "KEEP_ANCHORS", "PART_BYTES", "LEASE_S", "check_options"]

ANCHOR_EVERY = 100  # versions; the public TRL prototype anchors every 10 syncs, adaptive anchors cover drift
ANCHOR_RATIO = 1.0  # deltas since the last anchor may add up to one anchor: catch-up <= 2 anchors of bytes
KEEP_ANCHORS = 2  # the newest anchor and the one before, so a replica mid-catch-up is never stranded
PART_BYTES = 256 << 20  # anchor part size: large enough for throughput, small enough to pipeline
LEASE_S = 600.0  # a writer that stops publishing for this long can be taken over

ZSTD_MIN_LEVEL, ZSTD_MAX_LEVEL = -(1 << 17), 22  # zstd's own bounds (ZSTD_minCLevel, ZSTD_maxCLevel)


def check_options(
    *, codec: str, level: int, dtype: torch.dtype | None, anchor_every: int, anchor_ratio: float,
    keep_anchors: int, part_bytes: int, lease_s: float, retire_grace_s: float, chunk: int,
    on_publish: Callable[..., object] | None,
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
    integers = {
        "level": (level, ZSTD_MIN_LEVEL, ZSTD_MAX_LEVEL), "anchor_every": (anchor_every, 1, None),
        "keep_anchors": (keep_anchors, 1, None), "part_bytes": (part_bytes, 1, None), "chunk": (chunk, 1, None),
    }
    for name, (value, low, high) in integers.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise ConfigError(f"{name} must be an integer {span}, got {value!r}", argument=name)
    reals = {
        "anchor_ratio": (anchor_ratio, False), "lease_s": (lease_s, False), "retire_grace_s": (retire_grace_s, True),
    }
    for name, (value, zero_ok) in reals.items():
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (value == 0 and not zero_ok):
            bound = ">= 0" if zero_ok else "> 0"
            raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}", argument=name)
    if on_publish is not None and not callable(on_publish):
        raise ConfigError(f"on_publish must be callable, got {type(on_publish).__name__}", argument="on_publish")
