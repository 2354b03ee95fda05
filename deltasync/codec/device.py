"""``compact`` and ``compact-abs`` rebuilt on the receiver's device: one host wait per file.

The host path (:mod:`deltasync.codec.compact`) rebuilds indices and values with
numpy and reads the receiver's bases back to the host. For weights on an
accelerator that means moving int64 indices to the device and bases back for
every tensor, and doing the prefix sums, the exponent sort and the zigzag on
the CPU. Here the host only decompresses; the rest runs as torch ops where the
weights live:

1. **Host threads**: each tensor's zstd frames are decompressed (sizes checked
   against the header before any allocation, as on the host path), and every
   stream is packed into one (pinned, on CUDA) host buffer.
2. **One copy** of that buffer to the device (1 to 4 bytes per change for
   positions and 2 or 4 for values, instead of 8 + 2 + 2 on the host path).
3. **On the device, queued**: byte planes merged, escapes patched
   (``nonzero_static``: their count is in the params, so no wait), gaps summed
   into indices; the base read at the indices (clamped: a hostile stream is
   refused below, never read out of bounds); exponent order, zigzag and sum.
   Every check a hostile stream could fail (escape count, side gaps, index
   bounds) becomes a flag on the device.
4. **Wait**: the flags and the new bit patterns come back in one copy each, and
   the host waits once. It raises the first failed check in file order, then
   checks every tensor's value digest (BLAKE3 on a few threads: about 0.5 ns
   per change) before anything is written.

The indices and values stay on the device for the applier (no second copy).
The code is device-agnostic and runs on CPU tensors too (tests prove it
bit-exact against the host path there); on a CPU the host path is faster (its
radix sort of exponent bytes beats torch's general sort), so it is taken only
when asked (``TorchModuleApplier(stage=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..device_diff import WaitCounter
from ..errors import CodecError
from ..parallel import map_shared
from ..tensors import TensorSpec
from ._zstd import decompress
from .base import Decoded, Params, Parts, check_part, to_numpy
from .compact import GAP_WIDTHS, check_values

__all__ = ["DEVICE_CODECS", "DeviceReader", "Streams", "decode_on_device", "host_waits", "streams_of"]

DEVICE_CODECS = frozenset({"compact", "compact-abs"})
"""The codecs this module rebuilds on a device."""
_BITS = {2: torch.int16, 4: torch.int32}
_ALIGN = 8  # every stream starts 8-byte aligned in the packed buffer, so the side gaps view as int64

host_waits = WaitCounter()
"""``host_waits()``: the waits so far (one per device per call of :func:`decode_on_device`)."""


class DeviceReader(Protocol):
    """What the device path needs from a receiver: where each tensor lives, and its bits there."""

    def device_of(self, name: str) -> torch.device:
        """The device tensor ``name`` lives on."""
        ...

    def gather(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Published bit patterns (int16/int32) of tensor ``name`` at flat ``index`` (int64, on its device)."""
        ...


@dataclass(frozen=True, slots=True)
class Streams:
    """One tensor's decompressed streams and what the header says about them (host side)."""

    name: str
    spec: TensorSpec
    nnz: int
    params: Params
    base_relative: bool
    """``compact`` (values relative to the receiver's base) or ``compact-abs``."""
    offset: int
    """Where a shard's elements start in the full tensor (0 for a whole tensor)."""
    iw: int
    big: int
    idx: bytes
    """``nnz * iw`` bytes of gap planes, then ``8 * big`` bytes of side gaps."""
    val: bytes
    """``nnz * width`` bytes of value planes."""


def streams_of(
    name: str, codec: str, parts: Parts, params: Params, spec: TensorSpec, nnz: int, offset: int
) -> Streams:
    """Check one tensor's params and decompress its frames (runs on the host's decode threads).

    Raises:
        `CodecError`: bad params, a missing or mistyped part, a frame of the wrong size.
    """
    iw, big = params.get("iw"), params.get("big")
    if type(iw) is not int or iw not in GAP_WIDTHS or type(big) is not int or not 0 <= big <= nnz:
        raise CodecError(f"{spec.name}: bad index params iw={iw!r} big={big!r}", name=spec.name)
    if nnz > spec.numel:
        raise CodecError(f"{spec.name}: index out of range [0, {spec.numel})", name=spec.name)
    idx_blob = to_numpy(check_part(parts, "idx", torch.uint8, None, spec))
    val_blob = to_numpy(check_part(parts, "val", torch.uint8, None, spec))
    width = spec.torch_dtype.itemsize
    idx = decompress(idx_blob, nnz * iw + 8 * big, f"{spec.name}::idx")
    val = decompress(val_blob, nnz * width, f"{spec.name}::val")
    return Streams(name, spec, nnz, params, codec == "compact", offset, iw, big, idx, val)


def decode_on_device(items: Sequence[Streams], reader: DeviceReader) -> dict[str, Decoded]:
    """Rebuild and validate every tensor of ``items`` on its device; one host wait per device.

    Returns:
        Per tensor, ``Decoded`` whose indices (int64, flat in the full tensor) and values live on the
        tensor's device.

    Raises:
        `CodecError`: a hostile index stream (the first in ``items`` order); `IntegrityError`: decoded
            values that differ from the publisher's digest (the first in ``items`` order).
    """
    by_device: dict[torch.device, list[Streams]] = {}
    for item in items:
        by_device.setdefault(reader.device_of(item.name), []).append(item)
    out: dict[str, Decoded] = {}
    for device, group in by_device.items():
        out.update(_decode_group(device, group, reader))
    return {item.name: out[item.name] for item in items}


