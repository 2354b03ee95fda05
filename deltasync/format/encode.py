"""Writing delta and anchor files: change sets and full tensors to safetensors bytes.

Encoding runs each changed tensor through its codec on a few threads (codecs
release the GIL in zstd and numpy), then lays the entries out exactly as
``safetensors.torch.save`` would, without its per-entry overhead.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import safetensors.torch
import torch

from ..codec import DEFAULT_CODEC, get_codec
from ..tensors import ChangeSet, TensorChange, TensorSpec, settle
from ..util.collector import collector_paused
from ..util.threads import map_shared, mostly_python
from .header import (
    SAFETENSORS_DTYPES,
    Window,
    entry_digest,
    entry_json,
    host_bytes,
    metadata_strings,
    slice_spec,
    window_fits,
)
from .layout import PACKED_VERSION, pack

__all__ = [
    "DEFAULT_LEVEL", "encode_delta", "encode_anchor", "encode_anchor_parts", "serialize", "serialize_parts",
    "as_numpy_bits", "on_host",
]

_ALIGN = 64  # bytes between tensors staged in one host buffer (:func:`on_host`)
DEFAULT_LEVEL = 1  # zstd level: higher levels barely shrink real deltas and cost more time
# safetensors' dtype names, with the rank of its writer's layout order (entries
# of a higher rank come first); see serialize.
_SAFETENSORS_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    dtype: (name, rank) for rank, (name, dtype) in enumerate(SAFETENSORS_DTYPES.items())
}


@collector_paused()  # see there: no collections of a big process's objects amid an encode
def encode_delta(
    changes: ChangeSet,
    *,
    version: int,
    base_version: int,
    codec: str = DEFAULT_CODEC,
    level: int = DEFAULT_LEVEL,
    workers: int | None = None,
    model: Sequence[TensorSpec] | None = None,
    rows: Mapping[str, Window] | None = None,
    packed: bool = True,
) -> bytes:
    """Serialize a change set as a delta file.

    Args:
        changes (`ChangeSet`): what changed since ``base_version``.
        version (`int`): the version this delta produces; must exceed ``base_version``.
        base_version (`int`): the version the changes were computed against.
        codec (`str`, *optional*, defaults to ``"compact"``): codec for sparse tensors;
            densely changed tensors always use ``"dense"``.
        level (`int`, *optional*, defaults to 1): zstd level for compressing codecs.
        workers (`int`, *optional*): encoding threads; defaults to `deltasync.util.threads.WORKERS` (the CPU
            count, at most 8, or `DELTASYNC_THREADS`).
        model (`Sequence[TensorSpec]`, *optional*): every tensor of the full model, when
            ``changes`` covers only one trainer rank's shard of it (see ``rows``).
        rows (`Mapping[str, Window]`, *optional*): for a shard: per tensor, the dim-0 rows (or
            flat :class:`Elements`) of the full tensor that ``changes`` was computed on (its specs
            are the slices).
        packed (`bool`, *optional*, defaults to `True`): the packed header of format 4; `False` writes
            format 3's plain header, which readers of format 3 read (a ``raw`` delta always has it).

    Returns:
        `bytes`: one safetensors file.
    """
    if version <= base_version:
        raise ValueError(f"version {version} must be greater than base_version {base_version}")
    sparse = get_codec(codec)
    dense = get_codec("dense")

    def encode_one(change: TensorChange) -> tuple[str, Any]:
        if change.dense:
            whole = dense.encode(change, level=level)
            changed = change.as_sparse() if change.whole_base is not None else None
            if changed is None or not sparse.supports(changed):
                return dense.name, whole
            # Densely changed: send whichever is smaller, the whole tensor or the changes.
            sparse_one = sparse.encode(changed, level=level)
            smaller = _nbytes(sparse_one) < _nbytes(whole)
            return (sparse.name, sparse_one) if smaller else (dense.name, whole)
        chosen = sparse if sparse.supports(change) else get_codec(DEFAULT_CODEC)
        return chosen.name, chosen.encode(change, level=level)

    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    specs = tuple(model) if model is not None else changes.specs
    full = _full_specs(specs, [c.spec for c in changes.changes], rows)
    sizes = [c.nnz for c in changes.changes]
    # Tensors too small for their compiled work to outweigh their Python: one thread encodes them all.
    results = map_shared(encode_one, changes.changes, sizes, workers, serial=[mostly_python(n) for n in sizes])
    for change, (name, encoded) in zip(changes.changes, results):
        parts = {f"{change.spec.name}::{part}": array.contiguous() for part, array in encoded.parts.items()}
        tensors.update(parts)
        entries[change.spec.name] = entry_json(
            full[change.spec.name], name, change.nnz, encoded.params, (rows or {}).get(change.spec.name),
            entry_digest([parts[key] for key in sorted(parts)]),
        )
    # A raw delta keeps the plain header: any safetensors reader can apply it (docs/FORMAT.md, "raw").
    meta = metadata_strings("delta", version, base_version, specs, entries, packed=packed and codec != "raw")
    return serialize(tensors, meta)


def _full_specs(model: Sequence[TensorSpec], carried: Sequence[TensorSpec], rows: Mapping[str, Window] | None) -> dict[str, TensorSpec]:
    """The full-tensor spec of each carried tensor, checking that shard slices match their windows."""
    by_name = {s.name: s for s in model}
    out = {}
    for local in carried:
        spec = by_name.get(local.name, local)
        window = (rows or {}).get(local.name)
        if window is not None:
            if not window_fits(spec, window) or slice_spec(spec, window) != local:
                raise ValueError(f"{local.name}: slice {local} does not match window {window} of {spec}")
        elif spec != local:
            raise ValueError(f"{local.name}: carried as {local}, the model has {spec}")
        out[local.name] = spec
    return out


def _nbytes(encoded: Any) -> int:
    return sum(part.numel() * part.element_size() for part in encoded.parts.values())


def serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """``safetensors.torch.save(tensors, metadata=metadata)``, byte for byte, without its per-entry cost (for
    a delta's metadata, with its packed header: :func:`serialize_parts`)."""
    return b"".join(serialize_parts(tensors, metadata))


def serialize_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[Any]:
    """The bytes of :func:`serialize` as buffers to write one after another, not joined.

    The first buffer is the length prefix and the JSON header; each later one is a
    view of a tensor's memory (so the tensors must not change until the buffers are
    written). An anchor's parts go to the store this way, skipping one copy of the
    weights.

    safetensors' Python wrapper pays a fixed cost per entry (ctypes pointers,
    shared-storage checks) before the one copy into the file, which adds up over
    a delta's hundreds of entries. The layout is the same:
    header JSON padded with spaces to 8 bytes, then the entries widest dtype
    first; within a dtype, by name with numbered parts in numeric order
    (:func:`natural_key`; safetensors itself sorts by plain name, and any
    order is a valid file). Anything else (other dtypes, devices,
    big-endian hosts) goes through safetensors itself.

    Metadata of format 4 (a delta's) gets the packed header
    (:func:`~deltasync.format.layout.pack`): the same data area under one
    ``streams`` entry; through safetensors itself it is written as format 3.
    """
    packed = metadata.get("format_version") == str(PACKED_VERSION)
    if sys.byteorder != "little" or any(
        t.dtype not in _SAFETENSORS_DTYPES or t.device.type != "cpu" or not t.is_contiguous()
        for t in tensors.values()
    ):
        if packed:  # the plain header says the same
            metadata = {**metadata, "format_version": str(PACKED_VERSION - 1)}
        data = safetensors.torch.save(tensors, metadata=metadata)
        head = 8 + struct.unpack("<Q", data[:8])[0]
        return [data[:head], memoryview(data)[head:]]
    order = sorted(tensors, key=lambda name: (-_SAFETENSORS_DTYPES[tensors[name].dtype][1], natural_key(name)))
    header: dict[str, Any] = {"__metadata__": metadata}
    buffers = []
    offset = 0
    for name in order:
        tensor = tensors[name]
        data = host_bytes(tensor)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype][0],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.size],
        }
        buffers.append(data)
        offset += data.size
    if packed:
        header = pack(metadata, {name: info for name, info in header.items() if name != "__metadata__"})
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw, *buffers]


