"""Where a file's entries lie in its data area: safetensors' per-entry layout, checked, and format 4's packed form.

A format-3 delta lists every stream as a safetensors entry (``T::idx``,
``T::val``) and its tensor table as a JSON string in the metadata. For a
sparse delta that header is a sizeable share of the file, entry layout and
table alike, both mostly repeated names and keys (docs/FORMAT.md, "Packed
header", gives the sizes). Format 4 keeps the data area byte for byte and folds each
stream's layout into its tensor's table entry (under ``parts``), compresses
the table with zstd and stores it base64-encoded under ``tensors_zstd``; the
safetensors layout keeps one ``U8`` entry, ``streams``, over the whole data
area, so the file is still a valid safetensors file. The header shrinks
several-fold; most of what is left is digests, which do not compress.

:func:`pack` writes that header; :func:`unpack` turns it back into the header
format 3 would have written (its ``format_version`` aside), so every reader
past the header handles both formats alike.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from typing import Any

import torch
import zstandard

from ..errors import DeltaFormatError
from ..util.jsonio import load_json

__all__ = [
    "MAX_HEADER_BYTES", "SAFETENSORS_DTYPES", "PACKED_VERSION", "STREAMS", "TABLE",
    "InflatedTable", "entry_span", "tiled_spans", "pack", "unpack", "packed",
]

# Metadata of a 100k-tensor model is ~20 MB; beyond this a header (or a packed table) is hostile.
MAX_HEADER_BYTES = 64 << 20

# safetensors' element type names, in its writer's layout order (entries of a later type come first).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
}

PACKED_VERSION = 4
"""The first format version whose deltas carry a packed header (anchors keep the plain one)."""
STREAMS = "streams"
"""The one safetensors entry of a packed file: its whole data area, as bytes."""
TABLE = "tensors_zstd"
"""The metadata key of a packed file's tensor table: base64 of one zstd frame of its JSON."""
_LEVEL = 1  # the table's zstd level: higher levels shrink it a little more for far more time


