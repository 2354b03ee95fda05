"""Decoding where the weights live: a version's files, decoded by the worker that holds every element.

A vLLM follower decodes base-relative deltas on its own host: it reads the base
at every changed element from the workers (one RPC of indices, one of bits back)
and then sends them the patches (indices and values, 10 bytes per change). When
one worker holds every element of the checkpoint (an engine of one rank), the
follower can send it the version's files instead, a byte or two per change, and
the worker decodes them against its own weights, read through its index map:
one RPC instead of two, and a small fraction of the bytes.

The worker checks everything before it writes, as the follower would have: the
files decode exactly as declared, every tensor's decoded values match the
publisher's digest (which proves its base), and every patch fits the map
(:func:`~.apply.plan_patches`). A refusal travels back as data
(:func:`refusal_to_json`) and is raised on the follower's side as the same typed
error (:func:`refusal_from_json`); nothing was written.

Where the rank's weights live on an accelerator, ``compact`` tensors are rebuilt
there (:mod:`deltasync.codec.device`), their bases read through the map on the
device (:class:`MapReader`): the host inflates, the device does the rest, and
the host waits once per file instead of once per tensor. The patches stay on the
device for the write. On a CPU the host decode is faster and is the default; a tensor the rank holds whole in
one plain parameter there is read in place by the compiled rebuild (:meth:`~.mapping.IndexMap.flat_bits`),
the others through the map.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ... import errors
from ...codec import Decoded
from ...codec.base import FlatLookup
from ...errors import DeltaSyncError, IntegrityError, TensorMismatch
from ...format import combine, decode, decode_entries, encode_delta
from ...publish.diff import Snapshot, diff
from ...replica.ranged import Fetched
from ...tensors import bits_dtype, bits_view, host_ints, stage
from ...util.collector import collector_paused
from ..apply import SHIFT_TOGETHER, Patch, gather_pieces, merge_bits, plan_patches, read_bits, read_masked
from ..mapping import IndexMap, from_start
from .wire import patch_parts

__all__ = ["MapReader", "accelerator_of", "decode_here", "refusal_to_json", "refusal_from_json", "warm_decoder"]

_MISSING = "changed elements are not held by this rank"


@collector_paused()  # the headers and entries die with this call, inside the pause: no collection walks them
def decode_here(
    index: IndexMap, files: Sequence[bytes | memoryview | Fetched], *, whole: bool, on_device: bool | None = None,
    lookup: Callable[[str, np.ndarray], np.ndarray] | None = None,
) -> list[Patch]:
    """Decode the files of one version against this rank's weights and check the result; nothing is written.

    Args:
        index: this rank's map; it must hold every element the files change.
        files: the version's files (a trainer's shards: several), or the tensors range-read from them
            (:class:`~deltasync.replica.ranged.Fetched`: an expert-parallel rank's share), decoded alone.
        whole: the files are an anchor (every element carried exactly once).
        on_device: rebuild ``compact`` tensors where the weights live (:class:`MapReader`); by default
            when some weight of this rank is on an accelerator. ``True`` on a CPU takes the same path
            (the tests' way to run it without a GPU).
        lookup: the bases to decode against, ``lookup(name, indices)`` (a tensor-parallel rank's, gathered
            from every rank); by default this rank's own weights, which must hold every changed element.

    Returns:
        `list[Patch]`: checked patches (:func:`~.apply.plan_patches`), ready for
        :func:`~.apply.write_patches`; those rebuilt on the device keep their indices and values there.

    Raises:
        `DeltaSyncError`: a file that does not decode exactly, values whose digest differs (this rank does
            not hold the delta's base), or an element this rank does not hold.
    """

    def own(name: str, indices: np.ndarray) -> np.ndarray:
        request = np.ascontiguousarray(indices, dtype=np.int64)
        held = read_bits(index, {name: {"idx": request}})[name]  # checked: a known name, indices in bounds
        return merge_bits(index.specs[name], request.size, [held], missing=_MISSING)

    device = accelerator_of(index)
    if on_device is None:
        on_device = device is not None and lookup is None
    reader = MapReader(index) if on_device else None
    # On the host, a tensor held whole in one plain parameter is read in place by the compiled rebuild.
    base: Callable[[str, np.ndarray], np.ndarray]
    if lookup is not None:
        base = lookup
    else:
        base = own if on_device else FlatLookup(own, index.flat_bits)
    try:  # writable buffers (a private mapping as it is, else a copy): the streams are viewed in place
        parts = [
            (f.header, decode_entries(f.header, f.entries, base=base, names=f.names, on_device=reader))
            if isinstance(f, Fetched) else
            decode(f if isinstance(f, memoryview) and not f.readonly else bytearray(f), base=base, on_device=reader)
            for f in files
        ]
    except IntegrityError:
        if reader is not None:
            reader.check_held()  # a base read where the rank holds nothing says so, not "wrong base"
        raise
    if reader is not None:
        reader.check_held()
    decoded = combine(parts, whole=whole)
    patches = [_patch(index, name, patch) for name, patch in decoded.items()]
    return patches if device is None else _moved(patches, device)


def _moved(patches: list[Patch], device: torch.device) -> list[Patch]:
    """``patches`` with those decoded on the host (other codecs) and sparse moved to ``device`` together
    (:func:`~deltasync.tensors.stage`): their write and read-back then copy nothing per tensor, where a copy
    from the host per tensor would make the host wait for the device each time. Whole tensors (an anchor's)
    go as they are, each in a copy of its own."""
    host = [k for k, patch in enumerate(patches) if patch.indices is not None and patch.indices.device.type == "cpu"]
    if not host:
        return patches
    moved = iter(stage([t for k in host for t in (patches[k].indices, patches[k].values) if t is not None], device))
    out = list(patches)
    for k in host:
        out[k] = dataclasses.replace(patches[k], indices=next(moved), values=next(moved))
    return out


def _patch(index: IndexMap, name: str, patch: Decoded) -> Patch:
    """A checked patch: from the device path as it is (the decoder checked its indices and values there),
    from the host through :func:`~.apply.plan_patches`."""
    if isinstance(patch.values, torch.Tensor):
        spec = index.specs[name]
        indices = None if patch.indices is None else torch.as_tensor(patch.indices)
        return Patch(name, spec, indices, patch.values.view(bits_dtype(spec.torch_dtype)))
    return plan_patches(index, {name: patch_parts(patch)})[0]


class MapReader:
    """A rank's weights read through its index map where they live: the
    :class:`~deltasync.codec.device.DeviceReader` the device decode needs.

    Reads never wait for the device. Where a tensor's targets do not each hold all of it, every read
    also counts, on the device, the requested elements no target holds; :meth:`check_held` reads those
    counts back (one wait) and refuses, as the host path would.
    """

    def __init__(self, index: IndexMap) -> None:
        self._index = index
        self._missing: list[tuple[str, torch.Tensor]] = []

    def device_of(self, name: str) -> torch.device:
        """The device of the first runtime parameter holding tensor ``name``."""
        targets = self._index.targets.get(name)
        if not targets:
            raise TensorMismatch(f"{name}: {_MISSING}", name=name)
        return targets[0].param.device  # the same as its data's, without making a detached tensor to ask

    def _gather(
        self, name: str, index: torch.Tensor, out: torch.Tensor, placed: tuple[torch.nn.Parameter, int] | None
    ) -> None:
        """Bits of tensor ``name`` at checkpoint flat ``index`` (in bounds) into ``out``, on :meth:`device_of`'s
        device; ``placed``: where it lies whole in one parameter (:meth:`_in_place`), read there."""
        if placed is not None and index.device == out.device:  # the rule: one read where it lies, into ``out``
            param, start = placed
            torch.index_select(from_start(bits_view(param.data), start), 0, index, out=out)
            return
        published = self._index.specs[name].torch_dtype
        device = self.device_of(name)
        bits: torch.Tensor | None = None
        held: torch.Tensor | None = None  # None: every element (some target holds all of them)
        for target in self._index.targets[name]:
            owned, got = read_masked(target, index, published)
            got = got.to(device)
            if owned is None:
                bits, held = got, None
                break
            owned = owned.to(device)
            bits = got if bits is None else torch.where(owned, got, bits)
            held = owned if held is None else held | owned
        assert bits is not None
        if held is not None:
            self._missing.append((name, (~held).sum()))
        out.copy_(bits)

    def gather_into(self, requests: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor) -> None:
        """Bits of each ``(name, index)`` request's tensor at its checkpoint flat indices (in bounds), side by
        side in ``out`` in order (the device path's read of a batch's bases).

        Where :data:`~.apply.SHIFT_TOGETHER` or more of the tensors lie whole in one plain parameter (a layer's
        fused experts), theirs are read with one gather for the lot (:func:`~.apply.gather_pieces`: about ten
        ops a parameter instead of one a tensor), landing in their places in ``out`` even where they are not
        side by side there (a checkpoint lists an expert's ``gate_proj`` and ``up_proj``, fused into one
        parameter, then its ``down_proj``, fused into another, expert after expert). The others are read one
        by one, each into its place.
        """
        sizes = [index.numel() for _, index in requests]
        starts = list(itertools.accumulate(sizes, initial=0))
        held = [self._in_place(name, out) for name, _ in requests]
        groups: dict[int, list[int]] = {}
        for k, placed in enumerate(held):
            if placed is not None:
                groups.setdefault(id(placed[0]), []).append(k)
        alone = set(range(len(requests)))
        for members in groups.values():
            if len(members) < SHIFT_TOGETHER:
                continue
            alone.difference_update(members)
            flat = bits_view(held[members[0]][0].data).view(-1)  # type: ignore[index]
            gather_pieces(flat, [(requests[k][1], held[k][1], starts[k]) for k in members], out)  # type: ignore[index]
        places = out.split(sizes) if alone else ()
        for k in sorted(alone):  # where it lies (found above, not again), or through the map
            self._gather(*requests[k], places[k], held[k])

    def _in_place(self, name: str, out: torch.Tensor) -> tuple[torch.nn.Parameter, int] | None:
        """The parameter that alone holds tensor ``name`` whole at one flat range
        (:meth:`~.mapping.IndexMap.in_place`) and where the tensor starts there, where its bits can be read
        straight into ``out`` (the published dtype, on ``out``'s device); else ``None``."""
        placed = self._index.in_place(name)
        if placed is None:
            return None
        param = placed[0].param
        if param.dtype != self._index.specs[name].torch_dtype or param.device != out.device:
            return None
        return param, placed[1]

    def check_held(self) -> None:
        """Refuse if some read asked for an element this rank does not hold.

        Raises:
            `TensorMismatch`: ``"{name}: {n} changed elements are not held by this rank"``, the first such
                read.
        """
        missing, self._missing = self._missing, []
        if not missing:
            return
        counts = host_ints([count for _, count in missing])  # one copy back per device
        for (name, _), count in zip(missing, counts):
            if count:
                raise TensorMismatch(f"{name}: {count} {_MISSING}", name=name)


def accelerator_of(index: IndexMap) -> torch.device | None:
    """The accelerator some of this rank's weights live on (``None``: all of them are on the CPU)."""
    for targets in index.targets.values():
        for target in targets:
            if target.param.device.type != "cpu":
                return target.param.device
    return None


def warm_decoder(device: torch.device | None = None) -> None:
    """Decode a tiny delta once, the way a worker decodes, so that a replica's first real decode does
    not also load the compiled kernels (their first calls load them from disk or compile them); with an accelerator
    ``device``, on the device path there too (its first kernels and pinned buffers)."""
    before = torch.linspace(-1.0, 1.0, 4096).to(torch.bfloat16)
    bits = before.view(torch.int16).clone()
    bits[::97] += 1
    data = encode_delta(diff(Snapshot.capture({"w": before}), {"w": bits.view(torch.bfloat16)}),
                        version=1, base_version=0)
    held = before.view(torch.int16).numpy()
    decode(bytearray(data), base=lambda name, indices: held[indices])
    if device is not None and device.type != "cpu":
        index = IndexMap.whole({"w": torch.nn.Parameter(before.to(device), requires_grad=False)})
        decode_here(index, [data], whole=False, on_device=True)


def refusal_to_json(exc: DeltaSyncError) -> dict[str, Any]:
    """A typed error as JSON-able data (its class name, message, and its plain context values)."""
    plain = (str, int, float, bool, type(None))
    return {
        "type": type(exc).__name__,
        "message": exc.message,
        "context": {k: v for k, v in exc.context.items() if isinstance(v, plain)},
    }


def refusal_from_json(raw: dict[str, Any]) -> DeltaSyncError:
    """The error :func:`refusal_to_json` described, as its own class (a :class:`DeltaSyncError` if unknown)."""
    cls = getattr(errors, str(raw.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, DeltaSyncError)):
        cls = DeltaSyncError
    try:
        return cls(str(raw.get("message")), **dict(raw.get("context") or {}))
    except TypeError:  # a class whose constructor wants other arguments
        return DeltaSyncError(str(raw.get("message")))
