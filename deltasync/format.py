"""The wire format: one delta or anchor is one valid safetensors file.

A *delta* carries, for each changed tensor ``T``, the entries ``T::idx`` /
``T::val`` (or whatever parts its codec names) and, in the safetensors
``__metadata__``, everything needed to check and decode it: format and version,
model fingerprint, version and base version, and per tensor its codec, shape,
dtype, changed-element count and codec params. An *anchor* is a plain bf16
checkpoint (entries named after the tensors themselves, loadable by any
safetensors reader) with the same metadata. ``docs/FORMAT.md`` specifies it.

Reading is split in two so a receiver can refuse a file before decoding it:
:func:`read_header` parses and validates the metadata alone, and
:func:`decode` decodes and validates every tensor without writing anything.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
import safetensors
import safetensors.torch
import torch

from .codec import DEFAULT_CODEC, BaseLookup, Decoded, get_codec
from .diff import ChangeSet, TensorChange
from .errors import CodecError, DeltaFormatError, FingerprintMismatch
from .jsonio import load_json
from .tensors import TensorSpec, dtype_from_name, fingerprint

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "TensorEntry",
    "Header",
    "encode_delta",
    "encode_anchor",
    "read_header",
    "decode",
    "combine",
]

FORMAT_NAME = "deltasync"
FORMAT_VERSION = 1
# Metadata of a 100k-tensor model is ~20 MB; beyond this a header is hostile.
MAX_HEADER_BYTES = 64 << 20
DEFAULT_LEVEL = 1  # zstd level: on real SmolLM2 deltas level 1 is within 0.2 % of level 3 (and 1.5 % of 9), faster
_WORKERS = min(8, os.cpu_count() or 1)
# Fixed cost of encoding one tensor, in changed elements (~30 us at ~25 ns per
# element on SmolLM2): what balancing the encoder threads' shares counts per tensor.
_TASK_COST = 1000
# safetensors' dtype names, with the rank of its writer's layout order (entries
# of a higher rank come first); see _serialize.
_SAFETENSORS_DTYPES: dict[torch.dtype, tuple[str, int]] = {
    dtype: (name, rank)
    for rank, (dtype, name) in enumerate(
        [
            (torch.bool, "BOOL"),
            (torch.uint8, "U8"),
            (torch.int8, "I8"),
            (torch.int16, "I16"),
            (torch.float16, "F16"),
            (torch.bfloat16, "BF16"),
            (torch.int32, "I32"),
            (torch.float32, "F32"),
            (torch.float64, "F64"),
            (torch.int64, "I64"),
        ]
    )
}
_T = TypeVar("_T")

Kind = Literal["delta", "anchor"]
Rows = tuple[int, int]
"""``[start, stop)`` along dim 0 of a tensor: the part of it one shard file carries."""


def slice_spec(spec: TensorSpec, rows: Rows) -> TensorSpec:
    """The spec of rows ``[start, stop)`` (dim 0) of the tensor ``spec`` describes."""
    return TensorSpec(spec.name, (rows[1] - rows[0], *spec.shape[1:]), spec.dtype)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """What a file says about one tensor it carries."""

    spec: TensorSpec
    """Name, full shape and published dtype."""
    codec: str
    """Codec that encoded the tensor (``"dense"`` for anchors)."""
    nnz: int
    """Elements that changed since the base version (all, for anchors)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Codec parameters."""
    rows: Rows | None = None
    """For a shard written by one trainer rank: the dim-0 rows of the full tensor this
    file carries (indices and values are relative to the first); ``None``: all of it."""

    @property
    def local_spec(self) -> TensorSpec:
        """The spec of what the file carries: the full tensor, or its slice of ``rows``."""
        return self.spec if self.rows is None else slice_spec(self.spec, self.rows)

    @property
    def offset(self) -> int:
        """Flat index in the full tensor of the first element carried."""
        if self.rows is None:
            return 0
        return self.rows[0] * (self.spec.numel // self.spec.shape[0] if self.spec.shape[0] else 0)

    @property
    def span(self) -> tuple[int, int]:
        """Flat ``[start, stop)`` range of the full tensor that this entry covers."""
        return self.offset, self.offset + self.local_spec.numel


@dataclass(frozen=True, slots=True)
class Header:
    """The validated metadata of a delta or anchor file."""

    kind: Kind
    """``"delta"`` or ``"anchor"``."""
    version: int
    """The version this file produces."""
    base_version: int | None
    """The version a delta applies to; ``None`` for anchors."""
    fingerprint: str
    """Hash of all published names, shapes and dtypes (see :func:`tensors.fingerprint`)."""
    numel: int
    """Elements in the whole model."""
    tensors: dict[str, TensorEntry]
    """Carried tensors by name; unchanged tensors are absent from deltas."""
    format_version: int = FORMAT_VERSION
    """Wire format revision."""

    @property
    def nnz(self) -> int:
        """Elements this file changes."""
        return sum(e.nnz for e in self.tensors.values())

    @property
    def sparsity(self) -> float:
        """Fraction of the model's elements left untouched."""
        return 1.0 - self.nnz / self.numel if self.numel else 1.0


