"""``compact`` and ``compact-abs`` rebuilt on the receiver's device: one host wait per file (per 4M changes).

The host path (:mod:`deltasync.codec.packed`, a chunk of tensors at a time) rebuilds
indices and values with numpy and reads the receiver's bases back to the host. For weights on an
accelerator that means moving int64 indices to the device and bases back for
every tensor, and doing the prefix sums, the exponent sort and the zigzag on
the CPU. Here the host only decompresses; the rest runs as torch ops where the
weights live:

1. **Host threads**: each tensor's zstd frames are decompressed (sizes checked
   against the header before any allocation, as on the host path), and every
   stream is copied, on the same threads, into its place in one (pinned, on
   CUDA) host buffer.
2. **One copy** of that buffer to the device (1 to 4 bytes per change for
   positions and 2 or 4 for values, instead of 8 + 2 + 2 on the host path).
3. **On the device, queued, for all tensors at once**: byte planes merged
   (streams are packed by width, plane by plane, so one merge per plane serves
   every tensor), escapes patched (:func:`~deltasync.tensors.positions`: their count is in the
   params, so no wait), gaps summed into indices with one prefix sum (each
   tensor's start subtracted); the base read at the indices, per tensor
   (clamped: a hostile stream is refused below, never read out of bounds); one
   stable sort by tensor and exponent, zigzag and sum. Every check a hostile
   stream could fail (escape count, side gaps, index bounds) becomes a flag per
   tensor on the device. A file of a few hundred tensors costs a few dozen
   kernels plus two per tensor (its base read), not dozens per tensor.
4. **Wait**: the flags and the new bit patterns come back in one copy each, and
   the host waits once (per batch of :data:`BATCH` changed elements, which
   bounds the scratch memory on the device). It raises the first failed check in file order, then
   checks every tensor's value digest (BLAKE3 on a few threads: about 0.5 ns
   per change) before anything is written.

The indices and values stay on the device for the applier (no second copy).
The code is device-agnostic and runs on CPU tensors too (tests prove it
bit-exact against the host path there); on a CPU the host path is faster (its
compiled counting sort of exponent bytes beats torch's general sort), so it is taken only
when asked (``TorchModuleApplier(stage=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..device_diff import WaitCounter, to_host
from ..errors import CodecError
from ..parallel import map_shared
from ..tensors import BITS_BY_SIZE, TensorSpec, positions
from ._zstd import decompress
from .base import Decoded, Params, Parts, check_part, to_numpy
from .compact import GAP_WIDTHS, check_values

__all__ = ["BATCH", "DeviceReader", "Streams", "decode_on_device", "host_waits", "streams_of"]

_ALIGN = 8  # every stream starts 8-byte aligned in the packed buffer, so the side gaps view as int64

BATCH = 1 << 22
"""Changed elements per batch of :func:`decode_on_device` (one host wait each): about 400 MB of scratch."""
host_waits = WaitCounter()
"""``host_waits()``: the waits so far (one per device and batch in each call of :func:`decode_on_device`)."""


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


def decode_on_device(
    items: Sequence[Streams], reader: DeviceReader, batch: int | None = None
) -> dict[str, Decoded]:
    """Rebuild and validate every tensor of ``items`` on its device; one host wait per device and batch.

    Tensors go in batches of about ``batch`` changed elements (default :data:`BATCH`), which bounds the
    scratch memory on the device (at most about 100 bytes per change of a batch, freed as it goes); the
    results stay there until the applier writes them: int64 indices and the new values, 10 or 12 bytes
    per changed element of the file.

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
    limit = BATCH if batch is None else batch
    out: dict[str, Decoded] = {}
    for device, group in by_device.items():
        start, size = 0, 0
        for end, item in enumerate(group, 1):
            size += item.nnz
            if size >= limit or end == len(group):
                out.update(_decode_group(device, group[start:end], reader))
                start, size = end, 0
    return {item.name: out[item.name] for item in items}