def _decode_group(device: torch.device, items: list[Streams], reader: DeviceReader) -> dict[str, Decoded]:
    pinned = device.type == "cuda"
    layout, total = [], 0
    for item in items:  # where each stream starts in the packed buffer
        at_idx = total
        at_side = _aligned(at_idx + item.nnz * item.iw)
        at_val = _aligned(at_side + 8 * item.big)
        total = _aligned(at_val + len(item.val))
        layout.append((at_idx, at_side, at_val))
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    packed = host.numpy()
    for item, (at_idx, at_side, at_val) in zip(items, layout):
        main = item.nnz * item.iw
        packed[at_idx : at_idx + main] = np.frombuffer(item.idx, dtype=np.uint8, count=main)
        if item.big:
            packed[at_side : at_side + 8 * item.big] = np.frombuffer(item.idx, dtype=np.uint8, offset=main)
        packed[at_val : at_val + len(item.val)] = np.frombuffer(item.val, dtype=np.uint8)
    raw = host.to(device, non_blocking=pinned)

    flags, decoded = [], []
    for item, (at_idx, at_side, at_val) in zip(items, layout):
        indices, ok = _indices(item, raw, at_idx, at_side)
        width = item.spec.torch_dtype.itemsize
        words = _unplanes(raw[at_val : at_val + item.nnz * width], width, item.nnz)
        if item.base_relative:
            safe = indices.clamp(0, max(item.spec.numel - 1, 0)) + item.offset  # in bounds even when refused
            values = _add_base(words, reader.gather(item.name, safe), width)
        else:
            values = words.to(_BITS[width])
        flags.append(ok)
        decoded.append((indices + item.offset if item.offset else indices, values))

    # The one wait: every flag and every value, back to the host together.
    flags_host = _to_host(torch.stack(flags) if flags else torch.ones(0, dtype=torch.bool, device=device), pinned)
    values_host = {}
    for width in (2, 4):
        chosen = [k for k, item in enumerate(items) if item.spec.torch_dtype.itemsize == width]
        if chosen:
            joined = _to_host(torch.cat([decoded[k][1] for k in chosen]), pinned)
            sizes = [items[k].nnz for k in chosen]
            values_host.update(zip(chosen, joined.split(sizes)))
    host_waits.count += 1
    if pinned:
        torch.cuda.current_stream(device).synchronize()
    for item, ok in zip(items, flags_host.tolist()):
        if not ok:
            raise CodecError(
                f"{item.name}: hostile index stream (escape count, side gaps or an index out of range "
                f"[0, {item.spec.numel}))", name=item.name,
            )
    map_shared(lambda k: check_values(values_host[k].numpy(), items[k].params, items[k].spec),
               range(len(items)), [item.nnz for item in items])
    return {item.name: Decoded(indices, values) for item, (indices, values) in zip(items, decoded)}


def _indices(item: Streams, raw: torch.Tensor, at_idx: int, at_side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices from the gap planes and side gaps, and a device flag: the stream is well formed."""
    nnz, escape = item.nnz, (1 << (8 * item.iw)) - 1
    narrow = _unplanes(raw[at_idx : at_idx + nnz * item.iw], item.iw, nnz).to(torch.int64)
    escaped = narrow == escape
    ok = escaped.sum() == item.big
    gaps = narrow.add_(1)  # the gap plus the changed element itself
    if item.big:
        side = raw[at_side : at_side + 8 * item.big].view(torch.int64)  # little-endian uint64, as written
        # A side gap at or above 2**63 reads negative; the float bound keeps int64 sums from wrapping
        # (float32 for devices without float64: legitimate sums stay below numel, far under the bound).
        ok &= (side >= 0).all() & (side.to(torch.float32).sum() + float(nnz) * (escape + 1) < 2.0**61)
        where = torch.nonzero_static(escaped, size=item.big, fill_value=0).view(-1)
        gaps.index_put_((where,), side + 1)
    indices = gaps.cumsum_(0).sub_(1)
    if nnz:
        ok &= indices[-1] < item.spec.numel
    return indices, ok


def _unplanes(planes: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """``count`` words of ``width`` bytes from their byte planes, as int32 (width <= 2) or int64."""
    rows = planes.view(width, count)
    wide = torch.int32 if width <= 2 else torch.int64
    out = rows[0].to(wide)
    for k in range(1, width):
        out |= rows[k].to(wide) << (8 * k)
    return out


def _add_base(words: torch.Tensor, current: torch.Tensor, width: int) -> torch.Tensor:
    """New bit patterns: ``current`` plus the unzigzagged words, undoing the exponent order."""
    mask = (1 << (8 * width)) - 1
    wide = words.dtype
    base = current.to(wide) & mask  # unsigned, in a type wide enough for the sum
    key = (base >> (7 if width == 2 else 23)) & 0xFF
    order = torch.argsort(key, stable=True)
    zigzag = torch.empty_like(words)
    zigzag[order] = words
    delta = (zigzag >> 1) ^ -(zigzag & 1)
    return ((base + delta) & mask).to(_BITS[width])


def _to_host(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
    host.copy_(tensor, non_blocking=pinned)
    return host


def _aligned(at: int) -> int:
    return -(-at // _ALIGN) * _ALIGN

