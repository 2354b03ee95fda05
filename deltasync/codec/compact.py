"""``compact`` and ``compact-abs``: entropy-coded indices and values with zstandard.

Indices are coded as gaps (``idx[i] - idx[i-1] - 1``, the first against -1) in
the smallest unsigned width ``w`` of 1, 2 or 4 bytes that minimises the size;
gaps that do not fit are written as the escape ``2**(8w) - 1`` in the main
stream and as ``uint64`` in a side stream. The main stream is split into byte
planes (all low bytes, then the next, ...), the side stream appended, and the
lot compressed as one zstd frame: part ``idx``.

Values (part ``val``) are bit patterns, split into byte planes and compressed
the same way. ``compact`` codes each as the difference to the receiver's
current bit pattern (mod 2**bits, zigzag-mapped), so the common +-1 ulp step
costs a couple of bits; decoding reads the receiver's values at the changed
indices, and a hash of the new values (param ``sum``) proves the receiver's
base matched the publisher's. ``compact-abs`` stores the new bit patterns
themselves and needs no base.
"""

from __future__ import annotations

import hashlib
from collections.abc import MutableMapping
from typing import Any

import blake3
import numpy as np
import torch

from ..errors import CodecError, IntegrityError
from ..tensors import EXPONENT_SHIFT, TensorChange, TensorSpec
from ._zstd import compress, decompress
from .base import BaseLookup, Codec, Decoded, Encoded, Params, Parts, check_part, to_numpy
from .kernels import gap_payload, step_payload

GAP_WIDTHS = (1, 2, 4)
STREAM_CODECS = frozenset({"compact", "compact-abs"})
"""The codecs whose tensors are rebuilt in batches from their decompressed streams: a chunk of tensors
at a time on the host (:mod:`.packed`), or all of a file's at once on the receiver's device (:mod:`.device`)."""
UNSIGNED = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
SIGNED = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4")}


VALUE_DIGESTS = ("blake3", "sum")
"""The value digest's param keys: ``blake3`` (format 3 writers: BLAKE3, 8-byte output) and ``sum``
(formats 1 and 2: BLAKE2b with an 8-byte digest length)."""


def values_digest(bits: np.ndarray, key: str = "blake3") -> str:
    """Hash of new bit patterns under param ``key``; proves a base-relative decode reproduced them."""
    data = np.ascontiguousarray(bits).view(np.uint8)  # both hashes read the buffer in place: no tobytes() copy
    if key == "blake3":
        return blake3.blake3(data).hexdigest(length=8)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def sign_values(params: MutableMapping[str, Any], bits: np.ndarray) -> None:
    """Record the digest of the new bit patterns ``bits`` (in index order) in ``params``."""
    params["blake3"] = values_digest(bits)


def check_values(bits: np.ndarray, params: Params, spec: TensorSpec) -> None:
    """Require the decoded bit patterns to hash to every value digest ``params`` holds (at least one).

    Raises:
        `IntegrityError`: no digest, or one that differs.
    """
    keys = [key for key in VALUE_DIGESTS if key in params]
    if not keys or any(values_digest(bits, key) != params[key] for key in keys):
        raise IntegrityError(
            f"{spec.name}: decoded values do not match the publisher's: this receiver's weights differ "
            "from the delta's base version, or the delta was altered; resync from an anchor",
            name=spec.name,
        )


def _planes_into(out: np.ndarray, words: np.ndarray) -> None:
    """Write the byte planes of ``words`` (all low bytes, then the next, ...) into ``out``."""
    # One shift-and-narrow pass per plane: several times faster in numpy than a strided transpose.
    planes = out.reshape(words.dtype.itemsize, words.size)
    for k in range(words.dtype.itemsize):
        planes[k] = words >> (8 * k) if k else words  # assignment keeps the low byte


def planes(words: np.ndarray) -> np.ndarray:
    out = np.empty(words.nbytes, dtype=np.uint8)
    _planes_into(out, words)
    return out