class _Packing:
    """Where everything one device needs lives in the one host buffer that is copied to it.

    Index streams are laid out by gap width (``iw``): per width, plane ``k`` of every tensor side by
    side, so one merge per plane serves them all; the side gaps follow in the same tensor order.
    Value streams are laid out the same way per (codec, value width). Small per-tensor integers the
    device ops need (counts, starts, bounds) go in an int64 table at the front.
    """

    def __init__(self, items: Sequence[Streams]) -> None:
        self.order = sorted(range(len(items)), key=lambda k: items[k].iw)  # tensors in index-stream order
        self.values: dict[tuple[bool, int], list[int]] = {}  # (base-relative, value width) -> tensors
        for k, item in enumerate(items):
            self.values.setdefault((item.base_relative, item.spec.torch_dtype.itemsize), []).append(k)
        counts = [items[k].nnz for k in self.order]
        bigs = [items[k].big for k in self.order]
        self.start = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])  # per tensor, in index order
        self.side_start = np.concatenate([[0], np.cumsum(bigs, dtype=np.int64)])
        self.total, self.big = int(self.start[-1]), int(self.side_start[-1])
        table = {
            "count": counts, "big": bigs, "start": self.start[:-1],
            "last": [max(int(self.start[p]) + counts[p] - 1, 0) for p in range(len(counts))],
            "numel": [items[k].spec.numel for k in self.order],
            "top": [max(items[k].spec.numel - 1, 0) for k in self.order],
            "offset": [items[k].offset for k in self.order],
            "scale": [1 << (8 * items[k].iw) for k in self.order],  # escape + 1
        }
        for key, members in self.values.items():
            table[f"count{key}"] = [items[k].nnz for k in members]
        self.table = {key: np.asarray(column, dtype=np.int64) for key, column in table.items()}
        at = 8 * sum(len(column) for column in self.table.values())
        self.idx: dict[int, tuple[int, int, list[int]]] = {}  # iw -> (byte offset, count, tensors)
        for k in self.order:
            iw = items[k].iw
            if iw not in self.idx:
                members = [q for q in self.order if items[q].iw == iw]
                self.idx[iw] = (at, sum(items[q].nnz for q in members), members)
                at = _aligned(at + iw * self.idx[iw][1])
        self.side = at
        at = _aligned(at + 8 * self.big)
        self.val: dict[tuple[bool, int], tuple[int, int]] = {}
        for key, members in self.values.items():
            self.val[key] = (at, sum(items[k].nnz for k in members))
            at = _aligned(at + key[1] * self.val[key][1])
        self.nbytes = at
        # Per tensor: its first column in its index layout and in its value layout, and its side gaps' byte.
        self.index_column: dict[int, int] = {}
        self.side_at: dict[int, int] = {}
        column, side = {iw: 0 for iw in self.idx}, self.side
        for k in self.order:
            self.index_column[k], self.side_at[k] = column[items[k].iw], side
            column[items[k].iw] += items[k].nnz
            side += 8 * items[k].big
        self.value_column: dict[int, int] = {}
        for members in self.values.values():
            at = 0
            for k in members:
                self.value_column[k] = at
                at += items[k].nnz

    def fill(self, out: np.ndarray, items: Sequence[Streams]) -> None:
        """Write the table and every stream into ``out`` (host memory), the streams on the decode threads."""
        at = 0
        for column in self.table.values():
            out[at : at + 8 * len(column)] = column.view(np.uint8)
            at += 8 * len(column)
        map_shared(lambda k: self._place(out, items[k], k), range(len(items)), [item.nnz for item in items])

    def _place(self, out: np.ndarray, item: Streams, k: int) -> None:
        """Copy one tensor's planes into its columns of the shared layouts, and its side gaps."""
        n, column, side, value = item.nnz, self.index_column[k], self.side_at[k], self.value_column[k]
        base, count, _ = self.idx[item.iw]
        planes = out[base : base + item.iw * count].reshape(item.iw, count)
        planes[:, column : column + n] = np.frombuffer(item.idx, dtype=np.uint8, count=item.iw * n).reshape(item.iw, n)
        out[side : side + 8 * item.big] = np.frombuffer(item.idx, dtype=np.uint8, offset=item.iw * n)
        width = item.spec.torch_dtype.itemsize
        base, count = self.val[(item.base_relative, width)]
        planes = out[base : base + width * count].reshape(width, count)
        planes[:, value : value + n] = np.frombuffer(item.val, dtype=np.uint8).reshape(width, n)

    def columns(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """The table's columns, on the device."""
        table = raw[: 8 * sum(len(c) for c in self.table.values())].view(torch.int64)
        out, at = {}, 0
        for key, column in self.table.items():
            out[key] = table[at : at + len(column)]
            at += len(column)
        return out


def _decode_group(device: torch.device, items: list[Streams], reader: DeviceReader) -> dict[str, Decoded]:
    """Every tensor of ``items`` at once: a few ops per stream layout, two per tensor that reads its base."""
    pinned = device.type == "cuda"
    plan = _Packing(items)
    host = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=pinned)
    plan.fill(host.numpy(), items)
    raw = host.to(device, non_blocking=pinned)
    col = plan.columns(raw)
    indices, ok = _indices(plan, raw, col, device)
    safe = None
    if any(item.base_relative for item in items):  # read the base at clamped indices: never out of bounds
        top = torch.repeat_interleave(col["top"], col["count"], output_size=plan.total)
        safe = torch.minimum(indices.clamp_min(0), top)
    if any(item.offset for item in items):  # shards: indices into the full tensor
        shift = torch.repeat_interleave(col["offset"], col["count"], output_size=plan.total)
        indices = indices + shift
        safe = safe + shift if safe is not None else None
    position = {k: p for p, k in enumerate(plan.order)}
    span = {k: (int(plan.start[position[k]]), int(plan.start[position[k] + 1])) for k in range(len(items))}
    values: dict[int, torch.Tensor] = {}
    buffers = {}
    for key, members in plan.values.items():
        base_relative, width = key
        at, count = plan.val[key]
        words = _unplanes(raw[at : at + width * count], width, count)
        if base_relative:
            assert safe is not None
            current = torch.empty(count, dtype=BITS_BY_SIZE[width], device=device)
            for k in members:
                a, b = span[k]
                current[plan.value_column[k] : plan.value_column[k] + b - a] = reader.gather(items[k].name, safe[a:b])
            tensors = torch.arange(len(members), dtype=torch.int32, device=device)  # 32-bit sort keys: 2x faster
            segment = torch.repeat_interleave(tensors, col[f"count{key}"], output_size=count)
            buffer = _add_base(words, current, width, segment)
        else:
            buffer = words.to(BITS_BY_SIZE[width])
        buffers[key] = buffer
        for k in members:
            values[k] = buffer[plan.value_column[k] : plan.value_column[k] + items[k].nnz]

    # The one wait: the flags and every value, back to the host together.
    flags_host = to_host(ok)
    values_host = {key: to_host(buffer) for key, buffer in buffers.items()}
    host_waits.wait(device)
    flags = flags_host.tolist()
    for k, item in enumerate(items):
        if not flags[position[k]]:
            raise CodecError(
                f"{item.name}: hostile index stream (escape count, side gaps or an index out of range "
                f"[0, {item.spec.numel}))", name=item.name,
            )
    on_host: dict[int, np.ndarray] = {}
    for key, members in plan.values.items():
        flat = values_host[key].numpy()
        for k in members:
            on_host[k] = flat[plan.value_column[k] : plan.value_column[k] + items[k].nnz]
    map_shared(lambda k: check_values(on_host[k], items[k].params, items[k].spec), range(len(items)),
               [item.nnz for item in items])
    return {item.name: Decoded(indices[span[k][0] : span[k][1]], values[k]) for k, item in enumerate(items)}


