"""zstandard framing with hard limits: one frame, declared size, nothing more.

Compression contexts are kept per thread and reused: a context is not
thread-safe, and creating one per call cost about a third of compressing a
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
    """Decompress a frame that :func:`check_frame` passed for the targets' total size straight into
    ``targets`` (contiguous uint8 arrays, filled in order): no output allocated, no copy after.

    A replica's device path inflates every stream into its place in one pinned buffer this way.
    """
    expected = sum(t.size for t in targets)
    got = 0
    try:
        reader = _decompressor().stream_reader(frame, read_across_frames=False)
        for target in targets:
            view, filled = memoryview(target), 0
            while filled < target.size:
                n = reader.readinto(view[filled:])
                if not n:
                    break
                filled += n
            got += filled
            if filled < target.size:
                break
        extra = reader.read(1) if got == expected else b""
    except zstandard.ZstdError as exc:
        raise CodecError(f"{what}: corrupt zstd frame ({exc})", part=what) from None
    if got != expected or extra:
        raise CodecError(f"{what}: decompressed {got + len(extra)}{'+' if extra else ''} bytes, expected "
                         f"{expected}", part=what)
    if _frame_size(frame) != frame.size:  # one frame and nothing after it: no hidden second payload
        raise CodecError(f"{what}: bytes after the zstd frame", part=what)


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


def _frame_size(frame: np.ndarray) -> int:
    """The length of the (already decoded, so well-formed) zstd frame at the start of ``frame``.

    Walks the frame's block headers (RFC 8878: 3 bytes each, last-block bit,
    block type, block size; an RLE block holds one byte) and adds the
    optional 4-byte checksum.
    """
    view = memoryview(frame)  # bytes read as ints: a tenth of the cost of indexing the array
    pos, end = zstandard.frame_header_size(frame), len(view)
    while pos + 3 <= end:
        header = view[pos] | view[pos + 1] << 8 | view[pos + 2] << 16
        kind, size = (header >> 1) & 3, header >> 3
        pos += 3 + (1 if kind == 1 else size)
        if header & 1:
            break
    return pos + (4 if view[4] & 4 else 0)  # the frame header descriptor's Content_Checksum_flag
