"""Payload layouts that are not deltasync codecs, measured beside them on the same change sets.

Each encoder returns the bytes a publisher of that layout would upload, so the
sizes in the payload sweeps are exact; each sparse layout also has a decoder,
and :func:`check_roundtrip` proves on every benchmark point that the layout is
lossless (a size is only worth comparing if the bytes carry the whole delta).
These are benchmark baselines, not wire formats deltasync reads or writes:

- ``dense_file``: every published tensor as a bf16 safetensors file (what a
  full sync moves), optionally compressed as one zstd frame (``dense_zstd``).
- ``xor_zstd``: the whole model's bit patterns XOR the published snapshot, as
  one zstd frame; unchanged elements become zero bytes. The obvious "compress
  the dense difference" design.
- ``gap16_file``: the later public TRL prototype's layout: per tensor, the
  gaps between sorted flat indices as ``uint16`` (a gap of 65535 or more is
  written as the escape 65535 and the whole gap goes to a ``uint32`` side
  array), and the new values as bf16, in an uncompressed safetensors file.
- ``rowcol_zstd``: the layout PULSE describes: per tensor, COO row indices
  delta-coded (``uint8`` when every row step fits, else ``int32``), column
  indices delta-coded within a row and absolute at a row change (``uint16``
  when they fit, else ``int32``), then the bf16 values; all tensors with a
  small JSON header in one zstd level-1 frame.

Sparse layouts take a change set whose tensors are all sparse (diff with
``dense_fraction=1.0``): the prototypes have no whole-tensor fallback.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import numpy as np
import safetensors.torch
import torch
import zstandard

from deltasync.format import encode_anchor
from deltasync.publish.diff import Snapshot
from deltasync.tensors import ChangeSet, bits_view

__all__ = [
    "dense_file",
    "dense_zstd",
    "xor_zstd",
    "gap16_file",
    "gap16_decode",
    "rowcol_zstd",
    "rowcol_decode",
    "check_roundtrip",
]

_ESCAPE16 = 0xFFFF
_ROWCOL_LEVEL = 1  # PULSE compresses with zstd level 1


def dense_file(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Every tensor in bf16 as one safetensors file (deltasync's anchor: a plain checkpoint)."""
    return encode_anchor({n: t.detach().to(torch.bfloat16) for n, t in tensors.items()}, version=0)


def dense_zstd(dense: bytes, level: int) -> int:
    """Size of the dense file compressed as one zstd frame (single-threaded, deterministic)."""
    return len(zstandard.ZstdCompressor(level=level).compress(dense))


def xor_zstd(snapshot: Snapshot, current: Mapping[str, torch.Tensor], level: int = 1) -> int:
    """Size of one zstd frame over every tensor's bits XOR the snapshot's, in publishing order."""
    compressor = zstandard.ZstdCompressor(level=level).compressobj()
    size = 0
    for name, published in snapshot.items():
        xor = torch.bitwise_xor(bits_view(current[name].contiguous()), bits_view(published))
        size += len(compressor.compress(xor.view(-1).numpy().data))
    return size + len(compressor.flush())


def _sparse(changes: ChangeSet) -> None:
    if any(c.dense for c in changes.changes):
        raise ValueError("sparse baselines need a change set diffed with dense_fraction=1.0")


def gap16_file(changes: ChangeSet) -> bytes:
    """The uint16-gap + bf16 layout as an uncompressed safetensors file."""
    _sparse(changes)
    entries: dict[str, torch.Tensor] = {}
    for change in changes.changes:
        assert change.indices is not None
        idx = change.indices.numpy()
        gaps = np.diff(idx, prepend=np.int64(0))  # the first gap is the first index
        big = gaps >= _ESCAPE16
        name = change.spec.name
        entries[f"{name}.gaps"] = torch.from_numpy(np.where(big, _ESCAPE16, gaps).astype(np.uint16))
        if big.any():
            entries[f"{name}.escapes"] = torch.from_numpy(gaps[big].astype(np.uint32))
        entries[f"{name}.values"] = change.values.view(torch.bfloat16)
    return safetensors.torch.save(entries, metadata={"shapes": _shapes(changes)})


