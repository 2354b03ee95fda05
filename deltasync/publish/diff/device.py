"""Change detection for weights on an accelerator: two host waits per version, whatever the tensor count.

The CPU diff (:mod:`deltasync.publish.diff.snapshot`) expands each chunk's changes as soon as it
finds them. On an accelerator every such expansion (``nonzero``, a copy to the
host) makes the host wait for the device, hundreds of times per version. This
path queues everything and waits twice:

0. **Chunks**: a large tensor is compared in chunks of ``chunk`` elements; small
   tensors that lie one after another in the snapshot's memory (a
   :class:`~deltasync.publish.diff.snapshot.Snapshot` keeps them side by side in blocks, each at an
   8-byte boundary) are compared a run at a time, as one chunk: a model of
   thousands of small tensors (a Mixture-of-Experts model's experts, norms)
   costs a few ops per block instead of a few per tensor. A found element's
   tensor and index come from where it lies in the run.
1. **Search**, for every chunk, queued: cast to the published
   dtype (a run's tensors side by side, one call per source dtype), compare with the snapshot as
   8-byte words (four bf16 elements a compare, so the mask and the scan over it
   are a quarter of the elements'), take
   the positions of up to ``bound`` changed words (``nonzero_static``: a fixed
   size, no wait) and gather those words: six kernels per chunk. Then, once for a
   group of chunks, compare the gathered words' elements and keep up to the
   group's bound of changed elements: indices, new and old bit patterns, each
   chunk's after the last's. ``bound`` is twice what the chunk changed last
   version plus some slack (kept in a ``history`` the caller holds, the
   :class:`~deltasync.publish.diff.snapshot.Snapshot`): at RL learning rates the changed fraction
   moves little between steps. A chunk whose bound is above a sixteenth of its
   elements is searched element by element (most of its words change anyway).
2. **Wait 1**: per chunk, the changed words and elements found (and per tensor
   of a run, its changed elements) reach the host in one copy. A chunk that
   filled its bound (it may have more) is counted exactly, one more wait that
   version; a chunk without history (the first version) or one that changed
   densely last time was counted instead of searched (cast, compare, count),
   queued with the searches.
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
from itertools import islice

import torch

from ...tensors import BITS_BY_SIZE, TensorSpec, positions, segment_owners, segment_sums
from ...tensors.device import Phases, Tally, WaitCounter, to_device, to_host
from .chunks import Chunk, chunks

__all__ = ["DeviceChange", "GROUP", "SLACK", "changes_on_device", "host_waits", "phases", "searched_chunks"]


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


host_waits = WaitCounter()
"""``host_waits()``: the waits so far (two per call of :func:`changes_on_device` that found changes)."""
searched_chunks = Tally()
"""``searched_chunks()``: the chunks :func:`changes_on_device` has compared so far (a run of small tensors is one)."""
phases = Phases("deltasync.diff")
"""Host time of :func:`changes_on_device` by phase: ``search`` (queueing the searches), ``wait_found`` (wait 1)
and ``wait_changes`` (wait 2)."""


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
    jobs = list(chunks(published, live, chunk))
    searched_chunks.count += len(jobs)
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
            counted[k] = _count(job, scratch)
    with phases("search"):
        searched = [_search(jobs, group, bounds, scratch, words) for group, words in _groups(jobs, bounds)]  # queued
    host_waits.count += 1  # wait 1: the counts and what each search found, in one copy
    home = jobs[0].old.device
    found_on_device = [torch.cat([group.found.view(-1), group.counts]).to(home) for group in searched]
    found_on_device += [counts.to(home) for counts in counted.values()]
    with phases("wait_found"):
        flat = torch.cat(found_on_device).tolist()  # per search, its (words, elements) pairs and member counts
    exact: dict[int, list[int]] = {}  # chunk -> changed elements of each of its members
    found: dict[int, tuple[_Group, int]] = {}  # job -> (its search, where its changes start in it)
    unknown = []
    read = iter(flat)
    for group in searched:  # its (words, elements) pair per chunk, then its chunks' member counts
        pairs = list(islice(read, 2 * len(group.jobs)))
        at = 0
        for k, words, elements in zip(group.jobs, pairs[::2], pairs[1::2]):
            exact[k] = list(islice(read, len(jobs[k].members)))
            if words >= bounds[k]:  # the bound was reached: there may be more
                unknown.append(k)
            elif at + elements <= group.size:  # else cut by the group's element bound: searched again
                found[k] = (group, at)
            at += elements  # the elements of every word found take their place, a chunk's after the last's
    for k in counted:
        exact[k] = list(islice(read, len(jobs[k].members)))
    if unknown:  # one more wait, for the exact counts of the searches that overflowed
        host_waits.count += 1
        recount = iter(torch.cat([_count(jobs[k], scratch) for k in unknown]).tolist())
        for k in unknown:
            exact[k] = list(islice(recount, len(jobs[k].members)))
    per_tensor = [0] * len(specs)
    total: dict[int, int] = {}
    for k, job in enumerate(jobs):
        for (tensor, _, _), n in zip(job.members, exact[k]):
            per_tensor[tensor] += n
        total[k] = history[job.key] = sum(exact[k])
    dense = {i for i, n in enumerate(per_tensor) if n and n > dense_fraction * specs[i].numel}
    # Queued: dense tensors whole; chunks without complete results searched with their exact counts.
    whole = {i: to_host(_published_bits(live[i], published[i])) for i in sorted(dense)}
    wanted: dict[int, list[tuple[int, int]]] = {}  # per chunk: (tensor, count) of the members to read
    for k, job in enumerate(jobs):
        members = [(t, n) for (t, _, _), n in zip(job.members, exact[k]) if n and t not in dense]
        if members:
            wanted[k] = members
    used = list(wanted)
    again = {k: total[k] for k in used if k not in found}
    for group in (_search(jobs, members, again, scratch, words) for members, words in _groups(jobs, again)):
        at = 0
        for k in group.jobs:
            found[k] = (group, at)
            at += total[k]
    ends: dict[int, tuple[_Group, int]] = {}  # per search read from: how many of its changes are needed
    for k in used:
        group, at = found[k]
        ends[id(group)] = (group, max(ends.get(id(group), (group, 0))[1], at + total[k]))
    on_host = {key: group.to_host(end) for key, (group, end) in ends.items()}
    with phases("wait_changes"):
        host_waits.wait(*devices)  # wait 2: every copy above has landed
    # Each search's results cut into every member's changes by one split per column (a slice each costs more).
    cuts: dict[int, list[tuple[int, int, int, int]]] = {}  # per search: (start, count, tensor, chunk)
    for k in used:
        group, at = found[k]
        for (tensor, _, _), n in zip(jobs[k].members, exact[k]):
            if n and tensor not in dense:
                cuts.setdefault(id(group), []).append((at, n, tensor, k))
            at += n
    pieces: dict[int, list[tuple[int, tuple[torch.Tensor, ...]]]] = {}  # per tensor: (chunk, its changes there)
    for key, items in cuts.items():
        items.sort()
        sizes, owners, at = [], [], 0
        for start, n, tensor, k in items:
            if start > at:
                sizes.append(start - at)
                owners.append(None)
            sizes.append(n)
            owners.append((tensor, k))
            at = start + n
        columns = [t[:at].split(sizes) for t in on_host[key]]
        for owner, *piece in zip(owners, *columns):
            if owner is not None:
                pieces.setdefault(owner[0], []).append((owner[1], tuple(piece)))
    out = []
    for i, n in enumerate(per_tensor):
        if i in dense:
            out.append(DeviceChange(i, n, None, whole[i], None))
        elif n:
            parts = [piece for _, piece in sorted(pieces[i], key=lambda item: item[0])]  # in chunk order
            idx, new, old = parts[0] if len(parts) == 1 else (torch.cat(column) for column in zip(*parts))
            out.append(DeviceChange(i, n, idx, new, old))
    return out


def _groups(jobs: Sequence[Chunk], bounds: dict[int, int]) -> Iterator[tuple[list[int], int]]:
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


def _new_bits(job: Chunk, scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """The chunk's live weights as published bit patterns, on the snapshot's device (cast into a reused
    buffer; a run's tensors side by side in it, in one call)."""
    new = job.sources[0]
    if not job.run and new.dtype == job.published and new.device == job.old.device:
        return new.view(job.bits)
    key = (job.old.device, job.published)
    if key not in scratch or scratch[key].numel() < job.numel:
        scratch[key] = torch.empty(job.numel, dtype=job.published, device=job.old.device)
    # In stream order, the next chunk's cast waits for this chunk's reads of the buffer: no host wait.
    out = scratch[key][: job.numel]
    if not job.run:
        return out.copy_(new).view(job.bits)
    # One call per source dtype (the live weights; the padding's, from the snapshot), which CUDA runs as one
    # fused kernel where every source has one dtype: a few launches a run instead of one a tensor.
    calls: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for place, source in zip(out.split([t.numel() for t in job.sources]), job.sources):
        places, sources = calls.setdefault(source.dtype, ([], []))
        places.append(place)
        sources.append(source)
    for places, sources in calls.values():
        torch._foreach_copy_(places, sources)
    return out.view(job.bits)


def _count(job: Chunk, scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """Changed elements of each member of the chunk (int64, on the device; queued)."""
    changed = torch.ne(_new_bits(job, scratch), job.old)
    if len(job.members) == 1:
        return changed.sum().view(1)
    spans = to_device([[n for _, _, n in job.members]], job.old.device)[0]
    return segment_sums(changed, spans)


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
    counts: torch.Tensor
    """Per member of each chunk in turn, its changed elements in the words found (int64, on the device)."""

    def to_host(self, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``count`` changes, copied to the host asynchronously (read them after a wait)."""
        return to_host(self.index[:count]), to_host(self.new[:count]), to_host(self.old[:count])


def _search(
    jobs: Sequence[Chunk],
    members: list[int],
    bounds: dict[int, int],
    scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor],
    per_word: int,
) -> _Group:
    """Up to ``bounds[k]`` changed words of ``per_word`` elements of each chunk ``k`` of ``members``, and the
    changed elements in them (queued: a few ops per chunk, the rest once for the group).

    A word is 8 bytes of bit patterns (4 bf16 elements): comparing and scanning words moves a quarter of
    the mask an element-wise compare would, and only the words found are compared element by element.
    Each found element's tensor and index come from where it lies among the group's chunks laid end to
    end, against where each chunk's members (the tensors of a run) start there.
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
        new_rows.append(new.view(-1, per_word).index_select(0, rows))  # on a CPU, cheaper than indexing
        old_rows.append(old.view(-1, per_word).index_select(0, rows))
    # Once for the group: which found words are real, which of their elements changed, where those are.
    hit, new_all, old_all = torch.cat(words), torch.cat(new_rows), torch.cat(old_rows)
    size = hit.numel()
    chunk_rows, member_rows, at = [], [], 0  # at: where a chunk starts, in words, with the group end to end
    for k in members:
        chunk_rows.append([bounds[k], at, at + jobs[k].numel // per_word])
        start = at * per_word
        for _, first, count in jobs[k].members:
            member_rows.append([start, first])  # where it starts in the group, its index there
            start += count
        at += jobs[k].numel // per_word
    table = to_device(chunk_rows, device)
    spans = to_device([*member_rows, [at * per_word, 0]], device)  # and the group's end
    owner = segment_owners(table[:, 0], size)
    real = hit >= 0
    place = torch.where(real, hit + table[:, 1][owner], table[:, 2][owner])  # ascending; a slot left: its chunk's end
    changed = torch.ne(new_all, old_all).logical_and_(real.unsqueeze(1))
    per_word_changed = changed.sum(1)
    found = torch.stack([segment_sums(real, table[:, 0]), segment_sums(per_word_changed, table[:, 0])], 1)
    # Per member (every member starts on a word), its changes among the words found: prefix-sum differences.
    summed = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), per_word_changed.cumsum(0)])
    edges = torch.searchsorted(place, torch.div(spans[:, 0], per_word, rounding_mode="floor"))
    counts = summed[edges[1:]] - summed[edges[:-1]]
    at_found = positions(changed.view(-1), size, fill=-1).clamp_(min=0)  # among the found words' elements
    slot = torch.div(at_found, per_word, rounding_mode="floor")
    spot = place[slot].mul_(per_word).add_(at_found - slot * per_word)  # padding slots: garbage, never read
    member = torch.searchsorted(spans[:-1, 0].contiguous(), spot, right=True).sub_(1).clamp_(min=0)
    index = spot.sub_(spans[:, 0][member]).add_(spans[:, 1][member])
    return _Group(members, size, index, new_all.view(-1)[at_found], old_all.view(-1)[at_found], found, counts)