def encode_delta(
    changes: ChangeSet,
    *,
    version: int,
    base_version: int,
    codec: str = DEFAULT_CODEC,
    level: int = DEFAULT_LEVEL,
    workers: int | None = None,
    model: Sequence[TensorSpec] | None = None,
    rows: Mapping[str, Rows] | None = None,
) -> bytes:
    """Serialize a change set as a delta file.

    Args:
        changes (`ChangeSet`): what changed since ``base_version``.
        version (`int`): the version this delta produces; must exceed ``base_version``.
        base_version (`int`): the version the changes were computed against.
        codec (`str`, *optional*, defaults to ``"compact"``): codec for sparse tensors;
            densely changed tensors always use ``"dense"``.
        level (`int`, *optional*, defaults to 1): zstd level for compressing codecs.
        workers (`int`, *optional*): encoding threads; defaults to the CPU count (at most 8).
        model (`Sequence[TensorSpec]`, *optional*): every tensor of the full model, when
            ``changes`` covers only one trainer rank's shard of it (see ``rows``).
        rows (`Mapping[str, Rows]`, *optional*): for a shard: per tensor, the dim-0 rows of
            the full tensor that ``changes`` was computed on (its specs are the slices).

    Returns:
        `bytes`: one safetensors file.
    """
    if version <= base_version:
        raise ValueError(f"version {version} must be greater than base_version {base_version}")
    sparse = get_codec(codec)
    dense = get_codec("dense")

    def encode_one(change: TensorChange) -> tuple[str, Any]:
        chosen = dense if change.dense else sparse
        if not chosen.supports(change):
            chosen = get_codec(DEFAULT_CODEC)
        return chosen.name, chosen.encode(change, level=level)

    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    specs = tuple(model) if model is not None else changes.specs
    full = _full_specs(specs, [c.spec for c in changes.changes], rows)
    results = _map_shared(encode_one, changes.changes, workers or _WORKERS)
    for change, (name, encoded) in zip(changes.changes, results):
        for part, array in encoded.parts.items():
            tensors[f"{change.spec.name}::{part}"] = array.contiguous()
        entries[change.spec.name] = _entry_json(
            full[change.spec.name], name, change.nnz, encoded.params, (rows or {}).get(change.spec.name)
        )
    meta = _metadata("delta", version, base_version, specs, entries)
    return _serialize(tensors, meta)