def gap16_decode(data: bytes) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Inverse of :func:`gap16_file`: tensor name -> (flat indices, bf16 bit patterns)."""
    entries = safetensors.torch.load(data)
    out = {}
    for key in entries:
        if not key.endswith(".gaps"):
            continue
        name = key[: -len(".gaps")]
        gaps = entries[key].numpy().astype(np.int64)
        big = gaps == _ESCAPE16
        if big.any():
            gaps[big] = entries[f"{name}.escapes"].numpy()
        out[name] = (np.cumsum(gaps), bits_view(entries[f"{name}.values"]).numpy())
    return out


def _shapes(changes: ChangeSet) -> str:
    return json.dumps({c.spec.name: list(c.spec.shape) for c in changes.changes}, separators=(",", ":"))


def _row_length(shape: tuple[int, ...]) -> int:
    """Elements per row: a 1-D tensor is one element per row, as PULSE flattens it."""
    return int(np.prod(shape[1:])) if len(shape) > 1 else 1


def _smallest(values: np.ndarray, narrow: np.dtype) -> np.ndarray:
    fits = values.size == 0 or int(values.max()) <= np.iinfo(narrow).max
    return values.astype(narrow if fits else np.int32)


def rowcol_zstd(changes: ChangeSet, level: int = _ROWCOL_LEVEL) -> bytes:
    """The row/column delta-coded layout, all tensors in one zstd frame."""
    _sparse(changes)
    meta, chunks = [], []
    for change in changes.changes:
        assert change.indices is not None
        idx = change.indices.numpy()
        rows, cols = np.divmod(idx, _row_length(change.spec.shape))
        row_steps = np.diff(rows, prepend=np.int64(0))
        new_row = np.ones(idx.size, dtype=bool)
        new_row[1:] = row_steps[1:] != 0
        col_steps = np.where(new_row, cols, cols - np.concatenate([[0], cols[:-1]]))
        r, c = _smallest(row_steps, np.dtype(np.uint8)), _smallest(col_steps, np.dtype(np.uint16))
        values = change.values.numpy()
        meta.append({"name": change.spec.name, "shape": list(change.spec.shape), "nnz": int(idx.size),
                     "rows": r.dtype.str, "cols": c.dtype.str})
        chunks += [r.tobytes(), c.tobytes(), values.tobytes()]
    header = json.dumps(meta, separators=(",", ":")).encode()
    payload = b"".join([struct.pack("<I", len(header)), header, *chunks])
    return zstandard.ZstdCompressor(level=level).compress(payload)


def rowcol_decode(data: bytes) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Inverse of :func:`rowcol_zstd`: tensor name -> (flat indices, bf16 bit patterns)."""
    raw = zstandard.ZstdDecompressor().decompress(data)
    (length,) = struct.unpack("<I", raw[:4])
    offset = 4 + length
    out = {}
    for entry in json.loads(raw[4:offset]):
        n = entry["nnz"]
        arrays = []
        for dtype in (np.dtype(entry["rows"]), np.dtype(entry["cols"]), np.dtype(np.int16)):
            arrays.append(np.frombuffer(raw, dtype=dtype, count=n, offset=offset).astype(np.int64))
            offset += n * dtype.itemsize
        row_steps, col_steps, values = arrays
        rows = np.cumsum(row_steps)
        new_row = np.ones(n, dtype=bool)
        new_row[1:] = row_steps[1:] != 0
        # Columns: a running sum that restarts at every new row (absolute column there).
        running = np.cumsum(col_steps)
        starts = np.flatnonzero(new_row)
        restart = np.repeat(running[starts] - col_steps[starts], np.diff(np.append(starts, n)))
        cols = running - restart
        out[entry["name"]] = (rows * _row_length(tuple(entry["shape"])) + cols, values.astype(np.int16))
    return out


def check_roundtrip(name: str, decoded: dict[str, tuple[np.ndarray, np.ndarray]], changes: ChangeSet) -> None:
    """Require a baseline's decoded indices and values to equal the change set exactly."""
    if decoded.keys() != {c.spec.name for c in changes.changes}:
        raise AssertionError(f"{name}: decoded tensors differ from the change set")
    for change in changes.changes:
        indices, values = decoded[change.spec.name]
        assert change.indices is not None
        if not (np.array_equal(indices, change.indices.numpy()) and np.array_equal(values, change.values.numpy())):
            raise AssertionError(f"{name}: {change.spec.name} does not round-trip")
