"""``compact`` and ``compact-abs`` rebuilt on the receiver's device: one host wait per file.

The host path (:mod:`deltasync.codec.packed`, a chunk of tensors at a time) rebuilds
indices and values with numpy and reads the receiver's bases back to the host. For weights on an
accelerator that means moving int64 indices to the device and bases back for
every tensor, and doing the prefix sums, the exponent sort and the zigzag on
the CPU. Here the host only decompresses; the rest runs as torch ops where the
weights live:

1. **Host threads**: each tensor's zstd frames are checked (their declared sizes
   against the header, before any allocation, as on the host path), then
   inflated and copied into their places in one (pinned, on CUDA) host buffer,
   laid out for the device's ops.
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
   kernels plus at most one per tensor (its base read, straight into its place in
   the batch's buffer; a reader joins the reads of tensors that lie side by side
   in one parameter), not dozens per tensor; the host takes each tensor's views of
   the batch's results by one split per layout.
4. **Wait**: the flags and the new bit patterns come back in one copy each, and
   the host waits once per device. Tensors go to the device in batches of about
   :data:`BATCH` changed elements, which bounds its scratch memory; every batch
   is queued before the wait (a thread inflates the next batch while the host
   queues the ops of this one, and the device runs them). The host raises the first failed check in file order, then
   checks every tensor's value digest (BLAKE3 on a few threads) before anything
   is written.

The indices and values stay on the device for the applier (no second copy).
The code is device-agnostic and runs on CPU tensors too (tests prove it
bit-exact against the host path there); on a CPU the host path is faster (its
compiled counting sort of exponent bytes beats torch's general sort), so it is taken only
when asked (``TorchModuleApplier(stage=True)``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ..errors import CodecError
from ..tensors import BITS_BY_SIZE, EXPONENT_SHIFT, TensorSpec, positions, segment_owners, segment_sums
from ..tensors.device import Phases, WaitCounter, to_host
from ..util.threads import map_shared, mostly_python
from ._zstd import decompress, decompress_into
from .base import Decoded, Params, Parts, check_part, to_numpy
from .compact import GAP_WIDTHS, check_values

__all__ = ["BATCH", "DeviceReader", "Streams", "decode_on_device", "host_waits", "phases", "streams_of"]

_ALIGN = 8  # every stream starts 8-byte aligned in the packed buffer, so the side gaps view as int64

BATCH = 1 << 22
"""Changed elements per batch of :func:`decode_on_device`: about 400 MB of scratch on the device at a time."""
host_waits = WaitCounter()
"""``host_waits()``: the waits so far (one per device in each call of :func:`decode_on_device`)."""
phases = Phases("deltasync.decode")
"""Host time of :func:`decode_on_device` by phase: ``inflate`` (checking and inflating frames, on a thread of its
own beside the queueing), ``inflate_wait`` (the queueing waiting for it), ``queue``, ``wait`` (for the
device) and ``check_values`` (the digests)."""


class DeviceReader(Protocol):
    """What the device path needs from a receiver: where each tensor lives, and its bits there."""

    def device_of(self, name: str) -> torch.device:
        """The device tensor ``name`` lives on."""
        ...

    def gather_into(self, requests: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor) -> None:
        """Published bit patterns (int16/int32) of each request's tensor at its flat indices (int64, on the
        tensor's device, in bounds), side by side in ``out`` (contiguous, of those bits, on that device) in
        the requests' order: a batch's bases, each read straight into its place there."""
        ...


@dataclass(slots=True)  # not frozen: one is made per tensor per decode, and a frozen one costs more to make
class Streams:
    """One tensor's streams (or their checked frames) and what the header says about them (host side)."""

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
    idx: bytes | np.ndarray
    """``nnz * iw`` bytes of gap planes, then ``8 * big`` bytes of side gaps (or their zstd frame, unchecked)."""
    val: bytes | np.ndarray
    """``nnz * width`` bytes of value planes (or their zstd frame)."""
    inflated: bool = True
    """Whether ``idx`` and ``val`` are the streams (else their frames, checked and inflated where they go)."""