def unplanes(raw: bytes, count: int, dtype: np.dtype, offset: int = 0) -> np.ndarray:
    """Inverse of :func:`planes`: ``count`` words of ``dtype`` from their byte planes."""
    width = dtype.itemsize
    planes = np.frombuffer(raw, dtype=np.uint8, count=count * width, offset=offset).reshape(width, count)
    out = planes[0].astype(dtype)
    for k in range(1, width):
        wide = planes[k].astype(dtype)
        wide <<= 8 * k
        out |= wide
    return out


def encode_indices(indices: np.ndarray, level: int) -> tuple[np.ndarray, dict[str, int]]:
    """Gap-code sorted unique indices; return the blob and its params ``iw``, ``big``.

    The gap width is the one of 1, 2 or 4 bytes minimising ``nnz * width + 8 * escapes`` (ties to the
    narrower); :func:`~deltasync.codec.kernels.gap_payload` counts and writes the planes in two passes.
    """
    payload, width, n_big = gap_payload(indices)
    return compress(payload, level), {"iw": width, "big": n_big}


def decode_indices(blob: np.ndarray, params: Params, spec: TensorSpec, nnz: int) -> np.ndarray:
    """Inverse of :func:`encode_indices`, validating every step.

    Gaps are non-negative, so the decoded indices increase strictly by
    construction; checking the last one against ``numel`` bounds them all. The
    escapes are found on the narrow stream and patched in place, and the prefix
    sum is torch's (vectorised; numpy's int64 ``cumsum`` is several times slower):
    four passes over the changes, escapes or not.
    """
    width, n_big = params.get("iw"), params.get("big")
    if type(width) is not int or width not in GAP_WIDTHS or type(n_big) is not int or not 0 <= n_big <= nnz:
        raise CodecError(f"{spec.name}: bad index params iw={width!r} big={n_big!r}", name=spec.name)
    raw = decompress(blob, nnz * width + 8 * n_big, f"{spec.name}::idx")
    escape = (1 << (8 * width)) - 1
    narrow = (
        np.frombuffer(raw, dtype=np.uint8, count=nnz) if width == 1 else unplanes(raw, nnz, UNSIGNED[width])
    )
    escaped = np.flatnonzero(narrow == escape)
    if escaped.size != n_big:
        raise CodecError(f"{spec.name}: escape count differs from params", name=spec.name)
    gaps = np.add(narrow, 1, dtype=np.int64)  # the gap plus the changed element itself
    if n_big:
        big = np.frombuffer(raw, dtype=UNSIGNED[8], count=n_big, offset=nnz * width)
        # Bound the sum in float first so a hostile stream cannot overflow int64 below
        # (past that bound the last index is out of range anyway).
        if float(big.sum(dtype=np.float64)) + float(nnz) * (escape + 1) >= 2.0**62:
            raise CodecError(f"{spec.name}: index out of range [0, {spec.numel})", name=spec.name)
        gaps[escaped] = big.astype(np.int64) + 1
    indices = torch.from_numpy(gaps).cumsum_(0).numpy()
    indices -= 1
    if nnz and int(indices[-1]) >= spec.numel:
        raise CodecError(f"{spec.name}: index out of range [0, {spec.numel})", name=spec.name)
    return indices


def _exponent_order(base: np.ndarray) -> np.ndarray:
    """Stable order of changed elements by the exponent of their base value.

    An optimizer step moves a weight by roughly the same amount whatever its
    size, so the change in ulps depends on the weight's exponent: small weights
    move many ulps, large ones one. Grouping values by base exponent (which the
    receiver knows, so the order costs no bytes) hands zstd runs of similar
    symbols.
    """
    mantissa_bits = EXPONENT_SHIFT[base.dtype.itemsize]
    # uint8 keeps exactly the 8 bits above the mantissa; a stable sort on one
    # byte is a single radix pass (the order is unique, so identical to a
    # stable sort on the same values held wider).
    exponent = (base.view(UNSIGNED[base.dtype.itemsize]) >> mantissa_bits).astype(np.uint8)
    return exponent.argsort(kind="stable")


