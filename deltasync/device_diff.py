"""Change detection for weights on an accelerator: two host waits per version, whatever the tensor count.

The CPU diff (:mod:`deltasync.diff`) expands each chunk's changes as soon as it
finds them. On an accelerator every such expansion (``nonzero``, a copy to the
host) makes the host wait for the device, hundreds of times per version. This
path queues everything and waits twice:

1. **Search**, for every chunk of every tensor, queued: cast to the published
   dtype, compare with the snapshot as 8-byte words (four bf16 elements a
   compare, so the mask and the scan over it are a quarter of the elements'), take
   the positions of up to ``bound`` changed words (``nonzero_static``: a fixed
   size, no wait) and gather those words: six kernels per chunk. Then, once for a
   group of chunks, compare the gathered words' elements and keep up to the
   group's bound of changed elements: indices, new and old bit patterns, each
   chunk's after the last's. ``bound`` is twice what the chunk changed last
   version plus some slack (kept in a ``history`` the caller holds, the
   :class:`~deltasync.diff.Snapshot`): at RL learning rates the changed fraction
   moves little between steps. A chunk whose bound is above a sixteenth of its
   elements is searched element by element (most of its words change anyway).
2. **Wait 1**: per chunk, the changed words and elements found reach the host in
   one copy. A chunk that filled its bound (it may have more) is counted
   exactly, one more wait that version; a chunk without history (the first
   version) or one that changed densely last time was counted instead of
   searched (cast, compare, count), queued with the searches.
3. Tensors above ``dense_fraction`` are cast whole into an output; a chunk whose
   changes were not all found (counted, or cut by its group's bound) is searched
   now with its exact count as bound, which cuts nothing.
4. **Wait 2**: every output reaches the host in one asynchronous copy, into
   pinned memory on CUDA, and the host waits once for all of them; a tensor's
   changes are the slices of its chunks.

In the steady state the device reads the weights once (the cast, the word
compare) and scans a quarter-size mask; a version that changes much more than the
one before costs a second read of the chunks it overflowed. The scratch kept
between the two waits is about 24 bytes per changed element (each found
element's index and bits, at twice the last count). The code is
device-agnostic: CPU tensors run it too (tests prove it bit-exact against the
CPU diff on CPU tensors; ``diff(..., on_device=True)``), and :data:`host_waits`
counts its waits so a CPU run shows the structure.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from .tensors import BITS_BY_SIZE, TensorSpec, positions, segment_owners, segment_sums, settle

__all__ = ["DeviceChange", "GROUP", "SLACK", "WaitCounter", "changes_on_device", "host_waits", "to_device", "to_host"]

_WORD = 8  # bytes compared at once by a search


@dataclass(frozen=True, slots=True)
class DeviceChange:
    """What :func:`changes_on_device` found for one tensor, on the host."""

    index: int
    """Position of the tensor in the ``specs`` given."""
    nnz: int
    """Elements whose bit pattern differs."""
    indices: torch.Tensor | None
    """Sorted flat indices (int64, CPU); ``None`` when the tensor is carried whole."""
    values: torch.Tensor
    """New bit patterns (CPU): at ``indices``, or every element."""
    base: torch.Tensor | None
    """Old bit patterns at ``indices``; ``None`` when carried whole."""


class WaitCounter:
    """How many times this process waited for a device's results in one device path (callable: the count)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count

    def wait(self, *devices: torch.device) -> None:
        """Wait for everything queued on ``devices`` (their copies to the host included), and count it once."""
        self.count += 1
        settle(devices)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy of ``tensor`` into host memory (pinned, on CUDA): read it after a wait."""
    pinned = tensor.device.type == "cuda"
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned).copy_(tensor, non_blocking=pinned)


def to_device(values: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """A small int64 table from the host, copied to ``device`` without a wait (through pinned memory on
    CUDA: a copy from pageable memory would wait for everything queued before it)."""
    table = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


host_waits = WaitCounter()
"""``host_waits()``: the waits so far (two per call of :func:`changes_on_device` that found changes)."""


SLACK = 1024
"""Changed elements a search may find beyond twice its chunk's last count: a quiet chunk's bound."""
GROUP = 1 << 22
"""Words searched per group (the chunks whose found words are expanded together): about 300 MB of scratch."""


def changes_on_device(
    specs: Sequence[TensorSpec],
    published: Sequence[torch.Tensor],
    live: Sequence[torch.Tensor],
    *,
    chunk: int,
    dense_fraction: float,
    history: MutableMapping[tuple[int, int, int], int] | None = None,
) -> list[DeviceChange]:
    """The changed elements of every tensor, computed where the snapshot lives, with two host waits in all.

    Args:
        specs: the tensors' specs, in publishing order.
        published: per tensor, the snapshot's copy (published dtype, contiguous, on its device).
        live: per tensor, the live weights (same shape; any floating dtype and device).
        chunk: elements cast and compared per step (bounds the scratch memory).
        dense_fraction: changed fraction above which a tensor is carried whole.
        history: changed elements per chunk in the last call, read for the bounds of this call's
            searches and updated with its counts (the caller keeps it between calls; without it every
            chunk is counted first and searched after).

    Returns:
        `list[DeviceChange]`: the tensors that changed, in order; indices and values on the host.
    """
    jobs = list(_chunks(specs, published, live, chunk))
    if not jobs:
        return []
    history = {} if history is None else history
    devices = {job.old.device for job in jobs}
    scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    bounds: dict[int, int] = {}
    counted: dict[int, torch.Tensor] = {}
    for k, job in enumerate(jobs):  # queued: a count where no recent count bounds a search
        last = history.get(job.key)
        if last is not None and last <= dense_fraction * job.numel:
            bounds[k] = min(2 * last + SLACK, job.numel)
        else:
            counted[k] = torch.ne(_new_bits(job, scratch), job.old).sum()
    with record_function("deltasync.diff.search"):
        searched = [_search(jobs, group, bounds, scratch, words) for group, words in _groups(jobs, bounds)]  # queued
    host_waits.count += 1  # wait 1: the counts and what each search found, in one copy
    home = jobs[0].old.device
    found_on_device = [group.found.view(-1).to(home) for group in searched]
    if counted:
        found_on_device.append(torch.stack(list(counted.values())).to(home))
    with record_function("deltasync.diff.wait_found"):
        flat = torch.cat(found_on_device).tolist()  # searches' (words, elements) pairs, then the counts
    exact = dict(zip(counted, flat[len(flat) - len(counted) :]))
    found: dict[int, tuple[_Group, int]] = {}  # job -> (its search, where its changes start in it)
    unknown = []
    at_flat = 0
    for group in searched:
        at = 0
        for k in group.jobs:
            words, elements = flat[at_flat], flat[at_flat + 1]
            at_flat += 2
            if words >= bounds[k]:  # the bound was reached: there may be more
                unknown.append(k)
            else:
                exact[k] = elements
                if at + elements <= group.size:  # else cut by the group's element bound: searched again
                    found[k] = (group, at)
            at += elements  # the elements of every word found take their place, a chunk's after the last's
    if unknown:  # one more wait, for the exact counts of the searches that overflowed
        host_waits.count += 1
        recount = torch.stack([torch.ne(_new_bits(jobs[k], scratch), jobs[k].old).sum() for k in unknown])
        exact.update(zip(unknown, recount.tolist()))
    per_tensor = [0] * len(specs)
    for k, job in enumerate(jobs):
        per_tensor[job.tensor] += exact[k]
        history[job.key] = exact[k]
    dense = {i for i, n in enumerate(per_tensor) if n and n > dense_fraction * specs[i].numel}
    # Queued: dense tensors whole; chunks without complete results searched with their exact counts.
    whole = {i: to_host(_published_bits(live[i], published[i])) for i in sorted(dense)}
    again = {k: exact[k] for k, job in enumerate(jobs) if exact[k] and job.tensor not in dense and k not in found}
    for group in (_search(jobs, members, again, scratch, words) for members, words in _groups(jobs, again)):
        at = 0
        for k in group.jobs:
            found[k] = (group, at)
            at += exact[k]
    used = [k for k, job in enumerate(jobs) if exact[k] and job.tensor not in dense]
    ends: dict[int, tuple[_Group, int]] = {}  # per search read from: how many of its changes are needed
    for k in used:
        group, at = found[k]
        ends[id(group)] = (group, max(ends.get(id(group), (group, 0))[1], at + exact[k]))
    on_host = {key: group.to_host(end) for key, (group, end) in ends.items()}
    with record_function("deltasync.diff.wait_changes"):
        host_waits.wait(*devices)  # wait 2: every copy above has landed
    pieces: dict[int, list[tuple[torch.Tensor, ...]]] = {}
    for k in used:
        group, at = found[k]
        pieces.setdefault(jobs[k].tensor, []).append(tuple(t[at : at + exact[k]] for t in on_host[id(group)]))
    out = []
    for i, n in enumerate(per_tensor):
        if i in dense:
            out.append(DeviceChange(i, n, None, whole[i], None))
        elif n:
            parts = pieces[i]
            idx, new, old = parts[0] if len(parts) == 1 else (torch.cat(column) for column in zip(*parts))
            out.append(DeviceChange(i, n, idx, new, old))
    return out


@dataclass(frozen=True, slots=True)
class _Chunk:
    tensor: int
    start: int
    new: torch.Tensor
    old: torch.Tensor
    bits: torch.dtype
    published: torch.dtype

    @property
    def numel(self) -> int:
        return self.old.numel()

    @property
    def key(self) -> tuple[int, int, int]:
        """Which chunk this is, from one call to the next (its history entry)."""
        return self.tensor, self.start, self.old.numel()

    @property
    def per_word(self) -> int:
        """Elements per 8-byte word compared at once: 1 where the chunk cannot be viewed as words (a live
        tensor at an odd offset, a chunk's last few elements)."""
        width = self.old.element_size()
        cast = self.new.dtype != self.published or self.new.device != self.old.device  # into aligned scratch
        per_word = _WORD // width
        whole = self.numel % per_word == 0 and self.start % per_word == 0 and self.old.data_ptr() % _WORD == 0
        return per_word if whole and (cast or self.new.data_ptr() % _WORD == 0) else 1


def _chunks(
    specs: Sequence[TensorSpec], published: Sequence[torch.Tensor], live: Sequence[torch.Tensor], chunk: int
) -> Iterator[_Chunk]:
    """Every tensor in chunks of ``chunk`` elements; a chunk's last few elements that do not fill an
    8-byte word are a chunk of their own (compared element by element)."""
    for i, (spec, snap, weights) in enumerate(zip(specs, published, live)):
        bits = BITS_BY_SIZE[snap.element_size()]
        per_word = _WORD // snap.element_size()
        old, new = snap.view(bits).view(-1), weights.detach().reshape(-1)
        for start in range(0, spec.numel, chunk):
            stop = min(start + chunk, spec.numel)
            cut = stop - (stop - start) % per_word if stop - start > per_word else stop
            for a, b in ((start, cut), (cut, stop)):
                if b > a:
                    yield _Chunk(i, a, new[a:b], old[a:b], bits, snap.dtype)


def _groups(jobs: Sequence[_Chunk], bounds: dict[int, int]) -> Iterator[tuple[list[int], int]]:
    """The chunks of ``bounds`` in groups of one device, bit width and word size (elements per word), of
    at most :data:`GROUP` words each (or one chunk), each group's chunks in order.

    A chunk is searched by words while its bound is at most a sixteenth of its elements (about 6 %
    changed); above that most words hold a change, and expanding every found word to its elements would
    only add scratch, so its elements are searched one by one. Chunks of different kinds that alternate
    (a tensor whose size is not a whole number of words leaves a tail of a few elements, searched one by
    one) still share a group with their own kind: a group per chunk would cost its dozen ops per chunk.
    """
    open_groups: dict[tuple[torch.device, torch.dtype, int], tuple[list[int], int]] = {}
    for k in sorted(bounds):
        job = jobs[k]
        per_word = job.per_word if bounds[k] * 16 <= job.numel else 1
        kind = (job.old.device, job.bits, per_word)
        group, size = open_groups.get(kind, ([], 0))
        if group and size + bounds[k] > GROUP:
            yield group, per_word
            group, size = [], 0
        group.append(k)
        open_groups[kind] = (group, size + bounds[k])
    for (_, _, per_word), (group, _) in open_groups.items():
        yield group, per_word


def _new_bits(job: _Chunk, scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """The chunk's live weights as published bit patterns, on the snapshot's device (cast into a reused buffer)."""
    if job.new.dtype == job.published and job.new.device == job.old.device:
        return job.new.view(job.bits)
    key = (job.old.device, job.published)
    if key not in scratch or scratch[key].numel() < job.new.numel():
        scratch[key] = torch.empty(max(job.new.numel(), job.old.numel()), dtype=job.published, device=job.old.device)
    # In stream order, the next chunk's cast waits for this chunk's reads of the buffer: no host wait.
    return scratch[key][: job.new.numel()].copy_(job.new).view(job.bits)


def _published_bits(live: torch.Tensor, published: torch.Tensor) -> torch.Tensor:
    """All of ``live`` as published bit patterns, flat, on the snapshot's device."""
    flat = torch.empty(published.numel(), dtype=published.dtype, device=published.device)
    return flat.copy_(live.detach().reshape(-1)).view(BITS_BY_SIZE[published.element_size()])


@dataclass(frozen=True, slots=True)
class _Group:
    """The changes a search found in a group of chunks, on the device, each chunk's after the last's."""

    jobs: list[int]
    size: int
    """Changed elements it has room for (past those found: padding)."""
    index: torch.Tensor
    """Flat indices in their tensors (int64), ascending per chunk."""
    new: torch.Tensor
    old: torch.Tensor
    found: torch.Tensor
    """Per chunk, ``[changed words found, changed elements in them]`` (int64, on the device)."""

    def to_host(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``count`` changes, copied to the host asynchronously (read them after a wait)."""
        return to_host(self.index[:count]), to_host(self.new[:count]), to_host(self.old[:count])


def _search(
    jobs: Sequence[_Chunk],
    members: list[int],
    bounds: dict[int, int],
    scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor],
    per_word: int,
) -> _Group:
    """Up to ``bounds[k]`` changed words of ``per_word`` elements of each chunk ``k`` of ``members``, and the
    changed elements in them (queued: a few ops per chunk, the rest once for the group).

    A word is 8 bytes of bit patterns (4 bf16 elements): comparing and scanning words moves a quarter of
    the mask an element-wise compare would, and only the words found are compared element by element.
    """
    device = jobs[members[0]].old.device
    words, new_rows, old_rows = [], [], []
    for k in members:  # per chunk: cast, compare words, find up to the bound, gather those words
        job = jobs[k]
        new, old = _new_bits(job, scratch), job.old
        if per_word > 1:
            hit = positions(torch.ne(new.view(torch.int64), old.view(torch.int64)), bounds[k], fill=-1)
        else:
            hit = positions(torch.ne(new, old), bounds[k], fill=-1)
        rows = hit.clamp(min=0)
        words.append(hit)
        new_rows.append(new.view(-1, per_word).index_select(0, rows))  # on a CPU, a third of an indexing's time
        old_rows.append(old.view(-1, per_word).index_select(0, rows))
    # Once for the group: which found words are real, which of their elements changed, where those are.
    hit, new_all, old_all = torch.cat(words), torch.cat(new_rows), torch.cat(old_rows)
    size = hit.numel()
    table = to_device([[bounds[k], jobs[k].start // per_word] for k in members], device)
    owner = segment_owners(table[:, 0], size)
    real = hit >= 0
    changed = torch.ne(new_all, old_all).logical_and_(real.unsqueeze(1))
    found = torch.stack([segment_sums(real, table[:, 0]), segment_sums(changed.sum(1), table[:, 0])], 1)
    at = positions(changed.view(-1), size, fill=-1).clamp_(min=0)  # among the found words' elements
    slot = torch.div(at, per_word, rounding_mode="floor")
    word = hit.add_(table[:, 1][owner])[slot]  # in the tensor (padding slots hold garbage, never read)
    index = word.mul_(per_word).add_(at - slot * per_word)
    return _Group(members, size, index, new_all.view(-1)[at], old_all.view(-1)[at], found)
