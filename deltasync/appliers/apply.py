"""Apply layer: check everything, then write, so a refused delta never leaves a half-patched model.

Two phases, for every applier:

1. *Check* (no writes): the file fits the holder (:func:`check_header`:
   fingerprint, names, shapes, dtypes), and, for an engine reached through an
   :class:`~.mapping.IndexMap`, every entry of the payload (:func:`plan_patches`:
   known name, 1-D int64 indices in range, values of the published bit width,
   as many values as indices).
2. *Write* (:func:`write_patches`): each checked patch goes to every target
   that holds part of its tensor, through the target's layout; the parameters
   touched are returned so a transport can refresh copies it keeps elsewhere
   (re-packed CPU kernels).

A transport runs the phases in that order (the vLLM worker then reads the
patches back: :mod:`.verify`); :func:`read_bits` is the read side (current bit
patterns, for the base values deltas decode against).
The torch module and checkpoint directory appliers use :func:`check_header`
and write through their own storage.

Limitations:

- Checks cover what a payload can get wrong; a write that fails after the
  checks (device out of memory, a layout's own error) can leave earlier
  entries written. The next anchor rewrites every element.
- Version order is the caller's: :class:`~deltasync.replica.subscriber.Subscriber`
  plans the route, and the checkpoint applier refuses a delta onto a torn
  directory before its first write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import TensorMismatch
from ..format import Header, check_compatible
from ..tensors import NUMPY_BITS_BY_SIZE, TensorSpec, host_ints, positions, segment_owners, stage
from ..util.collector import collector_paused
from .mapping import PLAIN, IndexMap, Target, from_start

__all__ = [
    "check_header",
    "Patch",
    "plan_patches",
    "write_patches",
    "read_bits",
    "merge_bits",
    "read_through",
    "read_masked",
    "shifted",
    "gather_pieces",
    "SHIFT_TOGETHER",
    "checked_indices",
    "bits_numpy_dtype",
]

Payload = Mapping[str, Mapping[str, np.ndarray]]
"""``{tensor: {part: array}}`` as :mod:`.wire` unpacks it (parts ``"idx"``, ``"val"``)."""


def check_header(
    header: Header, specs: Mapping[str, TensorSpec], fingerprint: str, *, holder: str = "receiver"
) -> None:
    """Refuse a file made for another model, or carrying tensors this holder lacks or lays out otherwise.

    Raises:
        `FingerprintMismatch`: made for another model.
        `TensorMismatch`: a carried tensor is unknown here or has another shape or dtype.
    """
    check_compatible(header, fingerprint)
    for name, entry in header.tensors.items():
        spec = specs.get(name)
        if spec is None:
            raise TensorMismatch(f"unknown tensor {name!r} in file; the {holder} does not hold it", name=name)
        if spec != entry.spec:
            raise TensorMismatch(
                f"{name}: file has {entry.spec.dtype}{list(entry.spec.shape)}, "
                f"{holder} has {spec.dtype}{list(spec.shape)}",
                name=name,
            )


@dataclass(frozen=True, slots=True)
class Patch:
    """One checked entry of a payload, ready to write."""

    name: str
    """Checkpoint tensor name."""
    spec: TensorSpec
    """Its spec (published dtype)."""
    indices: torch.Tensor | None
    """Checkpoint flat indices (int64, in range); ``None``: every element in order."""
    values: torch.Tensor
    """Bit patterns of the published dtype (int16 / int32), one per index."""


def bits_numpy_dtype(spec: TensorSpec) -> np.dtype:
    """The integer dtype that carries the bit patterns of ``spec``'s published dtype."""
    return NUMPY_BITS_BY_SIZE[spec.torch_dtype.itemsize]


def checked_indices(raw: np.ndarray | None, spec: TensorSpec) -> torch.Tensor:
    """``raw`` as a tensor, once it is 1-D int64 with every index in ``[0, numel)``.

    Raises:
        `TensorMismatch`: wrong dtype or rank, or an index out of range.
    """
    if raw is None or raw.dtype != np.int64 or raw.ndim != 1:
        raise TensorMismatch(f"{spec.name}: indices must be 1-D int64", name=spec.name)
    idx = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= spec.numel):
        raise TensorMismatch(f"{spec.name}: index out of range [0, {spec.numel})", name=spec.name)
    return idx


