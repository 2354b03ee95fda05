"""The wire format: one delta or anchor is one valid safetensors file.

A *delta* carries, for each changed tensor ``T``, the entries ``T::idx`` /
``T::val`` (or whatever parts its codec names) and, in the safetensors
``__metadata__``, everything needed to check and decode it: format and version,
model fingerprint, version and base version, and per tensor its codec, shape,
dtype, changed-element count and codec params. Since format 4 a delta packs
that table, with each stream's layout, into one zstd-compressed metadata value
over a single ``streams`` entry (:mod:`.layout`); readers see format 3's
entries either way. An *anchor* is a plain checkpoint in the published dtypes (entries named
after the tensors themselves, loadable by any safetensors reader) with the
same metadata. ``docs/FORMAT.md`` specifies it.

Reading is split in two so a receiver can refuse a file before decoding it:
:func:`read_header` parses and validates the metadata alone, and
:func:`decode` decodes and validates every tensor without writing anything.
"""

from __future__ import annotations

from .decode import combine, decode, decode_entries, file_entries
from .encode import (
    DEFAULT_LEVEL,
    as_numpy_bits,
    encode_anchor,
    encode_anchor_parts,
    encode_delta,
    serialize,
    serialize_parts,
)
from .header import (
    ANCHOR_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    Elements,
    Header,
    Kind,
    Rows,
    TensorEntry,
    Window,
    check_compatible,
    entry_groups,
    entry_span,
    header_of,
    header_ref,
    raw_header,
    read_header,
    slice_spec,
)
from .layout import PACKED_VERSION

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ANCHOR_VERSION",
    "MAX_HEADER_BYTES",
    "PACKED_VERSION",
    "SAFETENSORS_DTYPES",
    "DEFAULT_LEVEL",
    "Kind",
    "Rows",
    "Elements",
    "Window",
    "TensorEntry",
    "Header",
    "slice_spec",
    "encode_delta",
    "encode_anchor",
    "encode_anchor_parts",
    "serialize",
    "serialize_parts",
    "as_numpy_bits",
    "header_ref",
    "entry_groups",
    "entry_span",
    "header_of",
    "raw_header",
    "read_header",
    "check_compatible",
    "decode",
    "decode_entries",
    "file_entries",
    "combine",
]