def _full_specs(model: Sequence[TensorSpec], carried: Sequence[TensorSpec], rows: Mapping[str, Rows] | None) -> dict[str, TensorSpec]:
    """The full-tensor spec of each carried tensor, checking that shard slices match their rows."""
    by_name = {s.name: s for s in model}
    out = {}
    for local in carried:
        spec = by_name.get(local.name, local)
        window = (rows or {}).get(local.name)
        if window is not None:
            if not spec.shape or not 0 <= window[0] <= window[1] <= spec.shape[0] or slice_spec(spec, window) != local:
                raise ValueError(f"{local.name}: slice {local} does not match rows {window} of {spec}")
        elif spec != local:
            raise ValueError(f"{local.name}: carried as {local}, the model has {spec}")
        out[local.name] = spec
    return out


def _map_shared(fn: Callable[[TensorChange], _T], changes: Sequence[TensorChange], workers: int) -> list[_T]:
    """``[fn(c) for c in changes]`` in up to ``workers`` threads, one share of the work each.

    numpy and zstd release the GIL on large arrays, so tensors encode in
    parallel; but one task per tensor hands the GIL and results back and forth
    hundreds of times per delta, which cost more than it saved on 2 cores. So
    each thread (the caller included) takes one share, balanced by changed
    elements, largest tensors dealt first.
    """
    if workers <= 1 or len(changes) <= 1:
        return [fn(c) for c in changes]
    shares: list[list[int]] = [[] for _ in range(min(workers, len(changes)))]
    loads = [0] * len(shares)
    for i in sorted(range(len(changes)), key=lambda i: -changes[i].nnz):
        lightest = loads.index(min(loads))
        shares[lightest].append(i)
        loads[lightest] += changes[i].nnz + _TASK_COST
    results: list[Any] = [None] * len(changes)

    def run(share: list[int]) -> None:
        for i in share:
            results[i] = fn(changes[i])

    with ThreadPoolExecutor(max_workers=len(shares) - 1) as pool:
        pending = [pool.submit(run, share) for share in shares[1:]]
        run(shares[0])
        for future in pending:
            future.result()
    return results


def _serialize(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """``safetensors.torch.save(tensors, metadata=metadata)``, byte for byte, without its per-entry cost.

    safetensors' Python wrapper spends ~18 us per entry (ctypes pointers,
    shared-storage checks) before the one copy into the file: 8.8 ms for a
    SmolLM2 delta's 478 entries, against 0.7 ms here. The layout is the same:
    header JSON padded with spaces to 8 bytes, then the entries widest dtype
    first and by name within a dtype. Anything else (other dtypes, devices,
    big-endian hosts) goes through safetensors itself.
    """
    if sys.byteorder != "little" or any(
        t.dtype not in _SAFETENSORS_DTYPES or t.device.type != "cpu" or not t.is_contiguous()
        for t in tensors.values()
    ):
        return safetensors.torch.save(tensors, metadata=metadata)
    order = sorted(tensors, key=lambda name: (-_SAFETENSORS_DTYPES[tensors[name].dtype][1], name))
    header: dict[str, Any] = {"__metadata__": metadata}
    buffers = []
    offset = 0
    for name in order:
        tensor = tensors[name]
        data = tensor.reshape(-1).view(torch.uint8).numpy()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype][0],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.size],
        }
        buffers.append(data)
        offset += data.size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return b"".join([struct.pack("<Q", len(raw)), raw, *buffers])


def encode_anchor(
    source: Mapping[str, torch.Tensor],
    *,
    version: int,
    model: Sequence[TensorSpec] | None = None,
    rows: Mapping[str, Rows] | None = None,
) -> bytes:
    """Serialize full tensors (in their published dtype) as an anchor file.

    The entries are the tensors under their own names, so an anchor is also an
    ordinary safetensors checkpoint.

    Args:
        source (`Mapping[str, Tensor]`): the tensors this file carries.
        version (`int`): the version the weights belong to.
        model (`Sequence[TensorSpec]`, *optional*): every tensor of the model, when
            ``source`` is one part of a larger anchor; fingerprint and ``numel``
            describe the whole model.
        rows (`Mapping[str, Rows]`, *optional*): for a trainer rank's shard: per tensor,
            the dim-0 rows of the full tensor that ``source`` holds.
    """
    specs = tuple(TensorSpec.of(n, t) for n, t in source.items())
    full = _full_specs(tuple(model) if model is not None else specs, specs, rows)
    entries = {s.name: _entry_json(full[s.name], "dense", s.numel, {}, (rows or {}).get(s.name)) for s in specs}
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in source.items()}
    meta = _metadata("anchor", version, None, tuple(model) if model is not None else specs, entries)
    return safetensors.torch.save(tensors, metadata=meta)


