"""Exact change detection against the last *published* weights.

The :class:`Snapshot` holds one copy of what was last published, in the
published dtype (2 bytes per parameter for bf16) on the parameters' own device.
:func:`diff` compares the live parameters against it bit for bit, chunk by
chunk, and returns a :class:`ChangeSet`: the flat indices, the new bit patterns
and the old bit patterns of every element that changed. It does not modify the
snapshot; :meth:`Snapshot.advance` does that once a version is committed, so the
snapshot always equals the last version readers can see (invariant 2).

Peak extra memory is one chunk (the cast of ``chunk`` elements plus a boolean
mask, both reused across chunks) plus the changes found, never a second copy of
a tensor. A tensor whose changes are too dense to be worth indexing is captured
whole (``dense``), which also bounds the size of the index arrays.

Speed: the comparison reads both sides as int64 words (4 bf16 elements per
compare), so the one full pass over the weights beats a bare ``torch.ne`` over
elements (``benchmarks/device_sync.py``, its ``diff`` row); only the few words
that differ are expanded to elements, with numpy (cheaper per call than torch).
A snapshot off the CPU takes :mod:`deltasync.publish.diff.device` instead: the
same bits, with two host waits per version in place of a few per chunk. What
remains is bounded by memory: the fp32 -> bf16 cast of fp32 masters and the
gather of the changed words after the compare.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch

from ...errors import TensorMismatch
from ...tensors import (
    BITS_BY_SIZE,
    NUMPY_BITS_BY_SIZE,
    ChangeSet,
    TensorChange,
    TensorSpec,
    bits_view,
    check_publishable,
    published_dtype,
    published_tensors,
    settle,
    stage,
    write_at,
)
from ...util.collector import collector_paused
from .chunks import blocks
from .device import changes_on_device

__all__ = ["Snapshot", "diff", "diff_stream", "DEFAULT_CHUNK", "DEVICE_CHUNK", "DENSE_FRACTION"]

# Elements compared per step: 4 Mi elements keep the fp32 -> bf16 cast (8 MiB)
# and the word mask (1 MiB) small while amortising torch's per-op overhead;
# smaller chunks are slower, larger ones no faster.
DEFAULT_CHUNK = 1 << 22
# Elements per step of the device path (deltasync.publish.diff.device). There each step queues some 35 torch calls,
# so 4 Mi-element chunks would leave a GPU waiting for its host: a 1B-parameter model is 256 of them.
# 32 Mi elements make that one chunk per tensor up to 32M parameters, for 64 MiB of bf16 scratch and a
# 32 MiB mask on the device.
DEVICE_CHUNK = 1 << 25
# Above this fraction of changed elements a tensor is captured whole (int32 index + bf16 value, 6 bytes per
# change, would cost more than 2 bytes per element); the encoder then sends it whole or as its changes,
# whichever its codec makes smaller.
DENSE_FRACTION = 1 / 3
# Elements are compared as int64 words (4 bf16 or 2 fp32 per compare).
_WORD_BYTES = 8
# Below this many mask bytes a plain flatnonzero beats the two-level scan.
_TWO_LEVEL_MIN = 1 << 12


class Snapshot:
    """The last published weights, one contiguous copy per tensor in the published dtype.

    :meth:`capture` keeps consecutive small tensors of one dtype and device side by side in shared blocks
    (see :func:`~deltasync.publish.diff.chunks.blocks`), which the device path compares a block at a time.

    Args:
        tensors (`Mapping[str, torch.Tensor]`): published name -> copy (any shape).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = dict(tensors)
        self.specs = tuple(TensorSpec.of(name, t) for name, t in self._tensors.items())
        # Changed elements per chunk in the last device-path diff: the bounds of the next one's searches.
        self._history: dict[tuple[int, int, int], int] = {}

    @classmethod
    def capture(
        cls,
        source: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype | None = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> Snapshot:
        """Copy the current weights in the published dtype.

        Args:
            source (`nn.Module` or `Mapping[str, Tensor]`): the trainer's weights.
            dtype (`torch.dtype`, *optional*, defaults to `torch.bfloat16`): the
                published dtype; ``None`` publishes each tensor in its own dtype (as do the
                tensors a source names in ``own_dtype``, see :func:`~deltasync.tensors.published_dtype`).
            device (*optional*): where to keep the copy; defaults to each tensor's device.
        """
        found = [(name, tensor.detach(), published_dtype(source, name, tensor, dtype))
                 for name, tensor in published_tensors(source)]
        places = [(t.numel(), kind, torch.device(device or t.device)) for _, t, kind in found]
        copies = {}
        for block in blocks(places, DEVICE_CHUNK):
            # Always contiguous, in logical (row-major) order, whatever the live tensor's strides:
            # flat indices mean the same thing on both sides of the wire.
            last, end = block[-1]
            _, kind, where = places[last]
            memory = torch.empty(end + places[last][0], dtype=kind, device=where)
            for k, at in block:
                name, tensor, _ = found[k]
                copies[name] = memory[at : at + tensor.numel()].view(tensor.shape).copy_(tensor)
        settle(t.device for t in copies.values())  # read next on the publisher's thread (the first anchor)
        return cls(copies)

    @classmethod
    def capture_stream(
        cls, stream: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype | None = torch.bfloat16,
    ) -> Snapshot:
        """Copy weights that arrive one tensor at a time (a gathering trainer's stream), each as it arrives:
        memory is the copy plus the tensor in hand, never a second copy of the model.

        Raises:
            `ConfigError`: a tensor that cannot be published exactly. `TensorMismatch`: a name twice.
        """
        copies: dict[str, torch.Tensor] = {}
        for name, tensor in stream:
            if name in copies:
                raise TensorMismatch(f"{name} arrived twice in one version's stream", name=name)
            check_publishable(name, tensor)
            copies[name] = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=tensor.device)
            copies[name].copy_(tensor.detach())
            del tensor  # let it go before the stream makes the next one
        settle(t.device for t in copies.values())
        return cls(copies)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def items(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs in publishing order."""
        return self._tensors.items()

    @property
    def nbytes(self) -> int:
        """Memory held by the snapshot."""
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    @collector_paused()  # a few objects a changed tensor: no collector walks amid them (see there)
    def advance(self, changes: ChangeSet) -> None:
        """Write a committed change set into the snapshot (after its manifest is written).

        The changes of a snapshot off the CPU reach it through one host buffer per dtype and one copy each
        (:func:`~deltasync.tensors.stage`), not a copy (and a wait) per tensor."""
        away: dict[torch.device, list[TensorChange]] = {}
        for change in changes.changes:
            device = self._tensors[change.spec.name].device
            if device.type == "cpu":
                self._write(change.spec.name, change.indices, change.values)
            else:
                away.setdefault(device, []).append(change)
        for device, group in away.items():
            moved = iter(stage([t for c in group for t in (c.indices, c.values) if t is not None], device))
            for change in group:
                self._write(change.spec.name, None if change.indices is None else next(moved), next(moved))
        settle(self._tensors[c.spec.name].device for c in changes.changes)  # read next by the training thread's diff

    def _write(self, name: str, indices: torch.Tensor | None, values: torch.Tensor) -> None:
        """Bit patterns ``values`` into tensor ``name`` at flat ``indices`` (all of it where ``None``), on its
        device."""
        bits = bits_view(self._tensors[name]).view(-1)
        if indices is None:
            bits.copy_(values.view(-1))
        else:
            write_at(bits, indices, values)


@collector_paused()  # on the training thread: no collection of a trainer's heap amid a version's few objects a tensor
def diff(
    snapshot: Snapshot,
    source: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    chunk: int | None = None,
    dense_fraction: float = DENSE_FRACTION,
    on_device: bool = False,
) -> ChangeSet:
    """Find every element whose published bit pattern differs from the snapshot.

    Args:
        snapshot (`Snapshot`): the last published weights.
        source (`nn.Module` or `Mapping[str, Tensor]`): the live weights, in any
            floating dtype (fp32 masters are cast to the published dtype chunk by chunk).
        chunk (`int`, *optional*): elements compared per step (bounds the scratch memory); defaults to
            :data:`DEFAULT_CHUNK` on the CPU path and :data:`DEVICE_CHUNK` on the device path.
        dense_fraction (`float`, *optional*): changed fraction above which a tensor
            is captured whole.
        on_device (`bool`, *optional*): find the changes with
            :func:`~deltasync.publish.diff.device.changes_on_device` (two host waits per call
            instead of a few per chunk) also when the snapshot is on the CPU; it always
            does when any snapshot tensor is elsewhere. The same bits either way.

    Returns:
        `ChangeSet`: the changes, indices and values on the CPU.

    Raises:
        `TensorMismatch`: the live weights no longer match the snapshot's names or shapes.
    """
    if chunk is not None and chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    live = dict(published_tensors(source))
    if live.keys() != {s.name for s in snapshot.specs}:
        missing = sorted({s.name for s in snapshot.specs} - live.keys())
        extra = sorted(live.keys() - {s.name for s in snapshot.specs})
        raise TensorMismatch(
            f"model parameters changed since the snapshot (missing {missing[:5]}, new {extra[:5]}); "
            "publish a new anchor with a fresh Publisher",
            missing=missing,
            extra=extra,
        )
    for spec in snapshot.specs:
        _check_shape(spec, live[spec.name])
    if on_device or any(t.device.type != "cpu" for _, t in snapshot.items()):
        published = [snapshot[s.name] for s in snapshot.specs]
        found = changes_on_device(snapshot.specs, published, [live[s.name] for s in snapshot.specs],
                                  chunk=chunk or DEVICE_CHUNK, dense_fraction=dense_fraction,
                                  history=snapshot._history)
        return ChangeSet(tuple(
            TensorChange(snapshot.specs[c.index], c.indices, c.values, c.base, c.nnz,
                         _bits(published[c.index]).view(-1))
            for c in found
        ), snapshot.specs)
    scratch = _Scratch(chunk or DEFAULT_CHUNK)
    changes = []
    for spec in snapshot.specs:
        change = _diff_tensor(spec, snapshot[spec.name], live[spec.name], scratch, dense_fraction)
        if change is not None:
            changes.append(change)
    return ChangeSet(tuple(changes), snapshot.specs)


@collector_paused()
def diff_stream(
    snapshot: Snapshot, stream: Iterable[tuple[str, torch.Tensor]], *, chunk: int | None = None,
    dense_fraction: float = DENSE_FRACTION,
) -> ChangeSet:
    """:func:`diff` of weights that arrive one tensor at a time: each is compared with the snapshot as it arrives
    and let go, so memory stays the snapshot, the tensor in hand and the changes found.

    Every tensor is compared on the host path, one at a time (the device path batches a version's tensors).

    Raises:
        `TensorMismatch`: a name the snapshot lacks, a name twice, a shape that differs, or a tensor missing
            from the stream.
    """
    if chunk is not None and chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    specs = {s.name: s for s in snapshot.specs}
    scratch = _Scratch(chunk or DEFAULT_CHUNK)
    found: dict[str, TensorChange] = {}
    seen: set[str] = set()
    for name, tensor in stream:
        spec = specs.get(name)
        if spec is None or name in seen:
            raise TensorMismatch(
                f"{name} {'arrived twice in one version' if spec else 'is not in the published model'}; publish "
                "a new anchor with a fresh Publisher if the model changed", name=name,
            )
        seen.add(name)
        _check_shape(spec, tensor)
        change = _diff_tensor(spec, snapshot[name], tensor, scratch, dense_fraction)
        del tensor  # let it go before the stream makes the next one
        if change is not None:
            found[name] = change
    missing = sorted(specs.keys() - seen)
    if missing:
        raise TensorMismatch(f"the stream left out {missing[:5]} ({len(missing)} tensors) of the published model",
                             missing=missing)
    return ChangeSet(tuple(found[s.name] for s in snapshot.specs if s.name in found), snapshot.specs)


class _Scratch:
    """Buffers reused by every chunk of one :func:`diff` call.

    Casting into a fresh tensor per chunk costs about as much in page faults as
    the cast itself, so the cast and the mask each get one ``chunk``-sized buffer per
    device, allocated on first use and dropped with the call (not kept on the
    snapshot, so concurrent diffs cannot share one).
    """

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self._cast: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._mask: dict[torch.device, torch.Tensor] = {}

    def cast(self, piece: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``piece`` converted to ``dtype`` on ``device``, written into the reused buffer."""
        key = (device, dtype)
        if key not in self._cast:
            self._cast[key] = torch.empty(self.chunk, dtype=dtype, device=device)
        out = self._cast[key][: piece.numel()]
        out.copy_(piece)
        return out

    def mask(self, size: int, device: torch.device) -> torch.Tensor:
        """A bool buffer of ``size <= chunk`` elements, for ``torch.ne(..., out=)``."""
        if device not in self._mask:
            self._mask[device] = torch.empty(self.chunk, dtype=torch.bool, device=device)
        return self._mask[device][:size]


def _diff_tensor(
    spec: TensorSpec,
    published: torch.Tensor,
    live: torch.Tensor,
    scratch: _Scratch,
    dense_fraction: float,
) -> TensorChange | None:
    flat = live.detach().reshape(-1)
    old_bits = _bits(published).view(-1)
    found: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    limit = dense_fraction * spec.numel
    nnz = 0
    whole = flat.numel() <= scratch.chunk  # the common case: no slicing (each torch view costs a call)
    for start in range(0, flat.numel(), scratch.chunk):
        new = _published_bits(flat if whole else flat[start : start + scratch.chunk], published, scratch)
        old = old_bits if whole else old_bits[start : start + scratch.chunk]
        if nnz > limit:  # already dense: only count, keep nothing
            nnz += int(torch.count_nonzero(torch.ne(new, old)))
            continue
        idx, new_values, old_values = _changed(new, old, scratch, start)
        if idx.size == 0:
            continue
        nnz += idx.size
        if nnz > limit:
            found.clear()
            continue
        found.append((idx, new_values, old_values))
    if nnz == 0:
        return None
    if nnz > limit:
        values = torch.empty(spec.numel, dtype=old_bits.dtype)
        values.view(published.dtype).copy_(flat)  # cast and move to the CPU in one copy
        return TensorChange(spec, None, values, None, nnz, old_bits)
    idx, new_values, old_values = (torch.from_numpy(_concat(parts)) for parts in zip(*found))
    return TensorChange(spec, idx, new_values, old_values, nnz, old_bits)


def _check_shape(spec: TensorSpec, live: torch.Tensor) -> None:
    if tuple(live.shape) != spec.shape:
        raise TensorMismatch(
            f"{spec.name}: shape {tuple(live.shape)} differs from the published {spec.shape}",
            name=spec.name,
        )


def _concat(parts: tuple[np.ndarray, ...]) -> np.ndarray:
    # numpy, not torch.cat: a parallel copy of a few MB is slower than one thread on a busy host.
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _published_bits(piece: torch.Tensor, published: torch.Tensor, scratch: _Scratch) -> torch.Tensor:
    """Bit patterns of ``piece`` in the published dtype, on the snapshot's device.

    A piece already in the published dtype, on that device and word-aligned is
    read in place; anything else (fp32 masters, another device, an odd storage
    offset) is converted into the scratch buffer, never into a fresh tensor.
    """
    if piece.dtype == published.dtype and piece.device == published.device and _word_aligned(piece):
        return _bits(piece)
    return _bits(scratch.cast(piece, published.dtype, published.device))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    # tensors.bits_view, minus its dtype probe (a tensor allocation per call).
    return tensor.view(BITS_BY_SIZE[tensor.element_size()])


def _word_aligned(tensor: torch.Tensor) -> bool:
    """Whether a contiguous 1-D tensor can be read as int64 words.

    ``view(torch.int64)`` needs the storage offset to be a whole number of
    words, and the address must be word-aligned too (a storage can start
    anywhere, e.g. ``torch.frombuffer``; misaligned loads fault on CUDA).
    """
    return tensor.storage_offset() * tensor.element_size() % _WORD_BYTES == 0 and tensor.data_ptr() % _WORD_BYTES == 0


def _changed(
    new: torch.Tensor, old: torch.Tensor, scratch: _Scratch, offset: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices (int64, plus ``offset``), new and old bit patterns, on the host, of the elements that differ.

    Both sides are read as int64 words (4 bf16 elements each): ``torch.ne``
    then writes a quarter of the mask and runs faster than over elements, and
    only the few words that differ are compared element by element. Elements
    past the last whole word, or of a tensor not aligned to words, are compared
    one by one.
    """
    size = new.numel()
    per = _WORD_BYTES // new.element_size()
    head = size - size % per if _word_aligned(new) and _word_aligned(old) else 0
    if head == size:  # the common case, without slicing (each torch view costs a call)
        return _changed_words(new, old, scratch, per, offset)
    parts = [_changed_words(new[:head], old[:head], scratch, per, offset)] if head else []
    if head and size - head < per:  # a few elements past the last word: numpy, cheaper than torch's ops here
        tail_new, tail_old = new[head:].numpy(), old[head:].numpy()
        inner = (tail_new != tail_old).nonzero()[0]
        if inner.size:
            parts.append((inner + (offset + head), tail_new[inner], tail_old[inner]))
    else:
        tail_new, tail_old = new[head:], old[head:]
        parts.append(_expand(tail_new, tail_old, torch.ne(tail_new, tail_old), 1, offset + head))
    idx, new_values, old_values = (_concat(p) for p in zip(*parts))
    return idx, new_values, old_values


def _changed_words(
    new: torch.Tensor, old: torch.Tensor, scratch: _Scratch, per: int, offset: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_changed` over whole int64 words of ``per`` elements each."""
    words_new, words_old = new.view(torch.int64), old.view(torch.int64)
    mask = torch.ne(words_new, words_old, out=scratch.mask(words_new.numel(), new.device))
    return _expand(words_new, words_old, mask, per, offset)


def _expand(
    words_new: torch.Tensor, words_old: torch.Tensor, mask: torch.Tensor, per: int, offset: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Element indices and bit patterns behind a CPU word mask (``per`` elements a word).

    After the mask the arrays are small, and a numpy call costs a fraction of a
    torch op, which adds up over hundreds of tensors. The gather stays in torch:
    the words are no longer in cache after the compare, and ``index_select``
    spreads the cache misses over torch's threads, ahead of numpy's
    single-threaded take.
    """
    hit = _sparse_nonzero(mask.numpy())
    index = torch.from_numpy(hit)
    new_values = words_new.index_select(0, index).numpy()
    old_values = words_old.index_select(0, index).numpy()
    if per > 1:
        elem = NUMPY_BITS_BY_SIZE[_WORD_BYTES // per]
        new_values, old_values = new_values.view(elem), old_values.view(elem)
        # Every hit word holds a change, so this mask is dense: a plain scan is fastest.
        inner = (new_values != old_values).nonzero()[0]
        shift = per.bit_length() - 1
        hit = (hit[inner >> shift] << shift) | (inner & (per - 1))
        new_values, old_values = new_values[inner], old_values[inner]
    if offset:
        hit += offset
    return hit, new_values, old_values


def _sparse_nonzero(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero`` of a 1-D bool mask, faster when few elements are set.

    ``flatnonzero`` walks a bool mask byte by byte; reading it
    as int64 words first finds the few non-zero words (8 elements each) in a
    pass 8x shorter, and only those are expanded.
    """
    # ndarray.nonzero() rather than np.flatnonzero: the same scan without its Python wrappers.
    if mask.size < _TWO_LEVEL_MIN:
        return mask.nonzero()[0]
    head = mask.size - mask.size % 8
    words = mask[:head].view(np.int64)
    hit = (words != 0).nonzero()[0]
    inner = words[hit].view(np.bool_).nonzero()[0]
    found = (hit[inner >> 3] << 3) | (inner & 7)
    if head < mask.size:
        found = np.concatenate([found, mask[head:].nonzero()[0] + head])
    return found