def streams_of(
    name: str, codec: str, parts: Parts, params: Params, spec: TensorSpec, nnz: int, offset: int,
    inflate: bool = True,
) -> Streams:
    """Check one tensor's params and decompress its frames (runs on the host's decode threads).

    With ``inflate=False`` the frames are kept: :func:`decode_on_device` checks them and inflates them
    into the buffer it copies to the device.

    Raises:
        `CodecError`: bad params, a missing or mistyped part, a frame of the wrong size.
    """
    iw, big = params.get("iw"), params.get("big")
    if type(iw) is not int or iw not in GAP_WIDTHS or type(big) is not int or not 0 <= big <= nnz:
        raise CodecError(f"{spec.name}: bad index params iw={iw!r} big={big!r}", name=spec.name)
    if nnz > spec.numel:
        raise CodecError(f"{spec.name}: index out of range [0, {spec.numel})", name=spec.name)
    idx_blob, val_blob = _byte_part(parts, "idx", spec), _byte_part(parts, "val", spec)
    width = spec.torch_dtype.itemsize
    if not inflate:  # the frames are checked where they are inflated (the buffer's size is the header's)
        return Streams(name, spec, nnz, params, codec == "compact", offset, iw, big, idx_blob, val_blob, False)
    idx = decompress(idx_blob, nnz * iw + 8 * big, f"{spec.name}::idx")
    val = decompress(val_blob, nnz * width, f"{spec.name}::val")
    return Streams(name, spec, nnz, params, codec == "compact", offset, iw, big, idx, val)


def _byte_part(parts: Parts, key: str, spec: TensorSpec) -> np.ndarray:
    """Part ``key``, a 1-D uint8 stream, as a numpy view (a file's entry in one step); otherwise
    :func:`~.base.check_part`'s error."""
    part = parts.get(key)
    if type(part) is np.ndarray and part.dtype == np.uint8 and part.ndim == 1:  # a file's stream (decode's)
        return part
    if isinstance(part, torch.Tensor) and part.dtype == torch.uint8 and part.dim() == 1 and part.is_cpu and (
        not part.requires_grad
    ):
        return part.numpy()
    return to_numpy(check_part(parts, key, torch.uint8, None, spec))


def decode_on_device(
    items: Sequence[Streams], reader: DeviceReader, batch: int | None = None
) -> dict[str, Decoded]:
    """Rebuild and validate every tensor of ``items`` on its device; one host wait per device.

    Tensors go in batches of about ``batch`` changed elements (default :data:`BATCH`), which bounds the
    scratch memory on the device (at most about 100 bytes per change of a batch, reused by the next batch
    in stream order); the results stay there until the applier writes them: int64 indices and the new
    values, 10 or 12 bytes per changed element of the file.

    Returns:
        Per tensor, ``Decoded`` whose indices (int64, flat in the full tensor) and values live on the
        tensor's device.

    Raises:
        `CodecError`: a frame that is not what the header says (raised as it is inflated, from the first
            batch that holds one), or a hostile index stream (the first in ``items`` order);
            `IntegrityError`: decoded values that differ from the publisher's digest (the first in
            ``items`` order).
    """
    by_device: dict[torch.device, list[Streams]] = {}
    for item in items:
        by_device.setdefault(reader.device_of(item.name), []).append(item)
    limit = BATCH if batch is None else batch
    batches: list[tuple[torch.device, list[Streams]]] = []
    for device, group in by_device.items():
        start, size = 0, 0
        for end, item in enumerate(group, 1):
            size += item.nnz
            if size >= limit or end == len(group):
                batches.append((device, group[start:end]))
                start, size = end, 0
    if not batches:
        return {}
    queued: list[_Queued] = []
    # Every batch queued before any wait; while the host queues one batch's ops, a thread inflates the next.
    with ThreadPoolExecutor(1, "deltasync-stage") as ahead:
        staged = ahead.submit(_stage, *batches[0])
        for k, (device, group) in enumerate(batches):
            with phases("inflate_wait"):
                plan, host = staged.result()
            if k + 1 < len(batches):
                staged = ahead.submit(_stage, *batches[k + 1])
            with phases("queue"):
                queued.append(_queue_group(device, group, reader, plan, host))
    with phases("wait"):
        for device in by_device:
            host_waits.wait(device)  # the one wait per device: every flag and value has reached the host
    failed = {item.name for batch in queued for item in batch.failed()}
    for item in items:  # the first failed check in file order
        if item.name in failed:
            raise CodecError(
                f"{item.name}: hostile index stream (escape count, side gaps or an index out of range "
                f"[0, {item.spec.numel}))", name=item.name,
            )
    checks = [(batch, k) for batch in queued for k in range(len(batch.items))]
    with phases("check_values"):
        sizes = [job[0].items[job[1]].nnz for job in checks]
        map_shared(lambda job: job[0].check(job[1]), checks, sizes, serial=[mostly_python(n) for n in sizes])
    out = {name: patch for batch in queued for name, patch in batch.decoded.items()}
    return {item.name: out[item.name] for item in items}