def plan_patches(index: IndexMap, payload: Payload) -> list[Patch]:
    """Phase 1: check every entry of ``payload`` (``{name: {"idx": int64, "val": bits}}``) without writing.

    Raises:
        `TensorMismatch`: an unknown name, bad indices, or values of the wrong dtype, rank or count.
    """
    return [_checked_patch(index, name, parts) for name, parts in payload.items()]


def _checked_patch(index: IndexMap, name: str, parts: Mapping[str, np.ndarray]) -> Patch:
    spec = index.specs.get(name)
    if spec is None:
        raise TensorMismatch(f"unknown tensor {name!r}; this engine does not hold it", name=name)
    values = parts.get("val")
    if values is None or values.dtype != bits_numpy_dtype(spec) or values.ndim != 1:
        raise TensorMismatch(f"{name}: values must be 1-D {bits_numpy_dtype(spec)}", name=name)
    if not values.flags.writeable:
        values = values.copy()
    if "idx" in parts:
        idx = checked_indices(parts["idx"], spec)
    elif values.size == spec.numel:
        idx = None
    else:
        raise TensorMismatch(f"{name}: {values.size} values for {spec.numel} elements", name=name)
    if idx is not None and idx.numel() != values.size:
        raise TensorMismatch(f"{name}: {idx.numel()} indices but {values.size} values", name=name)
    return Patch(name, spec, idx, torch.from_numpy(values))


@collector_paused()  # a few dozen small objects a tensor: no collector walks amid them (see there)
def write_patches(index: IndexMap, patches: Sequence[Patch]) -> tuple[int, list[torch.nn.Parameter]]:
    """Phase 2: write checked ``patches`` wherever this rank holds them.

    A sparse patch's share of a target that holds part of its tensor (a tensor-parallel shard) is counted
    on the device for every such target first, and the counts read back together (one host wait per
    device, not one per tensor); the sparse writes into one plain parameter (a fused parameter's tensors:
    a layer's experts) go in one scatter, each tensor's indices shifted to its place there by a few ops for
    the lot (not one per tensor); whole tensors (an anchor's) are written one by one.

    Returns:
        `tuple[int, list[torch.nn.Parameter]]`: elements written, and every parameter reached.
    """
    written = 0
    touched: dict[int, torch.nn.Parameter] = {}
    located: list[tuple[Target, TensorSpec, torch.Tensor | None, torch.Tensor, torch.Tensor, int]] = []
    for patch in patches:
        for target in index.targets[patch.name]:
            touched[id(target.param)] = target.param
            if patch.indices is None:
                written += _write_whole(target, patch.spec, patch.values)
                continue
            idx = patch.indices.to(target.param.data.device)
            start = target.whole_start() if target.layout is PLAIN else None
            if start is not None:  # the whole tensor at one flat range: its indices shifted where it is written
                located.append((target, patch.spec, None, idx, patch.values, start))
                continue
            owned, runtime = target.locate(idx)
            located.append((target, patch.spec, owned, runtime, patch.values, 0))
    counts = host_ints([0 if owned is None else owned.sum() for _, _, owned, _, _, _ in located])
    # Writes into one plain parameter (a fused parameter's tensors: a layer's experts, q/k/v) go together.
    writes: dict[tuple[int, torch.dtype], list[tuple[Target, torch.Tensor, torch.Tensor, int]]] = {}
    for (target, spec, owned, runtime, values, shift), count in zip(located, counts):
        data = target.param.data
        values = values.to(data.device)
        if owned is not None:  # this target's share: the positions it holds, their number known
            if not count:
                continue
            at = positions(owned, count)
            runtime, values = runtime[at], values[at]
        written += int(runtime.numel())
        if target.layout is not PLAIN or target.flat is None:
            target.layout.write(data, runtime, values, spec.torch_dtype)
            continue
        writes.setdefault((id(target.param), spec.torch_dtype), []).append((target, runtime, values, shift))
    for (_, published), group in writes.items():
        if len(group) > 1 and _disjoint([item[0] for item in group]):
            runtime = shifted([(item[1], item[3]) for item in group])
            group = [(group[0][0], runtime, torch.cat([item[2] for item in group]), 0)]
        for target, runtime, values, shift in group:  # else one by one, in order, as the map lists them
            data = target.param.data
            if shift:  # from where the tensor starts: its own indices address it
                data = from_start(data, shift)
            target.layout.write(data, runtime, values, published)
    return written, list(touched.values())


