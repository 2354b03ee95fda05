"""The header of a delta or anchor file: its constants, types, and how it is written and read back.

Everything a receiver checks before decoding a single element lives here: the
safetensors JSON header (length-bounded, strict JSON), the deltasync metadata
(format, versions, fingerprint, per-tensor entries) parsed into a
:class:`Header`, and the compatibility check against a receiver's fingerprint.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ..errors import DeltaFormatError, FingerprintMismatch
from ..tensors import TensorSpec, dtype_from_name, fingerprint
from ..util.jsonio import load_json
from . import digests
from .layout import MAX_HEADER_BYTES, PACKED_VERSION, SAFETENSORS_DTYPES, InflatedTable, entry_span, tiled_spans, unpack

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ANCHOR_VERSION",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "Kind",
    "Rows",
    "Elements",
    "Window",
    "slice_spec",
    "window_fits",
    "TensorEntry",
    "Header",
    "entry_json",
    "entry_digest",
    "host_bytes",
    "metadata_strings",
    "header_ref",
    "tiled_spans",
    "entry_groups",
    "raw_header",
    "entry_span",
    "read_header",
    "header_of",
    "check_compatible",
]

FORMAT_NAME = "deltasync"
FORMAT_VERSION = PACKED_VERSION  # 2: BLAKE3 entry digests; 3: BLAKE3 value digests; 4: packed delta headers
ANCHOR_VERSION = 3  # anchors keep the plain header, so any safetensors reader (and any reader of 3) loads them

Kind = Literal["delta", "anchor"]
Rows = tuple[int, int]
"""``[start, stop)`` along dim 0 of a tensor: the part of it one shard file carries."""


@dataclass(frozen=True, slots=True)
class Elements:
    """``[start, stop)`` of a tensor's flat (row-major) elements: the part one shard file carries.

    What a trainer rank holds under DeepSpeed ZeRO-3, which partitions each
    flattened parameter into equal slices without regard to rows.
    """

    start: int
    stop: int


Window = Rows | Elements
"""The part of a tensor a shard file carries: dim-0 rows, or a flat element range."""


def slice_spec(spec: TensorSpec, window: Window | None) -> TensorSpec:
    """The spec of one window of the tensor ``spec`` describes: rows keep the row shape, elements are 1-D;
    ``None``, the whole tensor."""
    if window is None:
        return spec
    if isinstance(window, Elements):
        return TensorSpec(spec.name, (window.stop - window.start,), spec.dtype)
    return TensorSpec(spec.name, (window[1] - window[0], *spec.shape[1:]), spec.dtype)


def window_fits(spec: TensorSpec, window: Window) -> bool:
    """Whether ``window`` lies inside the tensor ``spec`` describes."""
    if isinstance(window, Elements):
        return 0 <= window.start <= window.stop <= spec.numel
    return bool(spec.shape) and 0 <= window[0] <= window[1] <= spec.shape[0]


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
    rows: Window | None = None
    """For a shard written by one trainer rank: the dim-0 rows (or, as :class:`Elements`,
    the flat elements) of the full tensor this file carries (indices and values are
    relative to the first); ``None``: all of it."""
    digest: tuple[str, str] | None = None
    """``(algorithm, hex)`` digest of the tensor's entry bytes, in entry-name order: lets a
    reader that range-reads only some tensors verify them (``None`` where the file lists none)."""

    @property
    def local_spec(self) -> TensorSpec:
        """The spec of what the file carries: the full tensor, or its slice of ``rows``."""
        return slice_spec(self.spec, self.rows)

    @property
    def offset(self) -> int:
        """Flat index in the full tensor of the first element carried."""
        if self.rows is None:
            return 0
        if isinstance(self.rows, Elements):
            return self.rows.start
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
    layout: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The file's safetensors header as :func:`raw_header` parsed it (where each entry lies), kept so that
    decoding the same file does not parse it again; ``None`` for a header built otherwise."""

    @property
    def nnz(self) -> int:
        """Elements this file changes."""
        return sum(e.nnz for e in self.tensors.values())

    @property
    def sparsity(self) -> float:
        """Fraction of the model's elements left untouched."""
        return 1.0 - self.nnz / self.numel if self.numel else 1.0


def entry_json(
    spec: TensorSpec,
    codec: str,
    nnz: int,
    params: dict[str, Any],
    rows: Window | None = None,
    digest: tuple[str, str] | None = None,
) -> dict[str, Any]:
    out = {"codec": codec, "shape": list(spec.shape), "dtype": spec.dtype, "nnz": nnz, "params": params}
    if isinstance(rows, Elements):
        out["elements"] = [int(rows.start), int(rows.stop)]
    elif rows is not None:
        out["rows"] = [int(rows[0]), int(rows[1])]
    if digest is not None:
        out[digest[0]] = digest[1]
    return out