@functools.lru_cache(maxsize=1 << 17)
def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders numbered parts by number: ``experts.2`` before ``experts.10``.

    Entries laid out in this order keep a layer's experts, and an expert-parallel
    rank's run of experts, next to each other, so a range reader fetches them in
    one request. Kept per name: a model's names recur in every version it publishes, and splitting them
    again would cost every entry of every version.
    """
    # isdecimal, not isdigit: "²" is a digit that int() cannot read, and \d does not split it out.
    return tuple(int(part) if part.isdecimal() else part for part in re.split(r"(\d+)", name))


def encode_anchor(
    source: Mapping[str, torch.Tensor],
    *,
    version: int,
    model: Sequence[TensorSpec] | None = None,
    rows: Mapping[str, Window] | None = None,
) -> bytes:
    """Serialize full tensors (in their published dtype) as an anchor file (see :func:`encode_anchor_parts`)."""
    return b"".join(encode_anchor_parts(source, version=version, model=model, rows=rows))


@collector_paused()
def encode_anchor_parts(
    source: Mapping[str, torch.Tensor],
    *,
    version: int,
    model: Sequence[TensorSpec] | None = None,
    rows: Mapping[str, Window] | None = None,
) -> list[Any]:
    """Serialize full tensors (in their published dtype) as an anchor file, in unjoined buffers.

    The buffers after the first view the tensors' memory (CPU tensors are not
    copied): the caller keeps the tensors unchanged until the buffers are written.

    The entries are the tensors under their own names, so an anchor is also an
    ordinary safetensors checkpoint.

    Args:
        source (`Mapping[str, Tensor]`): the tensors this file carries.
        version (`int`): the version the weights belong to.
        model (`Sequence[TensorSpec]`, *optional*): every tensor of the model, when
            ``source`` is one part of a larger anchor; fingerprint and ``numel``
            describe the whole model.
        rows (`Mapping[str, Window]`, *optional*): for a trainer rank's shard: per tensor,
            the dim-0 rows (or flat :class:`Elements`) of the full tensor that ``source`` holds.
    """
    specs = tuple(TensorSpec.of(n, t) for n, t in source.items())
    full = _full_specs(tuple(model) if model is not None else specs, specs, rows)
    tensors = on_host(source, pinned=any(t.device.type == "cuda" for t in source.values()))
    tensors = dict(sorted(tensors.items(), key=lambda item: natural_key(item[0])))
    entries = {
        s.name: entry_json(full[s.name], "dense", s.numel, {}, (rows or {}).get(s.name), entry_digest([tensors[s.name]]))
        for s in specs
    }
    meta = metadata_strings("anchor", version, None, tuple(model) if model is not None else specs, entries)
    return serialize_parts(tensors, meta)


def on_host(source: Mapping[str, torch.Tensor], *, pinned: bool) -> dict[str, torch.Tensor]:
    """Every tensor of ``source`` on the CPU, contiguous; CPU tensors as they are where they already are.

    Tensors elsewhere go through one host buffer (pinned when ``pinned``: on CUDA) with one asynchronous
    copy each and one wait per device for all of them. A copy per tensor to pageable memory would wait
    for each in turn and move at the driver's staging speed, a fraction of a pinned copy's.
    """
    away = {name: t for name, t in source.items() if t.device.type != "cpu"}
    out = {name: t.detach().contiguous() for name, t in source.items() if name not in away}
    if not away:
        return out
    starts, at = {}, 0
    for name, t in away.items():
        starts[name] = at
        at += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN  # each tensor aligned for its dtype
    staging = torch.empty(at, dtype=torch.uint8, pin_memory=pinned)
    for name, t in away.items():
        nbytes = t.numel() * t.element_size()
        view = staging[starts[name] : starts[name] + nbytes].view(t.dtype).view(t.shape)
        out[name] = view.copy_(t.detach(), non_blocking=pinned)
    settle(t.device for t in away.values())  # every copy landed before the buffers are read
    return {name: out[name] for name in source}


def as_numpy_bits(tensor: torch.Tensor) -> np.ndarray:
    """Bit patterns of a CPU tensor as a flat numpy array (for base lookups)."""
    from .tensors import bits_view

    return bits_view(tensor.detach()).reshape(-1).cpu().numpy()
