"""Reading delta and anchor files: validated patches, written nowhere.

:func:`decode` checks and decodes every tensor of one file; :func:`combine`
joins the files of one version (anchor parts, trainer shards), refusing
overlaps and, for anchors, gaps.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch

from ..codec import BaseLookup, Decoded, get_codec
from ..codec.compact import STREAM_CODECS
from ..codec.device import DeviceReader, Streams, decode_on_device, streams_of
from ..codec.packed import chunks, decode_chunk, work
from ..errors import CodecError, DeltaFormatError, DeltaSyncError, IntegrityError
from ..tensors import TensorSpec
from ..util.collector import collector_paused
from ..util.threads import map_shared, mostly_python
from .header import SAFETENSORS_DTYPES, Header, TensorEntry, entry_digest, header_of, raw_header, tiled_spans
from .layout import packed
from .quantized import check_quantized

__all__ = ["decode", "decode_entries", "file_entries", "combine"]


@collector_paused()  # see there: no collections of a big process's objects amid a decode
def decode(
    data: bytes | memoryview,
    *,
    base: BaseLookup | None = None,
    header: Header | None = None,
    on_device: DeviceReader | None = None,
) -> tuple[Header, dict[str, Decoded]]:
    """Decode every tensor of a delta or anchor, validating all of it, writing nothing.

    Args:
        data (`bytes`): the whole file.
        base (`BaseLookup`, *optional*): reads the receiver's current bit patterns,
            required by base-relative codecs such as ``compact``.
        header (`Header`, *optional*): this file's header, already parsed (:func:`read_header`): neither it
            nor the entries' layout it keeps is parsed again.
        on_device (`DeviceReader`, *optional*): a receiver whose weights are on an accelerator;
            ``compact`` and ``compact-abs`` tensors are then rebuilt there
            (:mod:`deltasync.codec.device`), their patches left on the device.

    Returns:
        `(Header, dict[str, Decoded])`: per tensor, validated indices and new bit patterns.
            For a shard file (entries with ``rows``) indices are flat in the full tensor and
            a whole slice comes back as ``Decoded(None, values, start)``; :func:`combine`
            joins the shards of one version. A header parsed here comes back without its ``layout``.

    Raises:
        `DeltaFormatError` / `CodecError`: anything malformed; `IntegrityError`: a
            base-relative decode did not reproduce the publisher's values.
    """
    # Parsed once for the header and the entries (a packed one is inflated once), or not again at all.
    layout = header.layout if header is not None and header.layout is not None else raw_header(data)
    parsed = header or header_of(layout)
    decoded = decode_entries(parsed, _entries(data, layout, streams=True), base=base, on_device=on_device)
    # A layout parsed here dies with this call, inside the pause: kept by the header, its dozen objects a tensor
    # would be walked by the collection the pause's end starts.
    return header or dataclasses.replace(parsed, layout=None), decoded


def file_entries(data: bytes | bytearray | memoryview, layout: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Every safetensors entry of a file, checked to tile its data area exactly.

    A writable buffer (a store's :meth:`~deltasync.stores.Store.get_buffer` of a
    local file) is viewed, not copied: an anchor's tensors go from the bytes read
    straight into the replica's weights, one copy in all. Read-only bytes are
    copied by safetensors (torch refuses to view them).

    A packed (format 4) delta's entries are its streams, as format 3 lists them. ``layout`` is
    :func:`~deltasync.format.header.raw_header` of ``data``, when the caller already has it.

    Raises:
        `DeltaFormatError`: a malformed header, or entries that overlap, leave gaps or overrun the file.
    """
    return _entries(data, layout, streams=False)  # type: ignore[return-value]


def _entries(
    data: bytes | bytearray | memoryview, layout: dict[str, Any] | None, *, streams: bool
) -> dict[str, torch.Tensor | np.ndarray]:
    """:func:`file_entries`; with ``streams``, a delta's byte streams (1-D ``U8`` entries) as numpy views of the
    file, as the decoders read them: two a tensor, each far cheaper to make than a tensor view."""
    view = memoryview(data).cast("B")
    layout = layout if layout is not None else raw_header(view)
    if view.readonly and packed(layout):
        view = memoryview(bytearray(view))  # a delta: a few MB, viewed entry by entry below
    elif view.readonly:
        for name, info in layout.items():  # safetensors would load dtypes a reader refuses (U16, F8_E4M3, ...)
            dtype = info.get("dtype") if type(info) is dict else None
            if name != "__metadata__" and (type(dtype) is not str or dtype not in SAFETENSORS_DTYPES):
                raise DeltaFormatError(f"entry {name!r}: dtype {dtype!r:.20} is not a name this reader accepts")
        try:
            return safetensors.torch.load(bytes(view))
        except (safetensors.SafetensorError, RuntimeError, ValueError) as exc:
            raise DeltaFormatError(f"corrupt safetensors body: {exc}") from None
    head = 8 + int.from_bytes(view[:8], "little")
    body = len(view) - head
    spans = tiled_spans(layout, body)
    out: dict[str, torch.Tensor | np.ndarray] = {}
    whole = torch.frombuffer(view, dtype=torch.uint8)  # a delta's streams are slices of it (a view each)
    flat = np.frombuffer(view, dtype=np.uint8) if streams else None
    for name, (start, stop) in spans.items():
        info = layout[name]
        if info["dtype"] == "U8" and len(info["shape"]) == 1:  # a slice of one view: cheaper than a frombuffer each
            out[name] = whole[head + start : head + stop] if flat is None else flat[head + start : head + stop]
            continue
        dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], info["shape"]
        if stop == start:
            out[name] = torch.empty(shape, dtype=dtype)
        elif (head + start) % dtype.itemsize:  # another writer's unaligned layout: copied, never viewed misaligned
            out[name] = torch.frombuffer(bytearray(view[head + start : head + stop]), dtype=dtype).reshape(shape)
        else:
            out[name] = torch.frombuffer(view, dtype=dtype, count=(stop - start) // dtype.itemsize,
                                         offset=head + start).reshape(shape)
    return out