def entry_digest(parts: Sequence[torch.Tensor | np.ndarray], algorithm: str = digests.WRITE) -> tuple[str, str]:
    """``(algorithm, hex)`` digest over the bytes of one tensor's entries, given in entry-name order."""
    return algorithm, digests.hexdigest((memoryview(host_bytes(p)) for p in parts), algorithm)


def host_bytes(tensor: torch.Tensor | np.ndarray) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array in host memory, viewed in place where it is contiguous there,
    a fraction of the cost of the general chain of reshape, copy and views (an anchor of thousands of tensors
    takes it several times a tensor). A decoded file's byte streams are numpy views of it already."""
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)
    if tensor.is_cpu and tensor.is_contiguous() and tensor.dim() and not tensor.requires_grad:
        return (tensor if tensor.dtype == torch.uint8 else tensor.view(torch.uint8)).numpy().reshape(-1)
    return tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()


def metadata_strings(
    kind: Kind,
    version: int,
    base_version: int | None,
    specs: tuple[TensorSpec, ...],
    entries: dict[str, dict[str, Any]],
    *,
    packed: bool = True,
) -> dict[str, str]:
    """A file's ``__metadata__``; a delta's says format 4 (packed when written) unless not ``packed``."""
    numel = sum(s.numel for s in specs)
    nnz = sum(e["nnz"] for e in entries.values())
    meta = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION if kind == "delta" and packed else ANCHOR_VERSION),
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


def header_ref(data: bytes | memoryview, algorithm: str = digests.WRITE) -> tuple[int, str]:
    """``(size, digest)`` of a file's first bytes (length prefix and JSON header), for the manifest."""
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    size = 8 + length
    return size, digests.hexdigest([memoryview(data)[:size]], algorithm)


def entry_groups(header: Header, layout: dict[str, Any]) -> dict[str, list[str]]:
    """The safetensors entries of each tensor, in entry-name order (an anchor's entry is the tensor's name,
    a delta's are ``T::part``); an entry of a tensor the header does not list is grouped under its owner."""
    groups: dict[str, list[str]] = {}
    for entry in sorted(name for name in layout if name != "__metadata__"):
        owner = entry if header.kind == "anchor" else entry.rpartition("::")[0]
        groups.setdefault(owner, []).append(entry)
    return groups


def raw_header(data: bytes | memoryview) -> dict[str, Any]:
    """The safetensors JSON header of ``data``, with its length bounded and checked; a packed (format 4)
    delta's as format 3 would have laid it out, an entry per stream (:func:`~deltasync.format.layout.unpack`)."""
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
    return unpack(header)


def read_header(data: bytes | memoryview) -> Header:
    """Parse and validate the deltasync metadata of a delta or anchor file.

    Raises:
        `DeltaFormatError`: the file is not a deltasync file of a supported version,
            or its metadata is malformed.
    """
    return header_of(raw_header(data))


def header_of(raw: dict[str, Any]) -> Header:
    """:func:`read_header` for a safetensors header already parsed by :func:`raw_header`."""
    meta = raw.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DeltaFormatError("not a deltasync file: metadata 'format' is not 'deltasync'")
    try:
        return _parse_header(meta, raw)
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:  # int(inf), nested JSON
        if isinstance(exc, DeltaFormatError):
            raise
        raise DeltaFormatError(f"malformed deltasync metadata: {exc!r}") from None


_DECIMAL = re.compile(r"0|[1-9][0-9]*")


def _integer(meta: dict[str, Any], key: str) -> int:
    """A metadata integer: decimal ASCII digits, no sign, space or leading zero ("0", "12"; not "012", "+1", "1_0").

    One spelling per number, so every reader parses the same value.
    """
    text = meta[key]
    if not isinstance(text, str) or not _DECIMAL.fullmatch(text):
        raise DeltaFormatError(f"metadata {key!r} must be a decimal integer string, not {text!r:.40}")
    return int(text)