SHIFT_TOGETHER = 8
"""From this many pieces on, a joined write adds each piece's shift by one lookup for all of them (about ten
ops) instead of one add a piece: a layer's experts, not its q/k/v."""


def shifted(pieces: Sequence[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The runtime indices of several tensors' reads or writes in one parameter, joined: each piece's indices
    plus its shift; from :data:`SHIFT_TOGETHER` pieces on, added for all at once (each element's shift looked up by
    its piece)."""
    if len(pieces) < SHIFT_TOGETHER:
        return torch.cat([indices + shift if shift else indices for indices, shift in pieces])
    joined = torch.cat([indices for indices, _ in pieces])
    (shifts,) = _by_piece([(len(i), shift) for i, shift in pieces], joined.numel(), joined.device)
    return joined.add_(shifts)


def gather_pieces(flat: torch.Tensor, pieces: Sequence[tuple[torch.Tensor, int, int]], out: torch.Tensor) -> None:
    """Several tensors' reads of one parameter in one gather: for each piece ``(indices, shift, place)``,
    ``flat[indices + shift]`` lands in ``out`` from ``place`` on. Each element's shift and place are looked up
    by its piece (about ten ops for all the pieces); pieces whose places follow each other in order are read
    straight into ``out``."""
    joined = torch.cat([indices for indices, _, _ in pieces])
    rows, at = [], pieces[0][2]
    for indices, shift, place in pieces:
        rows.append((len(indices), shift, place - at))  # where it lands, against where it would in a row
        at += len(indices)
    in_a_row = not any(move for _, _, move in rows)
    first, total = pieces[0][2], joined.numel()
    if in_a_row:
        (shifts,) = _by_piece([row[:2] for row in rows], total, joined.device)
        torch.index_select(flat, 0, joined.add_(shifts), out=out[first : first + total])
        return
    shifts, moves = _by_piece(rows, total, joined.device)
    places = torch.arange(first, first + total, device=out.device).add_(moves)
    out.index_copy_(0, places, flat.index_select(0, joined.add_(shifts)))


def _by_piece(rows: Sequence[tuple[int, ...]], total: int, device: torch.device) -> list[torch.Tensor]:
    """For pieces laid end to end (``rows``: one a piece, its size then its values), each value column spread
    over the pieces' ``total`` elements (each element gets its piece's value): one staged copy of the small
    table and one lookup a column, however many pieces."""
    sizes, *columns = stage([torch.tensor(rows, dtype=torch.int64)], device)[0].unbind(1)
    owner = segment_owners(sizes, total)
    return [column[owner] for column in columns]


def _disjoint(targets: Sequence[Target]) -> bool:
    """Whether flat targets reach disjoint runtime ranges of their parameter (one scatter may then write them
    all; tensors tied to one place, were a map to hold any, are written one after another instead)."""
    spans = sorted((a + shift, b + shift) for a, b, shift in (t.flat for t in targets if t.flat is not None))
    return all(start >= end for (_, end), (start, _) in zip(spans, spans[1:]))


def _write_whole(target: Target, spec: TensorSpec, values: torch.Tensor) -> int:
    """Every element of a tensor (``values``, in checkpoint order) that ``target`` holds."""
    data = target.param.data
    region = plain_region(target, values)
    if region is not None:  # a whole tensor into a plain parameter: one strided copy
        held, new = region
        if data.dtype == spec.torch_dtype:
            held.view(new.dtype).copy_(new)
        else:
            held.copy_(new.view(spec.torch_dtype))  # an exact up-cast, as the layout writes
        return held.numel()
    pos, runtime = target.translate(torch.arange(spec.numel, dtype=torch.int64, device=data.device))
    if pos is not None and not pos.numel():
        return 0
    vals = values.to(data.device)
    if pos is not None:
        vals = vals[pos]
    target.layout.write(data, runtime, vals, spec.torch_dtype)
    return int(runtime.numel())


def plain_region(target: Target, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A whole tensor's ``values`` and the elements of them a plain parameter holds, as two views of one shape
    (:meth:`Target.region`), or ``None`` where they go by index (tables, packed and other layouts). One answer
    for the write and its read-back, so both take the same path."""
    if target.layout is not PLAIN:
        return None
    data = target.param.data
    return target.region(data, values.to(data.device))


def read_bits(index: IndexMap, payload: Payload) -> dict[str, dict[str, np.ndarray]]:
    """Current bits at the requested checkpoint indices this rank holds (reads only).

    Args:
        payload (`Mapping`): ``{name: {"idx": int64 checkpoint indices}}``.

    Returns:
        `dict`: ``{name: {"pos": int64 positions into idx, "bits": int16/int32}}``; an element
        held twice on this rank is read once.

    Raises:
        `TensorMismatch`: an unknown name or bad indices.
    """
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, parts in payload.items():
        targets = index.targets.get(name)
        if targets is None:
            raise TensorMismatch(f"unknown tensor {name!r}", name=name)
        spec = index.specs[name]
        out[name] = _read(targets, spec, checked_indices(parts.get("idx"), spec))
    return out


def merge_bits(
    spec: TensorSpec, count: int, answers: Iterable[Mapping[str, np.ndarray] | None], *, missing: str
) -> np.ndarray:
    """The bits at ``count`` requested indices of ``spec``, put together from :func:`read_bits` answers
    (``pos`` into the request, ``bits``: one per rank, or ``None`` where a rank holds none of it).

    Raises:
        `TensorMismatch`: some requested element is in no answer (``"{name}: {n} {missing}"``).
    """
    bits = np.zeros(count, dtype=bits_numpy_dtype(spec))
    covered = np.zeros(count, dtype=bool)
    for got in answers:
        if got is not None and got["pos"].size:
            bits[got["pos"]] = got["bits"]
            covered[got["pos"]] = True
    if not covered.all():
        raise TensorMismatch(f"{spec.name}: {int((~covered).sum())} {missing}", name=spec.name)
    return bits


def read_through(target: Target, idx: torch.Tensor, published: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``target``'s share of checkpoint flat indices ``idx``, read through its layout.

    Returns:
        `tuple`: positions into ``idx`` (``None``: all of them) and their bit patterns, on the CPU.
    """
    data = target.param.data
    pos, runtime = target.translate(idx.to(data.device))
    bits = target.layout.read(data, runtime, published).cpu()
    return (None if pos is None else pos.cpu()), bits


def read_masked(target: Target, idx: torch.Tensor, published: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Bits read through ``target``'s layout at every one of checkpoint flat indices ``idx``, on its device,
    and which of them it holds (a mask; ``None``: all of them): no host wait (:meth:`~.mapping.Target.locate`).
    """
    data = target.param.data
    start = target.whole_start() if target.layout is PLAIN else None
    if start is not None:  # the whole tensor at one flat range: read where it lies, no index shifted first
        return None, PLAIN.read(from_start(data, start), idx.to(data.device), published)
    owned, runtime = target.locate(idx.to(data.device))
    return owned, target.layout.read(data, runtime, published)


def _read(targets: list[Target], spec: TensorSpec, idx: torch.Tensor) -> dict[str, np.ndarray]:
    pos_all, bits_all = [], []
    covered = torch.zeros(idx.numel(), dtype=torch.bool) if len(targets) > 1 else None
    for target in targets:
        pos, bits = read_through(target, idx, spec.torch_dtype)
        pos_cpu = torch.arange(idx.numel()) if pos is None else pos
        if covered is not None:  # an element replicated in two places is read once
            fresh = ~covered[pos_cpu]
            pos_cpu, bits = pos_cpu[fresh], bits[fresh]
            covered[pos_cpu] = True
        pos_all.append(pos_cpu)
        bits_all.append(bits)
    return {
        "pos": torch.cat(pos_all).numpy() if pos_all else np.zeros(0, np.int64),
        "bits": torch.cat(bits_all).numpy() if bits_all else np.zeros(0, bits_numpy_dtype(spec)),
    }