def _entry_json(spec: TensorSpec, codec: str, nnz: int, params: dict[str, Any], rows: Rows | None = None) -> dict[str, Any]:
    out = {"codec": codec, "shape": list(spec.shape), "dtype": spec.dtype, "nnz": nnz, "params": params}
    if rows is not None:
        out["rows"] = [int(rows[0]), int(rows[1])]
    return out


def _metadata(
    kind: Kind,
    version: int,
    base_version: int | None,
    specs: tuple[TensorSpec, ...],
    entries: dict[str, dict[str, Any]],
) -> dict[str, str]:
    numel = sum(s.numel for s in specs)
    nnz = sum(e["nnz"] for e in entries.values())
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "kind": kind,
        "version": str(version),
        "fingerprint": fingerprint(specs),
        "numel": str(numel),
        "nnz": str(nnz),
        "sparsity": f"{1 - nnz / numel if numel else 1.0:.6f}",
        "tensors": json.dumps(entries, separators=(",", ":")),
    }
    if base_version is not None:
        meta["base_version"] = str(base_version)
    return meta


def raw_header(data: bytes | memoryview) -> dict[str, Any]:
    """The safetensors JSON header of ``data``, with its length bounded and checked."""
    if len(data) < 8:
        raise DeltaFormatError("not a safetensors file: shorter than 8 bytes")
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    if length > MAX_HEADER_BYTES or length > len(data) - 8:
        raise DeltaFormatError(
            f"safetensors header length {length} exceeds the file or the {MAX_HEADER_BYTES}-byte cap",
            length=length,
        )
    header = load_json(bytes(data[8 : 8 + length]), what="safetensors header", error=DeltaFormatError)
    if not isinstance(header, dict):
        raise DeltaFormatError("safetensors header must be a JSON object")
    return header


def read_header(data: bytes | memoryview) -> Header:
    """Parse and validate the deltasync metadata of a delta or anchor file.

    Raises:
        `DeltaFormatError`: the file is not a deltasync file of a supported version,
            or its metadata is malformed.
    """
    meta = raw_header(data).get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DeltaFormatError("not a deltasync file: metadata 'format' is not 'deltasync'")
    try:
        return _parse_header(meta)
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:  # int(inf), nested JSON
        if isinstance(exc, DeltaFormatError):
            raise
        raise DeltaFormatError(f"malformed deltasync metadata: {exc!r}") from None


def _parse_header(meta: dict[str, Any]) -> Header:
    format_version = int(meta["format_version"])
    if format_version != FORMAT_VERSION:
        raise DeltaFormatError(
            f"format version {format_version} is not supported (this deltasync reads "
            f"{FORMAT_VERSION}); upgrade deltasync",
            format_version=format_version,
        )
    kind = meta["kind"]
    if kind not in ("delta", "anchor"):
        raise DeltaFormatError(f"unknown kind {kind!r}")
    version = int(meta["version"])
    base = int(meta["base_version"]) if kind == "delta" else None
    if version < 0 or (base is not None and not 0 <= base < version):
        raise DeltaFormatError(f"bad version {version} / base {base}")
    raw_entries = load_json(str(meta["tensors"]).encode(), what="metadata 'tensors'", error=DeltaFormatError)
    if not isinstance(raw_entries, dict):
        raise DeltaFormatError("metadata 'tensors' must be a JSON object")
    tensors = {name: _parse_entry(name, e) for name, e in raw_entries.items()}
    numel = int(meta["numel"])
    return Header(kind, version, base, str(meta["fingerprint"]), numel, tensors, format_version)