def _indices(
    plan: _Packing, raw: torch.Tensor, col: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tensor's flat indices (slice-relative, index-stream order) and a flag per tensor: its stream
    is well formed (escape count, side gaps that cannot wrap a sum, the last index in bounds)."""
    narrow_parts, escaped_parts = [], []
    for iw, (at, count, _) in plan.idx.items():
        narrow = _unplanes(raw[at : at + iw * count], iw, count).to(torch.int64)
        escaped_parts.append(narrow == (1 << (8 * iw)) - 1)
        narrow_parts.append(narrow)
    total = plan.total
    gaps = torch.cat(narrow_parts) if narrow_parts else torch.zeros(0, dtype=torch.int64, device=device)
    escaped = torch.cat(escaped_parts) if escaped_parts else torch.zeros(0, dtype=torch.bool, device=device)
    gaps += 1  # the gap plus the changed element itself
    tensors = len(plan.order)
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    escapes = torch.cat([zero, escaped.to(torch.int64).cumsum_(0)])  # escapes before each position
    ok = escapes[col["start"] + col["count"]] - escapes[col["start"]] == col["big"]
    # Each tensor's sum bounded in float first (per tensor, so one hostile stream cannot hide another's):
    # below it no sum wraps int64 and every index increases strictly.
    bound = col["count"].to(torch.float32) * col["scale"].to(torch.float32)
    if plan.big:
        side = raw[plan.side : plan.side + 8 * plan.big].view(torch.int64)  # little-endian uint64, as written
        side_owner = torch.repeat_interleave(torch.arange(tensors, device=device), col["big"], output_size=plan.big)
        ok &= torch.zeros(tensors, dtype=torch.int64, device=device).index_add_(
            0, side_owner, (side < 0).to(torch.int64)) == 0  # at or above 2**63
        bound = bound.index_add_(0, side_owner, side.to(torch.float32))
        where = positions(escaped, plan.big)
        gaps.index_put_((where,), side + 1)
    ok &= bound < 2.0**61
    summed = gaps.cumsum_(0)
    # Per tensor, subtract the sum before its first gap (int64 sums wrap alike, so a hostile neighbour
    # cannot shift these indices).
    before = torch.cat([zero, summed])[col["start"]]
    indices = summed.sub_(torch.repeat_interleave(before, col["count"], output_size=total)).sub_(1)
    if total:
        ok &= (col["count"] == 0) | (indices[col["last"]] < col["numel"])
    return indices, ok


def _unplanes(planes: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """``count`` words of ``width`` bytes from their byte planes, as int32 (width <= 2) or int64."""
    rows = planes.view(width, count)
    wide = torch.int32 if width <= 2 else torch.int64
    out = rows[0].to(wide)
    for k in range(1, width):
        out |= rows[k].to(wide) << (8 * k)
    return out


def _add_base(words: torch.Tensor, current: torch.Tensor, width: int, segment: torch.Tensor) -> torch.Tensor:
    """New bit patterns: ``current`` plus the unzigzagged words, undoing each tensor's exponent order
    (one stable sort for all tensors: by tensor, then by exponent)."""
    mask = (1 << (8 * width)) - 1
    wide = words.dtype
    base = current.to(wide) & mask  # unsigned, in a type wide enough for the sum
    key = segment * 256 + ((base >> (7 if width == 2 else 23)) & 0xFF).to(torch.int32)
    order = torch.argsort(key, stable=True)
    zigzag = torch.empty_like(words)
    zigzag[order] = words
    delta = (zigzag >> 1) ^ -(zigzag & 1)
    return ((base + delta) & mask).to(BITS_BY_SIZE[width])


def _aligned(at: int) -> int:
    return -(-at // _ALIGN) * _ALIGN
