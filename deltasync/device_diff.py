"""Change detection for weights on an accelerator: two host waits per version, whatever the tensor count.

The CPU diff (:mod:`deltasync.diff`) expands each chunk's changes as soon as it
finds them. On an accelerator every such expansion (``nonzero``, a copy to the
host) makes the host wait for the device, hundreds of times per version. This
path queues everything and waits twice:

1. For every chunk of every tensor: cast to the published dtype, compare with
   the snapshot, count the differing elements. Queued, no wait.
2. **Wait 1**: all counts reach the host in one copy. The host lays out one
   output per bit width and decides which tensors changed densely.
3. For every chunk with changes: cast and compare again, and write its
   indices (:func:`~deltasync.tensors.positions` with the count now known: no wait), new and old
   bit patterns at their offsets in the output. A densely changed tensor is
   cast whole into the output instead.
4. **Wait 2**: the outputs reach the host in one asynchronous copy each, into
   pinned memory on CUDA, and the host waits once for all of them.

The second pass repeats the cast and compare instead of keeping a mask (one
byte per element, half the bf16 weights again), so the device reads the
weights twice: two memory-bound passes against the CPU path's one pass plus
hundreds of waits. The code is device-agnostic: CPU tensors run it too (tests
prove it bit-exact against the CPU diff on CPU tensors; ``diff(...,
on_device=True)``), and :data:`host_waits` counts its waits so a CPU run
shows the structure.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .tensors import BITS_BY_SIZE, TensorSpec, positions, settle

__all__ = ["DeviceChange", "WaitCounter", "changes_on_device", "host_waits", "to_host"]


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

    def wait(self, device: torch.device) -> None:
        """Wait for everything queued on ``device`` (its copies to the host included), and count it."""
        self.count += 1
        settle((device,))


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy of ``tensor`` into host memory (pinned, on CUDA): read it after a wait."""
    pinned = tensor.device.type == "cuda"
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned).copy_(tensor, non_blocking=pinned)


host_waits = WaitCounter()
"""``host_waits()``: the waits so far (two per call of :func:`changes_on_device` that found changes)."""


def changes_on_device(
    specs: Sequence[TensorSpec],
    published: Sequence[torch.Tensor],
    live: Sequence[torch.Tensor],
    *,
    chunk: int,
    dense_fraction: float,
) -> list[DeviceChange]:
    """The changed elements of every tensor, computed where the snapshot lives, with two host waits in all.

    Args:
        specs: the tensors' specs, in publishing order.
        published: per tensor, the snapshot's copy (published dtype, contiguous, on its device).
        live: per tensor, the live weights (same shape; any floating dtype and device).
        chunk: elements cast and compared per step (bounds the scratch memory).
        dense_fraction: changed fraction above which a tensor is carried whole.

    Returns:
        `list[DeviceChange]`: the tensors that changed, in order; indices and values on the host.
    """
    jobs = list(_chunks(specs, published, live, chunk))
    if not jobs:
        return []
    scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
    counts_on_device = [torch.ne(_new_bits(job, scratch), job.old).sum() for job in jobs]  # pass 1: queued
    host_waits.count += 1
    counts = torch.stack([c.to(counts_on_device[0].device) for c in counts_on_device]).tolist()  # wait 1
    per_tensor = [0] * len(specs)
    for job, count in zip(jobs, counts):
        per_tensor[job.tensor] += count
    dense = {i for i, n in enumerate(per_tensor) if n and n > dense_fraction * specs[i].numel}
    out = _Outputs(specs, published, per_tensor, dense)
    for job, count in zip(jobs, counts):  # pass 2: queued
        if job.tensor in dense:
            if job.start == 0:
                out.whole(job.tensor, live[job.tensor])
        elif count:
            new = _new_bits(job, scratch)
            hit = positions(torch.ne(new, job.old), count)
            out.changes(job.tensor, hit + job.start, new[hit], job.old[hit])
    return out.to_host()  # wait 2