def _parse_entry(name: str, raw: Any) -> TensorEntry:
    if not isinstance(raw, dict):
        raise DeltaFormatError(f"{name}: tensor entry must be an object")
    shape = raw["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise DeltaFormatError(f"{name}: bad shape {shape!r}")
    dtype_from_name(raw["dtype"])
    spec = TensorSpec(name, tuple(shape), raw["dtype"])
    nnz, params, rows = raw["nnz"], raw.get("params", {}), raw.get("rows")
    if rows is not None:
        if (
            not isinstance(rows, list)
            or len(rows) != 2
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in rows)
            or not shape
            or not 0 <= rows[0] <= rows[1] <= shape[0]
        ):
            raise DeltaFormatError(f"{name}: bad rows {rows!r} for shape {shape}")
        rows = (rows[0], rows[1])
    entry = TensorEntry(spec, str(raw["codec"]), 0, {}, rows)
    if not isinstance(nnz, int) or not 0 <= nnz <= entry.local_spec.numel:
        raise DeltaFormatError(f"{name}: nnz {nnz!r} outside [0, {entry.local_spec.numel}]")
    if not isinstance(params, dict):
        raise DeltaFormatError(f"{name}: params must be an object")
    return TensorEntry(spec, str(raw["codec"]), nnz, params, rows)


def check_compatible(header: Header, expected_fingerprint: str) -> None:
    """Refuse a file made for another model."""
    if header.fingerprint != expected_fingerprint:
        raise FingerprintMismatch(
            f"file is for model {header.fingerprint}, this receiver holds {expected_fingerprint}: "
            "point the receiver at the right store, or start it from this run's anchor",
            expected=expected_fingerprint,
            found=header.fingerprint,
        )


def decode(
    data: bytes | memoryview, *, base: BaseLookup | None = None, header: Header | None = None
) -> tuple[Header, dict[str, Decoded]]:
    """Decode every tensor of a delta or anchor, validating all of it, writing nothing.

    Args:
        data (`bytes`): the whole file.
        base (`BaseLookup`, *optional*): reads the receiver's current bit patterns,
            required by base-relative codecs such as ``compact``.
        header (`Header`, *optional*): the already parsed header, to skip re-parsing.

    Returns:
        `(Header, dict[str, Decoded])`: per tensor, validated indices and new bit patterns.
            For a shard file (entries with ``rows``) indices are flat in the full tensor and
            a whole slice comes back as ``Decoded(None, values, start)``; :func:`combine`
            joins the shards of one version.

    Raises:
        `DeltaFormatError` / `CodecError`: anything malformed; `IntegrityError`: a
            base-relative decode did not reproduce the publisher's values.
    """
    header = header or read_header(data)
    try:
        entries = safetensors.torch.load(bytes(data))
    except (safetensors.SafetensorError, RuntimeError, ValueError) as exc:
        raise DeltaFormatError(f"corrupt safetensors body: {exc}") from None
    decoded: dict[str, Decoded] = {}
    if header.kind == "anchor":
        if entries.keys() != header.tensors.keys():
            raise DeltaFormatError("anchor entries differ from its metadata")
        for name, entry in header.tensors.items():
            parts = {"val": entries[name]}
            decoded[name] = _place(get_codec("dense").decode(parts, {}, entry.local_spec, entry.nnz, None), entry)
        return header, decoded
    grouped: dict[str, dict[str, torch.Tensor]] = {name: {} for name in header.tensors}
    stray = []
    for key, value in entries.items():  # one pass: entry "T::part" belongs to tensor T
        cut = key.rfind("::")
        if cut < 0 or key[:cut] not in grouped:
            stray.append(key)
        else:
            grouped[key[:cut]][key[cut + 2 :]] = value
    if stray:
        raise DeltaFormatError(f"entries without metadata: {stray[:5]}")
    codecs = {}
    for name, entry in header.tensors.items():  # resolve every codec before decoding any
        try:
            codecs[name] = get_codec(entry.codec)
        except ValueError as exc:
            raise CodecError(f"{name}: {exc}", name=name) from None
    for name, entry in header.tensors.items():
        lookup = base
        if base is not None and entry.offset:
            lookup = functools.partial(_shifted_lookup, base, entry.offset)
        decoded[name] = _place(codecs[name].decode(grouped[name], entry.params, entry.local_spec, entry.nnz, lookup), entry)
    return header, decoded


