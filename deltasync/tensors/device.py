"""Helpers of the device paths: staging host tensors, positions and sums without a host wait, waits counted.

Everything here runs on any device (CPU tensors included, which is how the tests run it); each helper
exists because the plain torch call would make the host wait for an accelerator, or run slowly there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.profiler import record_function

__all__ = [
    "Phases", "Tally", "WaitCounter", "host_ints", "positions", "scattered_positions", "segment_owners",
    "segment_sums", "settle", "stage", "to_device", "to_host",
]


def stage(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host ``tensors`` on ``device``, through one host buffer per dtype (pinned on CUDA) and one
    asynchronous copy each; returned in order, each a view of its buffer there, shaped as given.

    A copy per tensor would make a GPU's host wait each time (for everything queued before it, from
    pageable memory; for the copy itself, from pinned memory without ``non_blocking``): thousands of waits
    for a version of thousands of tensors. Read the results on the device, in stream order.
    """
    pinned = device.type == "cuda"
    totals: dict[torch.dtype, int] = {}
    places = []
    for tensor in tensors:
        places.append(totals.get(tensor.dtype, 0))
        totals[tensor.dtype] = places[-1] + tensor.numel()
    host = {dtype: torch.empty(n, dtype=dtype, pin_memory=pinned) for dtype, n in totals.items()}
    for tensor, at in zip(tensors, places):
        host[tensor.dtype][at : at + tensor.numel()] = tensor.reshape(-1)
    moved = {dtype: buffer.to(device, non_blocking=pinned) for dtype, buffer in host.items()}
    return [moved[t.dtype][at : at + t.numel()].view(t.shape) for t, at in zip(tensors, places)]


_NO_STATIC_KERNEL: set[str] = set()
"""Device types whose torch build has no ``nonzero_static`` kernel (CUDA before torch 2.6, some others)."""


def positions(mask: torch.Tensor, count: int, fill: int = 0) -> torch.Tensor:
    """The flat positions of the first ``count`` true elements of a 1-D ``mask``, without a host wait.

    ``nonzero`` must wait for the device to learn its output's size; with ``count`` known
    (the device paths count first, or read it from a header) ``nonzero_static`` need not.
    Where a device type has no such kernel, the same positions come from a prefix sum and a
    scatter (a few more passes over the mask, still no wait). Positions past the true
    elements are ``fill``: with the default 0 the callers' counts must be exact (they check
    them where a hostile input could lie); with -1, ``count`` may be a guess, and the
    positions found are those not -1 (all ``count`` of them set: perhaps more were cut).
    """
    kind = mask.device.type
    if kind not in _NO_STATIC_KERNEL:
        try:
            return torch.nonzero_static(mask, size=count, fill_value=fill).view(-1)
        except NotImplementedError:  # no kernel for this backend: remembered, the fallback below from now on
            _NO_STATIC_KERNEL.add(kind)
    return scattered_positions(mask, count, fill)


def scattered_positions(mask: torch.Tensor, count: int, fill: int = 0) -> torch.Tensor:
    """:func:`positions` by a prefix sum and a scatter: each true element's rank is its slot.

    False elements (and true ones past ``count``) all go to one spare slot at the end, which is dropped.
    """
    rank = mask.cumsum(0, dtype=torch.int64).sub_(1)
    slot = torch.where(mask, rank, count).clamp_(max=count)
    out = torch.full((count + 1,), fill, dtype=torch.int64, device=mask.device)
    return out.scatter_(0, slot, torch.arange(mask.numel(), device=mask.device))[:count]


def segment_owners(counts: torch.Tensor, total: int) -> torch.Tensor:
    """For each of ``total`` slots, which of the consecutive segments of ``counts`` slots it is in (int64).

    ``repeat_interleave(arange(len(counts)), counts)`` gives the same, but its CUDA kernel spends one
    thread per segment, which crawls for a few dozen segments of millions of slots each. A mark at each
    segment's start and a prefix sum are two passes at memory speed.
    """
    starts = counts.cumsum(0).sub_(counts)
    marks = torch.zeros(total + 1, dtype=torch.int64, device=counts.device)
    marks.index_add_(0, starts, torch.ones_like(starts))  # an empty segment shares its start with the next
    return marks[:total].cumsum_(0).sub_(1)


