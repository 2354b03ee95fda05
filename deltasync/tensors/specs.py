"""What gets published: tensor specs, dtype names, what may be published, and the model fingerprint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, DeltaFormatError
from .bits import bits_view
from .saved_layout import checkpoint_views

__all__ = [
    "TensorSpec",
    "DTYPE_BY_NAME",
    "dtype_name",
    "dtype_from_name",
    "check_cast_dtype",
    "CAST_DTYPES",
    "published_dtype",
    "check_publishable",
    "describe_differences",
    "fingerprint",
    "published_tensors",
    "weights_digest",
]

# Safetensors' dtype names for the element types deltasync publishes. F8_E4M3 only ever holds a block-fp8 view
# (deltasync.tensors.fp8), never a plain cast: the others are the dtypes a run may cast its weights to.
DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
}
CAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


_NAME_BY_DTYPE = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Safetensors name of a publishable dtype (``torch.bfloat16 -> "BF16"``).

    Raises:
        `ConfigError`: not one of bf16, fp16, fp32, e4m3.
    """
    try:
        return _NAME_BY_DTYPE[dtype]
    except KeyError:
        raise ConfigError(
            f"cannot publish dtype {dtype}; supported: {sorted(DTYPE_BY_NAME)} "
            "(pass dtype=torch.bfloat16 to publish the bf16 cast of other floating dtypes)",
            argument="dtype",
        ) from None


def check_cast_dtype(dtype: torch.dtype) -> None:
    """Refuse a published cast other than bf16, fp16 or fp32: an fp8 view needs scales, not a cast.

    Raises:
        `ConfigError`: naming the argument ``dtype`` and what to use instead.
    """
    if dtype not in CAST_DTYPES:
        hint = (" (an fp8 run publishes a block-fp8 view: Publisher(BlockFp8View(model), ...))"
                if dtype.is_floating_point and dtype.itemsize == 1 else "")
        raise ConfigError(f"dtype={dtype}: weights are published cast to bf16, fp16 or fp32{hint}", argument="dtype")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises :class:`DeltaFormatError` on unknown names."""
    try:
        return DTYPE_BY_NAME[name]
    except KeyError:
        raise DeltaFormatError(
            f"unsupported dtype {name!r}; expected one of {sorted(DTYPE_BY_NAME)}", dtype=name
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
    whose exact fp32 bits are what a replica loads: :mod:`deltasync.publish.lora`).
    """
    if dtype is None or name in getattr(source, "own_dtype", ()):
        return tensor.dtype
    return dtype


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
    (:mod:`deltasync.tensors.saved_layout`). A
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