def zigzag(delta: np.ndarray) -> np.ndarray:
    bits = delta.dtype.itemsize * 8
    out = delta << 1
    out ^= delta >> (bits - 1)
    return out.view(UNSIGNED[delta.dtype.itemsize])


def unzigzag(z: np.ndarray) -> np.ndarray:
    signed = SIGNED[z.dtype.itemsize]
    return (z >> 1).view(signed) ^ -(z & 1).view(signed)


class CompactCodec(Codec):
    """Gap-coded indices, base-relative zigzag values, byte planes, zstd."""

    name = "compact"
    needs_base = True

    def encode(self, change: TensorChange, *, level: int) -> Encoded:
        assert change.indices is not None
        blob, params = encode_indices(to_numpy(change.indices), level)
        new = to_numpy(change.values)
        base = to_numpy(change.base) if change.base is not None else None
        payload = self._value_payload(new, base)
        sign_values(params, new)
        return Encoded(
            parts={"idx": torch.from_numpy(blob), "val": torch.from_numpy(compress(payload, level))},
            params=params,
        )

    def decode(self, parts: Parts, params: Params, spec: TensorSpec, nnz: int, base: BaseLookup | None) -> Decoded:
        idx_blob = to_numpy(check_part(parts, "idx", torch.uint8, None, spec))
        val_blob = to_numpy(check_part(parts, "val", torch.uint8, None, spec))
        indices = decode_indices(idx_blob, params, spec, nnz)
        width = spec.torch_dtype.itemsize
        raw = decompress(val_blob, nnz * width, f"{spec.name}::val")
        words = unplanes(raw, nnz, UNSIGNED[width])
        current = None
        if self.needs_base:
            if base is None:
                raise CodecError(f"{spec.name}: codec {self.name!r} needs the receiver's current values", name=spec.name)
            current = base(spec.name, indices)
        values = self._words_to_values(words, indices, spec, current)
        check_values(values, params, spec)
        return Decoded(indices, values)

    @staticmethod
    def _value_payload(new: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        """The bytes of part ``val`` before zstd: byte planes of the zigzagged steps from ``base``, in
        the stable order of the changes by the exponent of their base (:func:`_exponent_order`)."""
        if base is None:
            raise ValueError("the compact codec needs the base values of the change")
        return step_payload(new, base)

    def _words_to_values(
        self, words: np.ndarray, indices: np.ndarray, spec: TensorSpec, base: np.ndarray | None
    ) -> np.ndarray:
        assert base is not None  # decode reads it for a base-relative codec
        current = np.ascontiguousarray(base)
        signed = SIGNED[words.dtype.itemsize]
        if current.shape != indices.shape or current.dtype.itemsize != words.dtype.itemsize:
            raise CodecError(f"{spec.name}: base lookup returned the wrong shape", name=spec.name)
        unsigned = words.dtype
        ordered = np.empty_like(words)
        ordered[_exponent_order(current)] = words
        return (current.view(unsigned) + unzigzag(ordered).view(unsigned)).view(signed)


class CompactAbsCodec(CompactCodec):
    """Gap-coded indices, absolute value bit patterns, byte planes, zstd; needs no base."""

    name = "compact-abs"
    needs_base = False

    @staticmethod
    def _value_payload(new: np.ndarray, base: np.ndarray | None) -> np.ndarray:
        return planes(new.view(UNSIGNED[new.dtype.itemsize]))

    def _words_to_values(
        self, words: np.ndarray, indices: np.ndarray, spec: TensorSpec, base: np.ndarray | None
    ) -> np.ndarray:
        return words.view(SIGNED[words.dtype.itemsize])