def entry_span(info: object, body: int, entry: str, key: str = "file") -> tuple[int, int]:
    """A safetensors entry's ``[start, stop)`` in the data area of ``body`` bytes, once it fits it, its dtype
    and its shape.

    Raises:
        `DeltaFormatError`: an unknown dtype, a malformed shape or offsets, or a range outside the body
            or of another length than the shape and dtype give.
    """
    try:
        dtype = SAFETENSORS_DTYPES[info["dtype"]]  # type: ignore[index]
        start, stop = info["data_offsets"]  # type: ignore[index]
        shape = info["shape"]  # type: ignore[index]
        # JSON integers (not bools: type, not isinstance), not negative; the shape a list ("{}" or "" would
        # unpack to no dimensions at all). Spelled out for the one dimension of a delta's streams: a
        # generator over them would dominate the layout check of a delta of thousands of tensors.
        ok = type(shape) is list and type(start) is int and type(stop) is int and start >= 0 and stop >= 0 and (
            type(shape[0]) is int and shape[0] >= 0 if len(shape) == 1
            else all(type(v) is int and v >= 0 for v in shape)
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok or not start <= stop <= body or stop - start != math.prod(shape) * dtype.itemsize:
        raise DeltaFormatError(f"{key}: entry {entry!r} has an impossible type, shape or byte range", key=key)
    return start, stop


def tiled_spans(layout: dict[str, Any], body: int, key: str = "file") -> dict[str, tuple[int, int]]:
    """Every safetensors entry's ``[start, stop)`` in a data area of ``body`` bytes, checked to tile it
    exactly: no byte outside an entry, none in two.

    Raises:
        `DeltaFormatError`: an impossible entry (see :func:`entry_span`), a gap, an overlap, or entries that
            end before the data area does.
    """
    spans = {name: entry_span(info, body, name, key) for name, info in layout.items() if name != "__metadata__"}
    at = 0
    for start, stop in sorted(spans.values()):
        if start != at:
            raise DeltaFormatError(f"corrupt safetensors body: entries do not tile the data area (a gap or an "
                                   f"overlap at byte {start})", key=key)
        at = stop
    if at != body:
        raise DeltaFormatError(f"corrupt safetensors body: entries end at byte {at} of {body}", key=key)
    return spans


def pack(metadata: dict[str, str], layout: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The safetensors header of a packed file.

    Args:
        metadata (`dict[str, str]`): the file's metadata with its plain table under ``tensors``.
        layout (`dict[str, dict]`): every entry ``T::part`` as safetensors lays it out (dtype, shape,
            data_offsets), tiling the data area.
    """
    table = json.loads(metadata["tensors"])
    for entry in table.values():
        entry["parts"] = {}
    for key, info in layout.items():
        name, _, part = key.rpartition("::")
        if name not in table:
            raise ValueError(f"entry {key!r} belongs to no tensor of the table: a packed header cannot carry it")
        table[name]["parts"][part] = info
    body = max((info["data_offsets"][1] for info in layout.values()), default=0)
    # The frame's content checksum (4 bytes) lets the format itself catch a damaged table, which could
    # otherwise inflate to another valid table (a tensor renamed with its streams, say).
    frame = zstandard.ZstdCompressor(level=_LEVEL, write_checksum=True).compress(
        json.dumps(table, separators=(",", ":")).encode()
    )
    meta = {k: v for k, v in metadata.items() if k != "tensors"}
    meta[TABLE] = base64.b64encode(frame).decode("ascii")
    return {"__metadata__": meta, STREAMS: {"dtype": "U8", "shape": [body], "data_offsets": [0, body]}}


class InflatedTable(str):
    """A packed file's table as :func:`unpack` inflated it (the text format 3 keeps under ``tensors``), with
    ``table``, what that text parses to: a header reader takes it instead of parsing the text again."""

    table: dict[str, Any]


def unpack(raw: dict[str, Any]) -> dict[str, Any]:
    """The header format 3 would have written for a packed file's safetensors header ``raw`` (its metadata
    with the plain ``tensors`` table and ``format_version`` 4, and an entry per stream); any other header as
    it is.

    The table is the inflated text itself, its entries' ``parts`` left in (a table reader ignores fields it
    does not know): re-encoding it would cost a SmolLM2 delta's reader about as much as parsing it.

    Where the entries lie is checked where they are used (:func:`tiled_spans`); here, that the packed form
    is well made: the one ``streams`` entry, a table within :data:`MAX_HEADER_BYTES` once inflated, and
    every table entry's ``parts``.

    Raises:
        `DeltaFormatError`: a packed header that is not well made.
    """
    if not packed(raw):
        return raw
    meta = raw["__metadata__"]
    if set(raw) != {"__metadata__", STREAMS} or "tensors" in meta or not isinstance(meta.get(TABLE), str):
        raise DeltaFormatError(f"a format-{PACKED_VERSION} header holds one entry, {STREAMS!r}, and its "
                               f"tensor table under {TABLE!r} only")
    streams = raw[STREAMS]
    start, body = entry_span(streams, 1 << 62, STREAMS)
    if start != 0 or streams["dtype"] != "U8" or len(streams["shape"]) != 1:
        raise DeltaFormatError(f"entry {STREAMS!r} of a packed header must be U8 bytes over the whole data area")
    text = _inflate(meta[TABLE])
    table = load_json(text, what="the packed tensor table", error=DeltaFormatError)
    if not isinstance(table, dict):
        raise DeltaFormatError("the packed tensor table must be a JSON object")
    out: dict[str, Any] = {}
    for name, entry in table.items():  # plain loops: a tensor's two streams are cheaper so than by generators
        parts = entry.get("parts") if type(entry) is dict else None
        if type(parts) is not dict:
            raise DeltaFormatError(f"{name}: a packed table entry lists its streams under 'parts'")
        for part, info in parts.items():
            if type(info) is not dict:
                raise DeltaFormatError(f"{name}: a packed table entry lists its streams under 'parts'")
            out[f"{name}::{part}"] = info
    try:  # the entries themselves are checked where they are read (tiled_spans), at no extra pass here
        end = max((info["data_offsets"][1] for info in out.values()), default=0)
    except (KeyError, TypeError, IndexError):
        end = None
    if end != body:  # the streams end where the one entry does, so the file's data area is that entry
        raise DeltaFormatError(f"the packed streams end at byte {end}, entry {STREAMS!r} at {body}")
    plain = {k: v for k, v in meta.items() if k != TABLE}
    plain["tensors"] = inflated = InflatedTable(text.decode())  # its entries' `parts`: fields a reader ignores
    inflated.table = table
    return {"__metadata__": plain, **out}


def packed(header: dict[str, Any]) -> bool:
    """Whether a safetensors header (as read, or as :func:`unpack` returns it) is a packed file's."""
    meta = header.get("__metadata__")
    return isinstance(meta, dict) and meta.get("format_version") == str(PACKED_VERSION)


def _inflate(text: str) -> bytes:
    """The table's JSON bytes: strict base64 of one zstd frame declaring at most :data:`MAX_HEADER_BYTES`,
    its content checksum verified where it has one (libzstd checks it unless told not to)."""
    try:
        frame = base64.b64decode(text, validate=True)
        declared = zstandard.frame_content_size(frame)
    except (binascii.Error, ValueError, zstandard.ZstdError) as exc:
        raise DeltaFormatError(f"the packed tensor table is not base64 of a zstd frame ({exc})") from None
    if not 0 <= declared <= MAX_HEADER_BYTES:  # -1: no size declared
        raise DeltaFormatError(f"the packed tensor table must declare its size, at most {MAX_HEADER_BYTES} "
                               f"bytes (it declares {declared})")
    inflater = zstandard.ZstdDecompressor().decompressobj()
    try:
        out = inflater.decompress(frame)
    except zstandard.ZstdError as exc:
        raise DeltaFormatError(f"the packed tensor table is a corrupt zstd frame ({exc})") from None
    if len(out) != declared or not inflater.eof or inflater.unused_data:  # one whole frame, nothing after it
        raise DeltaFormatError(f"the packed tensor table is not one zstd frame of the {declared} bytes it declares")
    return out
