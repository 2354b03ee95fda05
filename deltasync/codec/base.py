"""The codec protocol: how one tensor's changes become named safetensors entries.

A codec turns a :class:`~deltasync.publish.diff.snapshot.TensorChange` into a few named arrays
(``parts``) plus a small JSON-able ``params`` dict, and back. The container
(:mod:`deltasync.format`) stores each part as the safetensors entry
``"{tensor}::{part}"`` and the params in the file's metadata.

Decoders treat every input as hostile: each check that a malformed or
malicious file could fail raises :class:`~deltasync.errors.CodecError`, and no
decoder allocates more than the sizes the header declares allow.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from ..errors import CodecError
from ..tensors import TensorChange, TensorSpec, bits_dtype

__all__ = [
    "Codec", "Encoded", "Decoded", "BaseLookup", "FlatLookup", "Parts", "Params", "check_part", "check_indices",
    "value_bits",
]

BaseLookup = Callable[[str, np.ndarray], np.ndarray]
"""``(tensor name, sorted flat indices) -> current bit patterns there`` on the receiver."""


@dataclass(frozen=True, slots=True)
class FlatLookup:
    """A :data:`BaseLookup` that can also hand over a tensor's current bit patterns whole.

    Called as any lookup (``read``). ``flat(name)`` is all of tensor ``name``'s bit patterns as one flat host
    array in its published width, read only, or ``None`` where the receiver does not hold them that way (on an
    accelerator, strided, held in a wider dtype). The host decoder then reads the base itself, inside the one
    compiled call that rebuilds a ``compact`` tensor (:func:`~deltasync.codec.kernels.rebuild`), instead of
    calling ``read`` per tensor between its kernels.
    """

    read: BaseLookup
    flat: Callable[[str], np.ndarray | None]

    def __call__(self, name: str, indices: np.ndarray) -> np.ndarray:
        return self.read(name, indices)


Parts = Mapping[str, torch.Tensor | np.ndarray]
"""One tensor's arrays in a file, by part name (the entries ``"{tensor}::{part}"``); a decoded file's byte
streams come as numpy views of it (:func:`check_part` hands out tensors)."""
Params = Mapping[str, Any]
"""One tensor's codec parameters, from the file's metadata (JSON-able scalars)."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """One tensor's changes, encoded."""

    parts: dict[str, torch.Tensor]
    """Part name -> array stored as safetensors entry ``"{tensor}::{part}"``."""
    params: dict[str, Any] = field(default_factory=dict)
    """Codec parameters needed to decode (JSON-able scalars)."""


@dataclass(frozen=True, slots=True)
class Decoded:
    """One tensor's changes, decoded and validated, ready to apply."""

    indices: np.ndarray | torch.Tensor | None
    """Strictly increasing flat int64 indices, all in bounds; ``None`` for a whole tensor. A tensor
    rebuilt on the receiver's device (:mod:`deltasync.codec.device`) keeps them there, as a tensor."""
    values: np.ndarray | torch.Tensor
    """New bit patterns (int16/int32): one per index, or every element in order (a tensor on the
    receiver's device where the indices are)."""
    start: int = 0
    """With ``indices is None``: the flat index ``values`` start at (non-zero only for a
    trainer rank's shard before :func:`deltasync.format.combine` joins the shards)."""


class Codec(ABC):
    """Encodes and decodes the changed elements of one tensor."""

    name: ClassVar[str]
    """Registry name, written into every file that uses the codec."""
    needs_base: ClassVar[bool] = False
    """True when decoding reads the receiver's current values at the changed indices."""
    streams: ClassVar[frozenset[str] | None] = frozenset({"idx", "val"})
    """The part names a file may carry for a tensor of this codec (``T::idx``...); a reader refuses others.
    ``None``: not declared, nothing is refused."""

    @abstractmethod
    def encode(self, change: TensorChange, *, level: int) -> Encoded:
        """Encode ``change``; ``level`` is the compression level where one applies."""

    @abstractmethod
    def decode(self, parts: Parts, params: Params, spec: TensorSpec, nnz: int, base: BaseLookup | None) -> Decoded:
        """Decode and validate; raise :class:`CodecError` on anything malformed.

        Args:
            parts (`Parts`): the tensor's arrays, by part name.
            params (`Params`): the codec parameters :meth:`encode` returned.
            spec (`TensorSpec`): the tensor's name, dtype and shape.
            nnz (`int`): how many elements the file says changed.
            base (`BaseLookup`, *optional*): the receiver's current values, for codecs that need them.
        """

    def supports(self, change: TensorChange) -> bool:
        """Whether this codec can carry ``change`` (sparse codecs refuse dense changes)."""
        return not change.dense


def check_part(
    parts: Parts, key: str, dtype: torch.dtype, shape: tuple[int, ...] | None, spec: TensorSpec
) -> torch.Tensor:
    """Fetch part ``key`` and check its dtype and (when given) shape."""
    if key not in parts:
        raise CodecError(f"{spec.name}: missing part {key!r}", name=spec.name, part=key)
    part = parts[key]
    if isinstance(part, np.ndarray):  # a file's byte stream, viewed as numpy by the decoder
        part = torch.from_numpy(part)
    if part.dtype != dtype or (shape is not None and tuple(part.shape) != shape):
        raise CodecError(
            f"{spec.name}: part {key!r} is {part.dtype}{list(part.shape)}, "
            f"expected {dtype}{list(shape) if shape is not None else ''}",
            name=spec.name,
            part=key,
        )
    if shape is None and part.dim() != 1:
        raise CodecError(f"{spec.name}: part {key!r} must be 1-D", name=spec.name, part=key)
    return part


def check_indices(indices: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """Require strictly increasing indices within ``[0, numel)``; return them as int64."""
    indices = indices.astype(np.int64, copy=False)
    if indices.size:
        if indices[0] < 0 or indices[-1] >= spec.numel:
            raise CodecError(
                f"{spec.name}: index out of range [0, {spec.numel})", name=spec.name
            )
        if indices.size > 1 and not bool(np.all(indices[1:] > indices[:-1])):
            raise CodecError(
                f"{spec.name}: indices must be strictly increasing (sorted, no duplicates)",
                name=spec.name,
            )
    return indices


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array (no copy)."""
    if tensor.is_cpu and not tensor.requires_grad:  # a file's entry: cheaper than the general path
        return tensor.numpy()
    return tensor.detach().cpu().numpy()


def value_bits(part: torch.Tensor, spec: TensorSpec) -> np.ndarray:
    """A checked part of values in the published dtype as flat bit patterns (int16/int32; no copy)."""
    return to_numpy(part.reshape(-1).view(bits_dtype(spec.torch_dtype)))
