"""What gets published: tensor specs, dtype names, bit views and the model fingerprint.

Change detection and patching work on the *bit patterns* of floating-point
elements (``int16`` views of bf16/fp16, ``int32`` views of fp32), never on
float values: float ``!=`` misses ``-0.0 -> +0.0`` and calls every NaN changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from .errors import DeltaFormatError

__all__ = [
    "TensorSpec",
    "DTYPE_BY_NAME",
    "dtype_name",
    "bits_dtype",
    "bits_view",
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
_BITS_BY_SIZE = {2: torch.int16, 4: torch.int32}


def dtype_name(dtype: torch.dtype) -> str:
    """Safetensors name of a publishable dtype (``torch.bfloat16 -> "BF16"``)."""
    try:
        return _NAME_BY_DTYPE[dtype]
    except KeyError:
        raise ValueError(
            f"cannot publish dtype {dtype}; supported: {sorted(DTYPE_BY_NAME)}"
        ) from None


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
    return _BITS_BY_SIZE[torch.empty((), dtype=dtype).element_size()]


def bits_view(tensor: torch.Tensor) -> torch.Tensor:
    """Reinterpret a floating tensor's storage as integers of the same width (no copy)."""
    return tensor.view(bits_dtype(tensor.dtype))


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
        """The spec of ``tensor`` published as ``dtype`` (``None``: its own dtype)."""
        return cls(name, tuple(tensor.shape), dtype_name(dtype or tensor.dtype))

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


def published_tensors(
    source: torch.nn.Module | Mapping[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor to publish, each storage once.

    A module yields its parameters; tied parameters (one ``Parameter`` under two
    names, such as tied embeddings) appear once, under their first name. A
    mapping yields its items, skipping later names that alias an earlier
    tensor's storage.
    """
    if isinstance(source, torch.nn.Module):
        # named_parameters() already removes duplicates of the same Parameter.
        yield from source.named_parameters()
        return
    seen: set[tuple[int, int]] = set()
    for name, tensor in source.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if tensor.numel() and key in seen:
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