def _shifted_lookup(base: BaseLookup, offset: int, name: str, indices: np.ndarray) -> np.ndarray:
    return base(name, indices + offset)


def _place(patch: Decoded, entry: TensorEntry) -> Decoded:
    """Move a shard's slice-relative patch to its place in the full tensor."""
    offset = entry.offset
    if not offset:
        return patch
    if patch.indices is None:
        return Decoded(None, patch.values, offset)
    return Decoded(patch.indices + offset, patch.values)


def combine(parts: Sequence[tuple[Header, dict[str, Decoded]]], *, whole: bool) -> dict[str, Decoded]:
    """Join the decoded files of one version (anchor parts, or shards from several ranks).

    Each tensor's pieces must cover disjoint ranges of it; with ``whole`` (anchors)
    they must cover all of it. A tensor carried by one file is passed through; a
    tensor in slices becomes one patch: whole values when the slices cover the
    tensor densely, sorted indices and values otherwise.

    Raises:
        `DeltaFormatError`: two files carry the same elements, or an anchor leaves a gap.
    """
    pieces: dict[str, list[tuple[tuple[int, int], Decoded]]] = {}
    specs: dict[str, TensorSpec] = {}
    for header, decoded in parts:
        for name, patch in decoded.items():
            entry = header.tensors[name]
            if specs.setdefault(name, entry.spec) != entry.spec:
                raise DeltaFormatError(f"{name}: the files of one version disagree on its shape or dtype")
            pieces.setdefault(name, []).append((entry.span, patch))
    out: dict[str, Decoded] = {}
    for name, found in pieces.items():
        found.sort(key=lambda item: item[0])
        covered = 0
        for (start, stop), _ in found:
            if start < covered:
                raise DeltaFormatError(f"{name}: two files of one version carry the same elements")
            if whole and start != covered:
                raise DeltaFormatError(f"{name}: the anchor leaves elements [{covered}, {start}) out")
            covered = stop
        if whole and covered != specs[name].numel:
            raise DeltaFormatError(f"{name}: the anchor leaves elements [{covered}, {specs[name].numel}) out")
        out[name] = _join([p for _, p in found], specs[name].numel)
    return out


def _join(patches: list[Decoded], numel: int) -> Decoded:
    if len(patches) == 1 and (patches[0].indices is not None or (patches[0].start == 0 and patches[0].values.size == numel)):
        return patches[0]
    if all(p.indices is None for p in patches) and sum(p.values.size for p in patches) == numel:
        return Decoded(None, np.concatenate([p.values for p in patches]))
    indices = [
        p.indices if p.indices is not None else np.arange(p.start, p.start + p.values.size, dtype=np.int64)
        for p in patches
    ]
    return Decoded(np.concatenate(indices), np.concatenate([p.values for p in patches]))


def as_numpy_bits(tensor: torch.Tensor) -> np.ndarray:
    """Bit patterns of a CPU tensor as a flat numpy array (for base lookups)."""
    from .tensors import bits_view

    return bits_view(tensor.detach()).reshape(-1).cpu().numpy()
