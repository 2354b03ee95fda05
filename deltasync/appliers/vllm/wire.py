"""Transport: what the vLLM follower and the worker extension send each other (no vllm import).

Every RPC argument and result is a string or a JSON-able dict, so the same
methods answer an in-process ``LLM.collective_rpc`` and a server's dev-mode
``POST /collective_rpc`` (which only passes strings through). Arrays travel as
one safetensors blob (never pickle): raw ``bytes`` in process, base64 text over
HTTP. Entry ``"{tensor}::{part}"`` holds part ``part`` of tensor ``tensor``
(parts: ``idx`` int64 checkpoint flat indices, ``val`` / ``bits`` bit patterns,
``pos`` int64 positions into a request's ``idx``).

Limitations:

- One blob per call: a payload is held in memory whole on both sides (the
  follower splits anchors into calls of about ``RPC_BATCH_BYTES``).
- Tensor names must not contain ``"::"`` (:class:`~deltasync.tensors.TensorSpec` refuses them).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import safetensors.numpy
import safetensors.torch

from ...errors import DeltaFormatError
from ...tensors import TensorSpec

__all__ = ["pack", "unpack", "patch_batches", "patch_parts", "specs_to_json", "specs_from_json"]


def pack(arrays: Mapping[str, Mapping[str, np.ndarray]], *, text: bool) -> bytes | str:
    """``{tensor: {part: array}}`` as one safetensors blob (base64 text when ``text``)."""
    flat = {f"{name}::{part}": np.ascontiguousarray(a) for name, parts in arrays.items() for part, a in parts.items()}
    blob = safetensors.numpy.save(flat) if flat else b""
    return base64.b64encode(blob).decode("ascii") if text else blob


def unpack(blob: bytes | str) -> dict[str, dict[str, np.ndarray]]:
    """Inverse of :func:`pack` (accepts either form)."""
    raw = base64.b64decode(blob) if isinstance(blob, str) else bytes(blob)
    if not raw:
        return {}
    try:
        # safetensors.torch copies into fresh, writable storage: the receiver wraps it without another copy.
        flat = {k: v.numpy() for k, v in safetensors.torch.load(raw).items()}
    except Exception as exc:  # safetensors raises its own error type
        raise DeltaFormatError(f"malformed RPC payload: {exc}") from None
    out: dict[str, dict[str, np.ndarray]] = {}
    for key, array in flat.items():
        name, sep, part = key.rpartition("::")
        if not sep:
            raise DeltaFormatError(f"malformed RPC payload entry {key!r}")
        out.setdefault(name, {})[part] = array
    return out


def patch_batches(decoded: Mapping[str, Any], limit: int) -> Iterator[dict[str, dict[str, np.ndarray]]]:
    """Decoded patches (``indices``, ``values``; no indices: a whole tensor) as payloads of about ``limit``
    bytes each, for :func:`pack`: one call's blob stays bounded (a tensor larger than ``limit`` goes alone)."""
    batch: dict[str, dict[str, np.ndarray]] = {}
    size = 0
    for name, patch in decoded.items():
        parts = patch_parts(patch)
        nbytes = sum(a.nbytes for a in parts.values())
        if batch and size + nbytes > limit:
            yield batch
            batch, size = {}, 0
        batch[name], size = parts, size + nbytes
    yield batch


def patch_parts(patch: Any) -> dict[str, np.ndarray]:
    """One decoded patch as payload parts: ``val`` (bits), and ``idx`` (int64) unless it is a whole tensor."""
    parts = {"val": np.ascontiguousarray(patch.values)}
    if patch.indices is not None:
        parts["idx"] = np.ascontiguousarray(patch.indices, dtype=np.int64)
    return parts


def specs_to_json(specs: Iterable[TensorSpec]) -> str:
    """Names, shapes and dtypes as compact JSON: ``[[name, shape, dtype], ...]``."""
    return json.dumps([[s.name, list(s.shape), s.dtype] for s in specs], separators=(",", ":"))


def specs_from_json(text: str) -> list[TensorSpec]:
    """Inverse of :func:`specs_to_json`."""
    return [TensorSpec(name, tuple(shape), dtype) for name, shape, dtype in json.loads(text)]