def _is_int(value: Any) -> bool:
    """A JSON integer (``true`` / ``false`` are not numbers)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_header(meta: dict[str, Any], layout: dict[str, Any]) -> Header:
    format_version = _integer(meta, "format_version")
    if not 1 <= format_version <= FORMAT_VERSION:
        raise DeltaFormatError(
            f"format version {format_version} is not supported (this deltasync reads "
            f"1 to {FORMAT_VERSION}); upgrade deltasync",
            format_version=format_version,
        )
    kind = meta["kind"]
    if kind not in ("delta", "anchor"):
        raise DeltaFormatError(f"unknown kind {kind!r}")
    if kind == "anchor" and format_version > ANCHOR_VERSION:
        raise DeltaFormatError(f"an anchor is written in format {ANCHOR_VERSION} or earlier, not {format_version}")
    version = _integer(meta, "version")
    base = _integer(meta, "base_version") if kind == "delta" else None
    if version < 0 or (base is not None and not 0 <= base < version):
        raise DeltaFormatError(f"bad version {version} / base {base}")
    text = meta["tensors"]
    raw_entries = (  # a packed file's table was parsed as it was inflated (the same strict reader)
        text.table if isinstance(text, InflatedTable)
        else load_json(str(text).encode(), what="metadata 'tensors'", error=DeltaFormatError)
    )
    if not isinstance(raw_entries, dict):
        raise DeltaFormatError("metadata 'tensors' must be a JSON object")
    tensors: dict[str, TensorEntry] = {}
    numel = _integer(meta, "numel")
    total = 0
    for name, raw_entry in raw_entries.items():
        entry, carried = _parse_entry(name, raw_entry)
        tensors[name] = entry
        total += carried
        if kind == "anchor" and (entry.codec != "dense" or entry.nnz != carried):
            raise DeltaFormatError(f"{name}: an anchor carries every element (codec dense, nnz {carried})")
        if kind == "delta" and entry.nnz == 0:
            raise DeltaFormatError(f"{name}: a delta lists only tensors that changed (nnz >= 1)")
    if total > numel:
        raise DeltaFormatError(f"the file carries more elements than the model's numel {numel}")
    return Header(kind, version, base, str(meta["fingerprint"]), numel, tensors, format_version, layout)


@functools.lru_cache(maxsize=1 << 16)
def _spec(name: str, shape: tuple[int, ...], dtype: Any) -> tuple[TensorSpec, int]:
    """The spec of a checked shape (JSON integers, none negative) and its element count, checked once per process
    (as :func:`~deltasync.format.encode.natural_key` keeps names): a replica reads the same few hundred or thousand
    tensors in every version's header, and a spec's checks, construction and count would be paid each time. A
    bad spec raises and is never kept."""
    dtype_from_name(dtype)
    spec = TensorSpec(name, shape, dtype)
    return spec, spec.numel


def _parse_entry(name: str, raw: Any) -> tuple[TensorEntry, int]:
    """A table entry, and the elements of the tensor the file carries (all of it, or its window)."""
    if not isinstance(raw, dict):
        raise DeltaFormatError(f"{name}: tensor entry must be an object")
    shape = raw["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise DeltaFormatError(f"{name}: bad shape {shape!r}")
    spec, numel = _spec(name, tuple(shape), raw["dtype"])
    nnz, params, rows = raw["nnz"], raw.get("params", {}), raw.get("rows")
    if rows is not None:
        if (
            not isinstance(rows, list)
            or len(rows) != 2
            or not all(_is_int(r) for r in rows)
            or not shape
            or not 0 <= rows[0] <= rows[1] <= shape[0]
        ):
            raise DeltaFormatError(f"{name}: bad rows {rows!r} for shape {shape}")
        rows = (rows[0], rows[1])
    elements = raw.get("elements")
    if elements is not None:
        if (
            rows is not None
            or not isinstance(elements, list)
            or len(elements) != 2
            or not all(_is_int(e) for e in elements)
            or not 0 <= elements[0] <= elements[1] <= numel
        ):
            raise DeltaFormatError(f"{name}: bad elements {elements!r} for shape {shape}")
        rows = Elements(elements[0], elements[1])
    carried = numel if rows is None else slice_spec(spec, rows).numel
    if not _is_int(nnz) or not 0 <= nnz <= carried:
        raise DeltaFormatError(f"{name}: nnz {nnz!r} outside [0, {carried}]")
    if not isinstance(params, dict):
        raise DeltaFormatError(f"{name}: params must be an object")
    codec = raw["codec"]
    if type(codec) is not str:  # a name, not something that prints like one
        raise DeltaFormatError(f"{name}: codec must be a string, not {codec!r:.40}")
    digest = digests.read(raw, name, DeltaFormatError)
    if digest is not None and not digests.is_hex(digest[1]):
        raise DeltaFormatError(f"{name}: bad {digest[0]} {digest[1]!r}")
    return TensorEntry(spec, codec, nnz, params, rows, digest), carried


def check_compatible(header: Header, expected_fingerprint: str) -> None:
    """Refuse a file made for another model."""
    if header.fingerprint != expected_fingerprint:
        raise FingerprintMismatch(
            f"file is for model {header.fingerprint}, this receiver holds {expected_fingerprint}: "
            "point the receiver at the right store, or start it from this run's anchor",
            expected=expected_fingerprint,
            found=header.fingerprint,
        )
