"""zstandard framing with hard limits: one frame, declared size, nothing more.

Compression contexts are kept per thread and reused: a context is not
thread-safe, and creating one per call costs a large share of compressing a
typical tensor's few kilobytes (and the allocation churn slows parallel
encoders further). A reused context produces the same bytes as a fresh one.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from ..errors import CodecError

__all__ = ["check_frame", "compress", "decompress", "decompress_into"]

_LOCAL = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for ``level`` (one frame per call, content size recorded)."""
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_LOCAL, "compressors", None)
    if cache is None:
        cache = _LOCAL.compressors = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor."""
    decompressor: zstandard.ZstdDecompressor | None = getattr(_LOCAL, "decompressor", None)
    if decompressor is None:
        decompressor = _LOCAL.decompressor = zstandard.ZstdDecompressor()
    return decompressor


def compress(payload: bytes | np.ndarray, level: int) -> np.ndarray:
    """Compress a bytes-like object (a contiguous array is read in place) into one frame."""
    # bytearray: a writable copy of the (small) frame, so torch.from_numpy does not warn.
    return np.frombuffer(bytearray(_compressor(level).compress(payload)), dtype=np.uint8)


def check_frame(blob: np.ndarray, expected: int, what: str) -> np.ndarray:
    """``blob`` (contiguous), once it is a zstd frame that declares exactly ``expected`` bytes.

    Checked before any allocation, so a frame that would inflate to far more than the
    header promises is refused up front.
    """
    data = np.ascontiguousarray(blob)
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what}: not a zstd frame ({exc})", part=what) from None
    if declared != expected:
        raise CodecError(
            f"{what}: zstd frame declares {declared} bytes, header expects {expected}", part=what
        )
    return data


def decompress_into(frame: np.ndarray, targets: list[np.ndarray], what: str) -> None:
    """Decompress one frame holding exactly as many bytes as ``targets`` (contiguous uint8 arrays) take, and
    fill them in order; checked as :func:`decompress` checks it.

    A replica's device path inflates every stream into its place in one pinned buffer this way. The frame is
    inflated whole, then copied: as fast as inflating it target by target through a stream reader (which
    copies out of its own window just the same), and a third of the calls for a small tensor's stream.
    """
    data = np.frombuffer(decompress(frame, sum(t.size for t in targets), what), dtype=np.uint8)
    at = 0
    for target in targets:
        target[:] = data[at : at + target.size]
        at += target.size


def decompress(blob: np.ndarray, expected: int, what: str) -> bytes:
    """Decompress one frame that must declare and hold exactly ``expected`` bytes (:func:`check_frame`)."""
    data = check_frame(blob, expected, what)
    try:  # one frame and nothing after it (no hidden second payload), checked by libzstd as it decodes
        out = _decompressor().decompress(data, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what}: {_why(data, exc)}", part=what) from None
    if len(out) != expected:
        raise CodecError(f"{what}: decompressed {len(out)} bytes, expected {expected}", part=what)
    return out


def _why(frame: np.ndarray, exc: zstandard.ZstdError) -> str:
    """What is wrong with a frame libzstd refused: bytes after an intact frame, or the frame itself."""
    try:
        _decompressor().decompress(frame, allow_extra_data=True)
    except zstandard.ZstdError:
        return f"corrupt zstd frame ({exc})"
    return "bytes after the zstd frame"