@collector_paused()
def decode_entries(
    header: Header,
    entries: Mapping[str, torch.Tensor | np.ndarray],
    *,
    base: BaseLookup | None = None,
    names: Collection[str] | None = None,
    on_device: DeviceReader | None = None,
) -> dict[str, Decoded]:
    """Decode the tensors ``names`` (default: all the header lists) from their safetensors entries.

    ``entries`` must hold exactly the entries of those tensors (``T`` for an anchor,
    ``T::part`` for a delta): the whole file's, or what a range reader fetched. A delta's byte streams may be
    numpy arrays (:func:`decode` views them so).

    Raises:
        `DeltaFormatError` / `CodecError`: anything malformed; `IntegrityError`: a
            base-relative decode did not reproduce the publisher's values.
    """
    wanted = header.tensors if names is None else {name: header.tensors[name] for name in names}
    decoded: dict[str, Decoded] = {}
    if header.kind == "anchor":
        if entries.keys() != wanted.keys():
            raise DeltaFormatError("anchor entries differ from its metadata")
        for name, entry in wanted.items():
            parts = {"val": entries[name]}
            decoded[name] = _place(get_codec("dense").decode(parts, {}, entry.local_spec, entry.nnz, None), entry)
        check_quantized({name: entry.local_spec for name, entry in wanted.items()}, decoded)
        return decoded
    grouped: dict[str, dict[str, torch.Tensor | np.ndarray]] = {name: {} for name in wanted}
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
    for name, entry in wanted.items():  # resolve every codec before decoding any
        try:
            codecs[name] = get_codec(entry.codec)
        except ValueError as exc:
            raise CodecError(
                f"{name}: {exc}: a newer deltasync may have written it; upgrade deltasync here", name=name
            ) from None

    for name in wanted:  # a stream the codec does not read would be data two readers see differently
        streams = codecs[name].streams
        if streams is not None and not grouped[name].keys() <= streams:
            unknown = sorted(grouped[name].keys() - streams)
            raise DeltaFormatError(f"{name}: entries {unknown} are not streams of codec {codecs[name].name!r}")

    def decode_one(name: str) -> Decoded:
        entry = wanted[name]
        lookup = base
        if base is not None and entry.offset:
            lookup = functools.partial(_shifted_lookup, base, entry.offset)
        try:
            patch = codecs[name].decode(grouped[name], entry.params, entry.local_spec, entry.nnz, lookup)
        except IntegrityError as exc:
            _blame(name, entry, grouped[name], exc)
            raise
        return _place(patch, entry)

    def alone(name: str) -> Decoded | DeltaSyncError:
        try:
            return decode_one(name)
        except DeltaSyncError as exc:  # raised below, the first in file order
            return exc

    def streams(name: str, inflate: bool = True) -> Streams:
        entry = wanted[name]
        return streams_of(name, entry.codec, grouped[name], entry.params, entry.local_spec, entry.nnz, entry.offset,
                          inflate)

    def chunk(names: list[str]) -> list[Decoded | DeltaSyncError]:
        """Decompress and decode ``names`` together; tensor by tensor when any check fails (exact errors)."""
        if wanted[names[0]].codec not in STREAM_CODECS:
            return [alone(name) for name in names]
        try:
            patches = decode_chunk([streams(name) for name in names], base)
        except DeltaSyncError:
            patches = None
        if patches is None:
            return [alone(name) for name in names]
        return [_place(patch, wanted[name]) for name, patch in zip(names, patches)]

    def prepared(name: str) -> Streams | Decoded | DeltaSyncError:
        try:
            # Params and parts checked here; the frames are checked and inflated on the device path's
            # threads, straight into its staging buffer.
            return streams(name, inflate=False) if wanted[name].codec in STREAM_CODECS else decode_one(name)
        except DeltaSyncError as exc:
            return exc

    names = list(wanted)  # tensors decode on a few threads; the first failure in file order is raised
    results: dict[str, object]
    if on_device is not None:  # compact tensors checked here, inflated and rebuilt on the device path
        # Checking a compact tensor's params and parts is a little Python, too short for threads, which
        # would only pass the GIL around. Other codecs decode here, on threads.
        light = all(wanted[n].codec in STREAM_CODECS for n in names)
        results = dict(zip(names, map_shared(prepared, names, [wanted[n].nnz for n in names],
                                             workers=1 if light else None)))
        _raise_first(results)  # before anything goes to the device
        on_host = [found for found in results.values() if isinstance(found, Streams)]
        if on_host:
            try:
                results.update(decode_on_device(on_host, on_device))
            except IntegrityError as exc:
                name = getattr(exc, "name", None)
                if name in grouped:
                    _blame(name, wanted[name], grouped[name], exc)
                raise
    else:  # compact tensors a chunk at a time (codec/packed.py), the others one by one
        kinds = [_kind(name, entry) for name, entry in wanted.items()]
        groups = [[names[k] for k in group] for group in chunks([wanted[n].nnz for n in names], kinds)]
        sizes = [[wanted[n].nnz for n in group] for group in groups]
        # Chunks of tensors too small for their compiled work to outweigh their Python: one thread takes them all.
        found = map_shared(chunk, groups, [work(s) for s in sizes],
                           serial=[mostly_python(sum(s), len(s)) for s in sizes])
        decoded = {name: patch for group, patches in zip(groups, found) for name, patch in zip(group, patches)}
        results = {name: decoded[name] for name in names}
    _raise_first(results)
    out = {name: found for name, found in results.items() if isinstance(found, Decoded)}
    check_quantized({name: entry.local_spec for name, entry in wanted.items()}, out)
    return out


