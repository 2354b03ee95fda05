"""What gets published: tensor specs, dtype names, bit views and the model fingerprint.

Change detection and patching work on the *bit patterns* of floating-point
elements (``int16`` views of bf16/fp16, ``int32`` views of fp32), never on
float values: float ``!=`` misses ``-0.0 -> +0.0`` and calls every NaN changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoint_names import checkpoint_views
from .errors import ConfigError, DeltaFormatError

__all__ = [
    "TensorSpec",
    "DTYPE_BY_NAME",
    "BITS_BY_SIZE",
    "dtype_name",
    "published_dtype",
    "bits_dtype",
    "bits_view",
    "write_at",
    "stage",
    "positions",
    "segment_owners",
    "segment_sums",
    "settle",
    "host_ints",
    "check_publishable",
    "describe_differences",
    "fingerprint",
    "published_tensors",
    "weights_digest",
]

# Safetensors' dtype names for the element types deltasync publishes.
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
}
_NAME_BY_DTYPE = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}
BITS_BY_SIZE = {2: torch.int16, 4: torch.int32}
"""The signed integer dtype holding the bit patterns of a float of this many bytes."""


def dtype_name(dtype: torch.dtype) -> str:
    """Safetensors name of a publishable dtype (``torch.bfloat16 -> "BF16"``).

    Raises:
        `ConfigError`: not one of bf16, fp16, fp32.
    """
    try:
        return _NAME_BY_DTYPE[dtype]
    except KeyError:
        raise ConfigError(
            f"cannot publish dtype {dtype}; supported: {sorted(DTYPE_BY_NAME)} "
            "(pass dtype=torch.bfloat16 to publish the bf16 cast of other floating dtypes)",
            argument="dtype",
        ) from None


def check_publishable(name: str, tensor: torch.Tensor) -> None:
    """Refuse a tensor whose elements deltasync cannot carry exactly.

    The contract: floating-point tensors (bf16, fp16, fp32, and others cast to
    the published dtype) on any device, any strides. Integer, bool, complex,
    quantized and sparse tensors are refused rather than cast through a float,
    which would change them (an int64 ``123457`` is ``123392`` in bf16).

    Raises:
        `ConfigError`: naming the tensor and what to do.
    """
    if tensor.layout != torch.strided:
        raise ConfigError(
            f"{name!r} is a {tensor.layout} tensor; deltasync publishes dense tensors: pass tensor.to_dense()",
            argument=name,
        )
    if not tensor.is_floating_point():
        raise ConfigError(
            f"{name!r} is {tensor.dtype}: deltasync publishes floating-point weights only (integer, bool and "
            "complex tensors would change through a bf16 cast). Leave it out of what you publish, e.g. "
            "{k: v for k, v in state_dict.items() if v.is_floating_point()}",
            argument=name,
        )
    if any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape)):
        raise ConfigError(
            f"{name!r} is an expanded view (stride 0): its elements share memory, so they cannot be "
            "written one by one; pass a tensor with its own storage (tensor.contiguous())",
            argument=name,
        )


def published_dtype(
    source: object, name: str, tensor: torch.Tensor, dtype: torch.dtype | None
) -> torch.dtype:
    """The dtype ``name`` is published in: ``dtype`` (``None``: the tensor's own).

    A source may keep some tensors in their own dtype whatever ``dtype`` says, by
    naming them in an ``own_dtype`` attribute (a LoRA run's adapter factors,
    whose exact fp32 bits are what a replica loads: :mod:`deltasync.lora`).
    """
    if dtype is None or name in getattr(source, "own_dtype", ()):
        return tensor.dtype
    return dtype


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises :class:`DeltaFormatError` on unknown names."""
    try:
        return DTYPE_BY_NAME[name]
    except KeyError:
        raise DeltaFormatError(
            f"unsupported dtype {name!r}; expected one of {sorted(DTYPE_BY_NAME)}", dtype=name
        ) from None


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype with the same width as ``dtype``."""
    return BITS_BY_SIZE[dtype.itemsize]


def bits_view(tensor: torch.Tensor) -> torch.Tensor:
    """Reinterpret a floating tensor's storage as integers of the same width (no copy)."""
    return tensor.view(bits_dtype(tensor.dtype))


SCATTERED = 20
"""On the CPU, writes of fewer than one element in this many go through ``index_put_``."""


def write_at(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[index] = values`` in place, for a 1-D ``flat`` and unique ``index`` on its device.

    Both of torch's kernels are exact here (indices are unique, so ``index_put_``'s unspecified
    order among duplicates never arises); they differ in speed on the CPU. For scattered writes
    (0.1-3 % of a tensor's elements, the density of RL steps) ``index_put_`` spreads over torch's
    threads and ran 1.6-3x faster than ``index_copy_`` into weights not in cache on 2 cores, while
    ``index_copy_`` stays ahead for denser writes (1.4x at 10 %; ``benchmarks/throughput.py`` and
    ``benchmarks/device_sync.py`` time both). Other devices keep ``index_copy_``.
    """
    if flat.device.type == "cpu" and index.numel() * SCATTERED < flat.numel():
        flat.index_put_((index,), values)
    else:
        flat.index_copy_(0, index, values)


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
    thread per segment: for a few dozen segments of millions of slots each, 0.25 ms per call on an
    H200. A mark at each segment's start and a prefix sum are two passes at memory speed.
    """
    starts = counts.cumsum(0).sub_(counts)
    marks = torch.zeros(total + 1, dtype=torch.int64, device=counts.device)
    marks.index_add_(0, starts, torch.ones_like(starts))  # an empty segment shares its start with the next
    return marks[:total].cumsum_(0).sub_(1)


def segment_sums(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Sums of 1-D ``values`` over its consecutive segments of ``counts`` elements, by a prefix sum
    (bool values count: their prefix sum is int64).

    ``index_add_`` into one slot per segment gives the same, but its atomic adds all land on a few
    dozen slots: 3 ms per call over millions of elements on an H200. A prefix sum of a 1-D tensor is
    one device-wide scan; 1-D only, since torch scans an ``(n, 2)`` tensor along its first dimension
    with one thread per column (2.6 s for a few million rows on the same GPU).
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


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, shape and dtype of one published tensor: what the fingerprint covers."""

    name: str
    """Parameter name as the trainer's module reports it (the checkpoint name)."""
    shape: tuple[int, ...]
    """Logical shape of the full (unsharded) tensor."""
    dtype: str
    """Safetensors dtype name of the published elements, e.g. ``"BF16"``."""

    def __post_init__(self) -> None:
        if not self.name or "::" in self.name:
            raise ValueError(f"invalid tensor name {self.name!r}: must be non-empty without '::'")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"invalid shape {self.shape} for {self.name!r}")
        dtype_from_name(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorSpec:
        """The spec of ``tensor`` published as ``dtype`` (``None``: its own dtype).

        Raises:
            `ConfigError`: the tensor cannot be published exactly (see :func:`check_publishable`).
        """
        check_publishable(name, tensor)
        try:
            return cls(name, tuple(tensor.shape), dtype_name(dtype or tensor.dtype))
        except ConfigError as exc:
            raise ConfigError(f"{name!r}: {exc}", argument=name) from None

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return DTYPE_BY_NAME[self.dtype]


def fingerprint(specs: Iterable[TensorSpec]) -> str:
    """A stable hash of a model's published names, shapes and dtypes.

    Two processes agree on the fingerprint exactly when they agree on what every
    tensor is called and how it is laid out, so a delta made for another model
    (or another published dtype) is refused before it touches anything.
    """
    rows = sorted((s.name, list(s.shape), s.dtype) for s in specs)
    digest = hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode())
    return digest.hexdigest()[:32]


def describe_differences(theirs: Iterable[TensorSpec], ours: Iterable[TensorSpec], *, limit: int = 5) -> str:
    """What differs between two models' published tensors, in one line for an error message.

    Example: ``"missing here: ['lm_head.weight']; layout: 'w' BF16[32, 24] there, BF16[24, 32] here"``.
    """
    there, here = {s.name: s for s in theirs}, {s.name: s for s in ours}
    parts = []
    missing = sorted(there.keys() - here.keys())
    extra = sorted(here.keys() - there.keys())
    if missing:
        parts.append(f"missing here: {missing[:limit]}" + (f" and {len(missing) - limit} more" if len(missing) > limit else ""))
    if extra:
        parts.append(f"not in the run: {extra[:limit]}" + (f" and {len(extra) - limit} more" if len(extra) > limit else ""))
    changed = [n for n in sorted(there.keys() & here.keys()) if there[n] != here[n]]
    for name in changed[:limit]:
        a, b = there[name], here[name]
        parts.append(f"layout: {name!r} {a.dtype}{list(a.shape)} there, {b.dtype}{list(b.shape)} here")
    return "; ".join(parts) or "same names, shapes and dtypes"


def published_tensors(
    source: torch.nn.Module | Mapping[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor to publish, each tied tensor once.

    A module yields its parameters; tied parameters (one ``Parameter`` under two
    names, such as tied embeddings) appear once, under their first name; a
    transformers model whose checkpoints lay weights out otherwise (fused MoE
    experts) yields zero-copy views in its checkpoint's names
    (:mod:`deltasync.checkpoint_names`). A
    mapping yields its items, skipping later names that alias an earlier
    tensor: the same storage, offset, shape, strides and dtype (a tied weight).
    Zero-element tensors alias nothing: they may share any address.
    """
    if isinstance(source, torch.nn.Module):
        views = checkpoint_views(source)  # transformers' fused layouts, in their checkpoint names
        # named_parameters() already removes duplicates of the same Parameter.
        yield from views if views is not None else source.named_parameters()
        return
    seen: set[tuple[Any, ...]] = set()
    for name, tensor in source.items():
        if tensor.numel():
            key = (
                tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                tensor.stride(), tensor.dtype, tensor.device,
            )
            if key in seen:
                continue
            seen.add(key)
        yield name, tensor


def weights_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over every tensor's name and bf16 bit patterns, in name order.

    Tensors in another float dtype are cast to bf16 first (the published cast),
    so a trainer's fp32 masters and a replica's bf16 weights hash alike exactly
    when every published element is bit-identical. For checks, demos and soak runs.
    """
    h = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        t = tensor.detach()
        if t.dtype != torch.bfloat16:
            t = t.to(torch.bfloat16)
        h.update(name.encode() + b"\0")
        h.update(memoryview(bits_view(t.contiguous()).cpu().numpy()).cast("B"))
    return h.hexdigest()