@dataclass(frozen=True, slots=True)
class _Chunk:
    tensor: int
    start: int
    new: torch.Tensor
    old: torch.Tensor
    bits: torch.dtype
    published: torch.dtype


def _chunks(
    specs: Sequence[TensorSpec], published: Sequence[torch.Tensor], live: Sequence[torch.Tensor], chunk: int
) -> Iterator[_Chunk]:
    for i, (spec, snap, weights) in enumerate(zip(specs, published, live)):
        bits = BITS_BY_SIZE[snap.element_size()]
        old, new = snap.view(bits).view(-1), weights.detach().reshape(-1)
        for start in range(0, spec.numel, chunk):
            yield _Chunk(i, start, new[start : start + chunk], old[start : start + chunk], bits, snap.dtype)


def _new_bits(job: _Chunk, scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """The chunk's live weights as published bit patterns, on the snapshot's device (cast into a reused buffer)."""
    if job.new.dtype == job.published and job.new.device == job.old.device:
        return job.new.view(job.bits)
    key = (job.old.device, job.published)
    if key not in scratch or scratch[key].numel() < job.new.numel():
        scratch[key] = torch.empty(max(job.new.numel(), job.old.numel()), dtype=job.published, device=job.old.device)
    # In stream order, the next chunk's cast waits for this chunk's reads of the buffer: no host wait.
    return scratch[key][: job.new.numel()].copy_(job.new).view(job.bits)


class _Outputs:
    """One device buffer per kind of result, filled at offsets the counts give, copied to the host once.

    ``idx`` holds the indices of every sparsely changed tensor; per bit width, ``new`` holds the new bit
    patterns (whole, for a dense tensor) and ``old`` the old ones at the indices.
    """

    def __init__(
        self, specs: Sequence[TensorSpec], published: Sequence[torch.Tensor], nnz: list[int], dense: set[int]
    ) -> None:
        self.specs, self.nnz, self.dense = specs, nnz, dense
        self.device = published[0].device
        self.dtypes = [t.dtype for t in published]
        self.width = [t.element_size() for t in published]
        size = {"idx": 0, ("new", 2): 0, ("new", 4): 0, ("old", 2): 0, ("old", 4): 0}
        # Per tensor: where its results start in each of its buffers (indices, new and old bits of its width).
        self.start: list[dict[Any, int]] = []
        for i, n in enumerate(nnz):
            w = self.width[i]
            self.start.append({key: size[key] for key in ("idx", ("new", w), ("old", w))})
            if i in dense:
                size["new", w] += specs[i].numel
            elif n:
                size["idx"] += n
                size["new", w] += n
                size["old", w] += n
        self.filled = [0] * len(specs)  # per sparse tensor: results written so far, chunk by chunk
        self.buffers = {
            key: torch.empty(n, dtype=torch.int64 if key == "idx" else BITS_BY_SIZE[key[1]], device=self.device)
            for key, n in size.items()
        }

    def whole(self, i: int, live: torch.Tensor) -> None:
        key = ("new", self.width[i])
        at = self.start[i][key]
        target = self.buffers[key][at : at + self.specs[i].numel]
        target.view(self.dtypes[i]).copy_(live.detach().reshape(-1))  # cast in the copy

    def changes(self, i: int, hit: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> None:
        done, n = self.filled[i], hit.numel()
        for (key, start), part in zip(self.start[i].items(), (hit, new, old)):
            self.buffers[key][start + done : start + done + n] = part
        self.filled[i] += n

    def to_host(self) -> list[DeviceChange]:
        host = {key: to_host(t) for key, t in self.buffers.items()}
        host_waits.wait(self.device)  # wait 2: every copy above has landed
        out = []
        for i, n in enumerate(self.nnz):
            if i in self.dense:
                key = ("new", self.width[i])
                at = self.start[i][key]
                out.append(DeviceChange(i, n, None, host[key][at : at + self.specs[i].numel], None))
            elif n:
                idx, new, old = (host[key][start : start + n] for key, start in self.start[i].items())
                out.append(DeviceChange(i, n, idx, new, old))
        return out