def _kind(name: str, entry: TensorEntry) -> object:
    """Which tensors may share a chunk: every ``compact`` and ``compact-abs`` tensor (a tensor of another
    codec is a kind of its own, decoded alone)."""
    return STREAM_CODECS if entry.codec in STREAM_CODECS else name


def _raise_first(results: Mapping[str, object]) -> None:
    """Raise the first failure in file order, if any tensor failed."""
    for found in results.values():
        if isinstance(found, DeltaSyncError):
            raise found


def _blame(
    name: str, entry: TensorEntry, parts: Mapping[str, torch.Tensor | np.ndarray], exc: IntegrityError
) -> None:
    """After a failed integrity check, say which side is at fault where the file can tell.

    The header records a digest of each entry's bytes: if they differ from it the payload was altered
    after it was written; if they match it, the receiver's base is not the delta's.
    """
    if entry.digest is None:
        return  # a file without entry digests: the codec's message stands
    if entry_digest([parts[key] for key in sorted(parts)], entry.digest[0]) != entry.digest:
        raise IntegrityError(
            f"{name}: the delta's bytes for this tensor differ from what its publisher hashed (its header's "
            f"{entry.digest[0]}): the object was altered after it was written. This replica's weights are not at "
            "fault and were not touched; it keeps its version until the publisher writes an intact one",
            name=name,
        ) from exc
    raise IntegrityError(
        f"{name}: the delta's bytes are intact (they match its header's {entry.digest[0]}), but decoding them "
        "against this receiver's weights did not reproduce the publisher's values: this receiver does not hold the "
        "delta's base version (its weights were changed outside deltasync, or it missed a version); resync from "
        "an anchor",
        name=name,
    ) from exc


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
    if len(parts) == 1 and not whole:  # one delta file: no element twice, no gap to refuse; each patch alone
        header, decoded = parts[0]
        return {name: _join([patch], header.tensors[name].spec.numel) for name, patch in decoded.items()}
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
    if len(patches) == 1 and (
        patches[0].indices is not None or (patches[0].start == 0 and len(patches[0].values) == numel)
    ):
        return patches[0]
    device = next((p.values.device for p in patches if isinstance(p.values, torch.Tensor)), None)
    if device is not None:  # some shards were rebuilt on the receiver's device: join them there
        return _join_on(device, patches, numel)
    if all(p.indices is None for p in patches) and sum(p.values.size for p in patches) == numel:
        return Decoded(None, np.concatenate([p.values for p in patches]))
    indices = [
        p.indices if p.indices is not None else np.arange(p.start, p.start + p.values.size, dtype=np.int64)
        for p in patches
    ]
    return Decoded(np.concatenate(indices), np.concatenate([p.values for p in patches]))


def _join_on(device: torch.device, patches: list[Decoded], numel: int) -> Decoded:
    """:func:`_join` for pieces of which some live on ``device``; the result lives there."""

    def there(array: np.ndarray | torch.Tensor) -> torch.Tensor:
        return array if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array)).to(device)

    values = torch.cat([there(p.values) for p in patches])
    if all(p.indices is None for p in patches) and len(values) == numel:
        return Decoded(None, values)
    indices = [
        there(p.indices) if p.indices is not None
        else torch.arange(p.start, p.start + len(p.values), dtype=torch.int64, device=device)
        for p in patches
    ]
    return Decoded(torch.cat(indices), values)