@dataclass(frozen=True, slots=True)
class _Queued:
    """One batch queued on its device: what the host reads after the wait."""

    items: list[Streams]
    decoded: dict[str, Decoded]
    """Per tensor, its patch on the device."""
    flags: torch.Tensor
    """Host copy (read after the wait): per tensor in index-stream order, its index stream is well formed."""
    values: dict[int, np.ndarray]
    """Host views (read after the wait): per tensor, its new bit patterns."""
    position: dict[int, int]
    """Tensor -> its place in index-stream order (the flags' order)."""
    staging: torch.Tensor
    """The host buffer the batch was copied from, kept until the wait."""

    def failed(self) -> list[Streams]:
        flags = self.flags.tolist()
        return [item for k, item in enumerate(self.items) if not flags[self.position[k]]]

    def check(self, k: int) -> None:
        """Tensor ``k``'s values against the publisher's digest (:class:`IntegrityError` if they differ)."""
        item = self.items[k]
        check_values(self.values[k], item.params, item.spec)


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
        map_shared(lambda k: self._place(out, items[k], k), range(len(items)), [item.nnz for item in items],
                   serial=[mostly_python(item.nnz) for item in items])

    def _place(self, out: np.ndarray, item: Streams, k: int) -> None:
        """Put one tensor's planes into its columns of the shared layouts, and its side gaps: inflated
        there from their frames, or copied."""
        n, column, side, value = item.nnz, self.index_column[k], self.side_at[k], self.value_column[k]
        base, count, _ = self.idx[item.iw]
        index_planes = [out[base + p * count + column : base + p * count + column + n] for p in range(item.iw)]
        index_planes.append(out[side : side + 8 * item.big])
        width = item.spec.torch_dtype.itemsize
        base, count = self.val[(item.base_relative, width)]
        value_planes = [out[base + p * count + value : base + p * count + value + n] for p in range(width)]
        if not item.inflated:
            for targets, frame, part in ((index_planes, item.idx, "idx"), (value_planes, item.val, "val")):
                decompress_into(np.asarray(frame), targets, f"{item.spec.name}::{part}")
            return
        for targets, stream in ((index_planes, item.idx), (value_planes, item.val)):
            at = 0
            for target in targets:
                target[:] = np.frombuffer(stream, dtype=np.uint8, count=target.size, offset=at)
                at += target.size

    def columns(self, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """The table's columns, on the device."""
        table = raw[: 8 * sum(len(c) for c in self.table.values())].view(torch.int64)
        out, at = {}, 0
        for key, column in self.table.items():
            out[key] = table[at : at + len(column)]
            at += len(column)
        return out


def _stage(device: torch.device, items: list[Streams]) -> tuple[_Packing, torch.Tensor]:
    """Lay out a batch and fill its host buffer (pinned for a CUDA device), on the decode threads."""
    with phases("inflate"):
        plan = _Packing(items)
        host = torch.empty(plan.nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        plan.fill(host.numpy(), items)
    return plan, host


def _queue_group(
    device: torch.device, items: list[Streams], reader: DeviceReader, plan: _Packing, host: torch.Tensor
) -> _Queued:
    """Queue every tensor of a staged batch at once: a few ops per stream layout, one per tensor that
    reads its base; its flags and values are copied back to the host asynchronously (read them after a
    wait)."""
    raw = host.to(device, non_blocking=device.type == "cuda")
    col = plan.columns(raw)
    owner = segment_owners(col["count"], plan.total)  # each change's tensor, in index-stream order
    indices, ok = _indices(plan, raw, col, device, owner)
    safe = None
    if any(item.base_relative for item in items):  # read the base at clamped indices: never out of bounds
        safe = torch.minimum(indices.clamp_min(0), col["top"][owner])
    if any(item.offset for item in items):  # shards: indices into the full tensor
        shift = col["offset"][owner]
        indices = indices + shift
        safe = safe + shift if safe is not None else None
    position = {k: p for p, k in enumerate(plan.order)}
    # Per-tensor views by one split each: less host time than a slice per tensor.
    in_order = [items[k].nnz for k in plan.order]
    tensor_indices = dict(zip(plan.order, indices.split(in_order)))
    tensor_safe = dict(zip(plan.order, safe.split(in_order))) if safe is not None else {}
    values: dict[int, torch.Tensor] = {}
    on_host: dict[int, np.ndarray] = {}
    for key, members in plan.values.items():
        base_relative, width = key
        at, count = plan.val[key]
        sizes = [items[k].nnz for k in members]  # members sit side by side in this layout, in this order
        words = _unplanes(raw[at : at + width * count], width, count)
        if base_relative:
            current = torch.empty(count, dtype=BITS_BY_SIZE[width], device=device)
            reader.gather_into([(items[k].name, tensor_safe[k]) for k in members], current)  # in their places
            segment = segment_owners(col[f"count{key}"], count).to(torch.int32)  # 32-bit sort keys sort faster
            buffer = _add_base(words, current, width, segment)
        else:
            buffer = words.to(BITS_BY_SIZE[width])
        flat = to_host(buffer).numpy()  # lands by the wait
        values.update(zip(members, buffer.split(sizes)))
        ends = itertools.accumulate(sizes)
        on_host.update((k, flat[end - n : end]) for k, n, end in zip(members, sizes, ends))  # cheaper than np.split
    decoded = {item.name: Decoded(tensor_indices[k], values[k]) for k, item in enumerate(items)}
    return _Queued(items, decoded, to_host(ok), on_host, position, host)


def _indices(
    plan: _Packing, raw: torch.Tensor, col: dict[str, torch.Tensor], device: torch.device, owner: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every tensor's flat indices (slice-relative, index-stream order) and a flag per tensor: its stream
    is well formed (escape count, side gaps that cannot wrap a sum, the last index in bounds). ``owner``:
    each change's tensor (:func:`~deltasync.tensors.segment_owners` of the counts)."""
    narrow_parts, escaped_parts = [], []
    for iw, (at, count, _) in plan.idx.items():
        narrow = _unplanes(raw[at : at + iw * count], iw, count).to(torch.int64)
        escaped_parts.append(narrow == (1 << (8 * iw)) - 1)
        narrow_parts.append(narrow)
    total = plan.total
    gaps = torch.cat(narrow_parts) if narrow_parts else torch.zeros(0, dtype=torch.int64, device=device)
    escaped = torch.cat(escaped_parts) if escaped_parts else torch.zeros(0, dtype=torch.bool, device=device)
    gaps += 1  # the gap plus the changed element itself
    zero = torch.zeros(1, dtype=torch.int64, device=device)
    ok = segment_sums(escaped, col["count"]) == col["big"]  # each tensor's escapes, as its params count them
    # Each tensor's sum bounded in float first (per tensor, so one hostile stream cannot hide another's):
    # below it no sum wraps int64 and every index increases strictly.
    bound = col["count"].to(torch.float32) * col["scale"].to(torch.float32)
    if plan.big:
        side = raw[plan.side : plan.side + 8 * plan.big].view(torch.int64)  # little-endian uint64, as written
        ok &= segment_sums((side < 0).to(torch.int64), col["big"]) == 0  # at or above 2**63
        # float32 prefix sums: a neighbour's huge gaps blur this tensor's sum by far less than the margin
        # to 2**63, and a neighbour whose gaps reach 2**61 is refused itself.
        bound = bound + segment_sums(side.to(torch.float32), col["big"])
        where = positions(escaped, plan.big)
        gaps.index_put_((where,), side + 1)
    ok &= bound < 2.0**61
    summed = gaps.cumsum_(0)
    # Per tensor, subtract the sum before its first gap (int64 sums wrap alike, so a hostile neighbour
    # cannot shift these indices).
    before = torch.cat([zero, summed])[col["start"]]
    indices = summed.sub_(before[owner]).sub_(1)
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
    key = segment * 256 + ((base >> EXPONENT_SHIFT[width]) & 0xFF).to(torch.int32)
    order = torch.argsort(key, stable=True)
    zigzag = torch.empty_like(words)
    zigzag[order] = words
    delta = (zigzag >> 1) ^ -(zigzag & 1)
    return ((base + delta) & mask).to(BITS_BY_SIZE[width])


def _aligned(at: int) -> int:
    return -(-at // _ALIGN) * _ALIGN
