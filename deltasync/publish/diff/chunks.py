"""How the diff's device path cuts weights into chunks, and how a snapshot lays small tensors out for it.

A chunk is what :func:`~deltasync.publish.diff.device.changes_on_device` compares in one
step: a slice of a large tensor, or a run of whole small tensors that lie one
after another in the snapshot's memory. :func:`blocks` is the layout
:meth:`~deltasync.publish.diff.snapshot.Snapshot.capture` gives the snapshot so that small tensors
form such runs: consecutive tensors of one dtype and device side by side, each at
an 8-byte boundary (so a run compares as 8-byte words, and each tensor alone too).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ...tensors import BITS_BY_SIZE

__all__ = ["CPU_RUN", "RUN_TENSOR", "WORD", "Chunk", "blocks", "chunks", "run_limit", "runs"]

WORD = 8
"""Bytes compared at once by a search (four bf16 elements)."""
CPU_RUN = 1 << 21
"""Elements of a run of small tensors on a CPU (and of a snapshot's block there): its cast (4 MB of bf16)
is still in the caches when it is compared, where a run of a GPU's size would have left them. A GPU reads
and writes its memory at the same cost whatever the run, and runs up to the chunk size."""


RUN_TENSOR = 1 << 22
"""The largest tensor a run takes (4Mi elements). A GPU compares a tensor of that size in a few
microseconds, less than the host spends queueing its half-dozen kernels, so smaller tensors gain from
sharing a chunk; a larger tensor keeps the GPU busy for as long as its launches take, and alone it is
compared in place (a run's tensors are first copied side by side: for live weights already in the
published dtype, a pass that a tensor alone does not need)."""


def run_limit(device: torch.device, chunk: int) -> int:
    """Elements a run of small tensors (and a snapshot's block of them) may hold on ``device``."""
    return min(chunk, CPU_RUN) if device.type == "cpu" else chunk


def blocks(places: Sequence[tuple[int, torch.dtype, torch.device]], size: int) -> list[list[tuple[int, int]]]:
    """Which memory each tensor of ``places`` (``(numel, dtype, device)`` each, in order) goes to: consecutive
    tensors of one dtype and device of up to :data:`RUN_TENSOR` elements share a block of up to ``size``
    elements (:func:`run_limit`), each at an 8-byte boundary; any other tensor is a block of its own. Per
    block, its tensors' ``(position, offset)``.

    The device path compares a run of small tensors that lie one after another as one chunk
    (:func:`runs`, :func:`~deltasync.publish.diff.device.changes_on_device`): a few ops a block instead of a few a
    tensor.
    """
    out: list[list[tuple[int, int]]] = []
    end = 0
    for k, (numel, kind, where) in enumerate(places):
        align = WORD // kind.itemsize
        at = -(-end // align) * align
        first = places[out[-1][0][0]] if out else None
        if (
            first is not None and first[1:] == (kind, where) and first[0] <= RUN_TENSOR and numel <= RUN_TENSOR
            and at + numel <= run_limit(where, size)
        ):
            out[-1].append((k, at))
        else:
            out.append([(k, 0)])
            at = 0
        end = at + numel
    return out


@dataclass(frozen=True, slots=True)
class Chunk:
    """Elements compared in one step: a slice of one tensor, or a run of whole small tensors that lie one
    after another in the snapshot's memory (a :class:`~deltasync.publish.diff.snapshot.Snapshot` keeps small tensors in
    shared blocks, each 8-byte aligned), compared as one."""

    old: torch.Tensor
    """The snapshot's bit patterns of the chunk (flat; a run's padding between its tensors included)."""
    sources: tuple[torch.Tensor, ...]
    """The live weights of the chunk, flat, in order (a run's padding: the snapshot's own, never a change)."""
    members: tuple[tuple[int, int, int], ...]
    """Per tensor in the chunk: its position in ``specs``, its index at the chunk's first element of it, and
    the chunk's elements it spans (a run's padding after it included)."""
    bits: torch.dtype
    published: torch.dtype
    run: bool

    @property
    def numel(self) -> int:
        return self.old.numel()

    @property
    def key(self) -> tuple[int, int, int]:
        """Which chunk this is, from one call to the next (its history entry)."""
        tensor, start, _ = self.members[0]
        return tensor, -len(self.members) if self.run else start, self.old.numel()

    @property
    def per_word(self) -> int:
        """Elements per 8-byte word compared at once: 1 where the chunk cannot be viewed as words (a live
        tensor at an odd offset, a chunk's last few elements)."""
        per_word = WORD // self.old.element_size()
        start = self.members[0][1]
        new = self.sources[0]
        cast = self.run or new.dtype != self.published or new.device != self.old.device  # into aligned scratch
        whole = self.numel % per_word == 0 and start % per_word == 0 and self.old.data_ptr() % WORD == 0
        return per_word if whole and (cast or new.data_ptr() % WORD == 0) else 1


def chunks(published: Sequence[torch.Tensor], live: Sequence[torch.Tensor], chunk: int) -> Iterator[Chunk]:
    """Every tensor in chunks of ``chunk`` elements, small tensors that lie one after another in the
    snapshot's memory in runs of up to ``chunk``; a chunk's last few elements that do not fill an 8-byte
    word are a chunk of their own (compared element by element)."""
    for run in runs(published, live, chunk):
        first = published[run[0]]
        bits = BITS_BY_SIZE[first.element_size()]
        per_word = WORD // first.element_size()
        old = first.view(bits).view(-1)
        if len(run) == 1:
            i = run[0]
            new = live[i].detach().reshape(-1)
            for start in range(0, old.numel(), chunk):
                stop = min(start + chunk, old.numel())
                cut = stop - (stop - start) % per_word if stop - start > per_word else stop
                for a, b in ((start, cut), (cut, stop)):
                    if b > a:
                        yield Chunk(old[a:b], (new[a:b],), ((i, a, b - a),), bits, first.dtype, False)
            continue
        base = old.storage_offset()
        span = published[run[-1]].storage_offset() + published[run[-1]].numel() - base
        whole = old.as_strided((span,), (1,), base)  # the run's elements and the padding between them
        pieces: list[tuple[int, int, int, torch.Tensor]] = []  # (tensor or -1: padding, at in the run, count, live)
        for i in run:
            at = published[i].storage_offset() - base
            if pieces and pieces[-1][1] + pieces[-1][2] < at:
                gap = pieces[-1][1] + pieces[-1][2]
                pieces.append((-1, gap, at - gap, whole[gap:at].view(first.dtype)))
            pieces.append((i, at, published[i].numel(), live[i].detach().reshape(-1)))
        cut = span - span % per_word if span > per_word else span
        for a, b in ((0, cut), (cut, span)):
            if b <= a:
                continue
            sources, members = [], []
            for tensor, at, count, source in pieces:
                lo, hi = max(a, at), min(b, at + count)
                if hi <= lo:
                    continue
                sources.append(source[lo - at : hi - at])
                if tensor >= 0:
                    members.append((tensor, lo - at, hi - lo))
                else:  # padding: spanned by the tensor before it (never a change; a chunk starts on a tensor)
                    t, first_index, n = members[-1]
                    members[-1] = (t, first_index, n + hi - lo)
            yield Chunk(whole[a:b], tuple(sources), tuple(members), bits, first.dtype, True)


def runs(published: Sequence[torch.Tensor], live: Sequence[torch.Tensor], chunk: int) -> Iterator[list[int]]:
    """Positions of the tensors to compare, in order, grouped: a run of whole tensors of up to
    :data:`RUN_TENSOR` elements each and ``chunk`` in all (:func:`run_limit`), each 8-byte aligned, each
    starting where the one before ends (rounded up to 8 bytes) in one storage, of one dtype and device, live
    weights on that device too; any other tensor alone. Empty tensors have nothing to compare."""
    run: list[int] = []
    end = size = 0
    for i, (old, new) in enumerate(zip(published, live)):
        n = old.numel()
        if not n:
            continue
        limit = run_limit(old.device, chunk)
        align = WORD // old.element_size()
        offset = old.storage_offset()
        if run:
            last, last_new = published[run[-1]], live[run[-1]]
            if (
                offset == -(-end // align) * align and size + (offset - end) + n <= limit and n <= RUN_TENSOR
                and old.dtype == last.dtype and old.device == last.device
                and new.device == last_new.device == old.device and old.is_contiguous()
                and old.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
            ):
                run.append(i)
                size += offset - end + n
                end = offset + n
                continue
            yield run
            run = []
        run, end, size = [i], offset + n, n
        if n >= limit or n > RUN_TENSOR or offset % align or old.data_ptr() % WORD or not old.is_contiguous():
            yield run  # alone: too large to share a chunk, or not aligned
            run = []
    if run:
        yield run
