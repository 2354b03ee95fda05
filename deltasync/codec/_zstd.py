"""zstandard framing with hard limits: one frame, declared size, nothing more."""

from __future__ import annotations

import numpy as np
import zstandard

from ..errors import CodecError

__all__ = ["compress", "decompress"]


def compress(payload: bytes, level: int) -> np.ndarray:
    """Compress into one zstd frame that records its content size."""
    # ZstdCompressor is not thread-safe; one per call costs microseconds.
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return np.frombuffer(bytearray(compressor.compress(payload)), dtype=np.uint8)


def decompress(blob: np.ndarray, expected: int, what: str) -> bytes:
    """Decompress one frame that must declare and hold exactly ``expected`` bytes.

    The declared size is checked before any allocation, so a frame that would
    inflate to far more than the header promises is refused up front.
    """
    data = blob.tobytes()
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what}: not a zstd frame ({exc})", part=what) from None
    if declared != expected:
        raise CodecError(
            f"{what}: zstd frame declares {declared} bytes, header expects {expected}", part=what
        )
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what}: corrupt zstd frame ({exc})", part=what) from None
    if len(out) != expected:
        raise CodecError(f"{what}: decompressed {len(out)} bytes, expected {expected}", part=what)
    return out