def segment_sums(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Sums of 1-D ``values`` over its consecutive segments of ``counts`` elements, by a prefix sum
    (bool values count: their prefix sum is int64).

    ``index_add_`` into one slot per segment gives the same, but its atomic adds all land on a few
    dozen slots and wait on each other. A prefix sum of a 1-D tensor is one device-wide scan; 1-D only,
    since torch scans an ``(n, 2)`` tensor along its first dimension with one thread per column, far
    slower still.
    Integer sums are exact; floating ones are prefix-sum differences, rounded accordingly.
    """
    if values.dim() != 1:
        raise ValueError(f"segment_sums: 1-D values only, got shape {tuple(values.shape)}")
    summed = values.cumsum(0)
    summed = torch.cat([torch.zeros(1, dtype=summed.dtype, device=values.device), summed])
    end = counts.cumsum(0)
    return summed[end] - summed[end - counts]


def settle(devices: Iterable[torch.device]) -> None:
    """Wait until the work this thread queued on ``devices`` has run, before another thread reads its results.

    The snapshot is written on one thread (captured on the training thread, advanced on the publisher's)
    and read on the other, and a replica's weights are written on its update thread and read by
    inference, each on its own current stream. Streams of different threads are not ordered
    with each other unless both are a device's default stream; a trainer that steps on a stream of its own
    would otherwise let an anchor be read from a snapshot still being filled, or a diff compare against one
    not yet advanced. One wait per call, for each accelerator among ``devices``; none on the CPU.
    """
    for device in set(devices):
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        elif device.type != "cpu":
            backend = getattr(torch, device.type, None)  # torch.mps, torch.xpu...: a device-wide wait
            if backend is not None and hasattr(backend, "synchronize"):
                backend.synchronize()


def host_ints(values: Sequence[torch.Tensor | int], lists: Sequence[torch.Tensor] = ()) -> list[int]:
    """``values`` as Python ints, then every element of each integer tensor of ``lists`` in turn: counts left
    on a device (one-element tensors among ``values``, any number in each of ``lists``) copied back together,
    one copy per device instead of a wait each; ints pass through."""
    out = [v if isinstance(v, int) else 0 for v in values]
    tail: list[list[int]] = [[] for _ in lists]
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for k, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append((k, value.reshape(1)))
    for j, tensor in enumerate(lists):
        by_device.setdefault(tensor.device, []).append((~j, tensor.reshape(-1)))
    for items in by_device.values():
        got = torch.cat([v for _, v in items]).tolist()
        at = 0
        for k, v in items:
            if k >= 0:
                out[k] = int(got[at])
            else:
                tail[~k] = got[at : at + v.numel()]
            at += v.numel()
    return out + [n for part in tail for n in part]


class Tally:
    """A count the device paths keep for tests and benchmarks to read (callable: the count)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count


class Phases:
    """Host seconds spent so far in each named phase of a device path (``take()``: them, and start again), each
    phase also a named range in a torch profiler's trace (``{prefix}.{phase}``): where a version's time goes
    on an accelerator, for a benchmark to show without a profiler. A phase run on another thread (a decode's
    inflating, beside the queueing) adds its own time."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            with record_function(f"{self.prefix}.{phase}"):
                yield
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._seconds[phase] = self._seconds.get(phase, 0.0) + elapsed

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last ``take()``."""
        with self._lock:
            seconds, self._seconds = self._seconds, {}
        return seconds


class WaitCounter(Tally):
    """How many times this process waited for a device's results in one device path (callable: the count)."""

    def wait(self, *devices: torch.device) -> None:
        """Wait for everything queued on ``devices`` (their copies to the host included), and count it once."""
        self.count += 1
        settle(devices)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy of ``tensor`` into host memory (pinned, on CUDA): read it after a wait."""
    pinned = tensor.device.type == "cuda"
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned).copy_(tensor, non_blocking=pinned)


def to_device(values: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """A small int64 table from the host, copied to ``device`` without a wait (:func:`~deltasync.tensors.stage`:
    through pinned memory on CUDA, where a copy from pageable memory would wait for everything queued before it)."""
    return stage([torch.tensor(values, dtype=torch.int64)], device)[0]
