"""Proof layer: check a rank's index map against what the engine really holds, before trusting it.

An index map is probed through the engine's weight loaders, but a kernel may
move the weights after loading (prepacking, padding, quantization) into a
layout the probe never saw. Writing through such a map succeeds and corrupts
the replica silently. Two checks close that gap:

- :func:`prove_map` (once, before the first write): every element this rank
  holds is read back *in checkpoint coordinates* through the map and its
  layouts, from the weights the engine itself loaded from its checkpoint, and
  compared bit for bit with that checkpoint. The engine's loader and
  post-processing wrote those weights, not deltasync, so a map or layout that
  disagrees with the engine's real runtime layout reads back different values.
  Any target that does not prove is reported by runtime parameter and layout.
- :func:`check_written` (after every apply): the patches just written are read
  back through the map, all of them for whole tensors (anchors) and ``samples``
  random positions per tensor for sparse deltas, and compared with what was
  sent. It catches writes that did not land (a stale packed copy, a view that
  was not the storage); it counts mismatches where the weights live and copies
  the counts back once per device, and its cost is reported in the apply stats.

Limitations:

- A tensor whose loaded values are all equal (fresh norm weights) cannot reveal
  a permutation; such tensors are listed as ``constant`` and proven only in the
  sense that they read back right. Real checkpoints have few of them, all 1-D.
- :func:`check_written` reads through the same map it wrote with: it proves the
  write path, not the map (that is :func:`prove_map`'s job).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import LayoutMismatch, TensorMismatch
from ..tensors import TensorSpec, bits_view, host_ints, segment_sums, stage
from ..util.collector import collector_paused
from .apply import SHIFT_TOGETHER, Patch, plain_region, read_masked, read_through, shifted
from .mapping import PLAIN, IndexMap, Target
from .vllm.wire import pack, unpack

__all__ = [
    "Proof", "prove_map", "compare_held", "pack_held", "merge_compared", "check_written", "check_proofs", "PROOF_CHUNK",
    "VERIFY_SAMPLES", "same_bits",
]

logger = logging.getLogger("deltasync.vllm")

PROOF_CHUNK = 1 << 22  # elements read back per step (bounds the int64 index scratch to 32 MiB)
VERIFY_SAMPLES = 256  # positions read back per touched tensor after a sparse apply, by default


@dataclass
class Proof:
    """What :func:`prove_map` found on one rank (JSON-able through :meth:`as_dict`)."""

    tensors: int = 0
    """Checkpoint tensors with at least one element on this rank, all read back."""
    elements: int = 0
    """Elements read back (a replicated element counts once per copy)."""
    constant: list[str] = field(default_factory=list)
    """Tensors whose loaded values are all equal: read back right, but a permutation would not show."""
    failed: dict[str, str] = field(default_factory=dict)
    """Runtime parameter -> why it did not prove."""

    def as_dict(self) -> dict[str, object]:
        return {"tensors": self.tensors, "elements": self.elements, "constant": self.constant, "failed": self.failed}


def prove_map(index: IndexMap, loaded: Callable[[str], torch.Tensor | None]) -> Proof:
    """Read every element this rank holds back through ``index`` and compare with the engine's checkpoint.

    Args:
        index (`IndexMap`): the rank's map, before anything was written through it.
        loaded (`Callable`): checkpoint tensor name -> the tensor the engine loaded it from
            (any float dtype; cast to the published dtype as the engine's loader does), or
            ``None`` when the checkpoint lacks it (reported as a failure of its parameters).
    """
    proof = Proof()
    for name, targets in index.targets.items():
        if not targets:
            continue
        spec = index.specs[name]
        source = loaded(name)
        if source is None:
            for target in targets:
                proof.failed.setdefault(target.param_name, f"{name} is not in the engine's checkpoint")
            continue
        expected = _published_bits(name, source, spec)
        proof.tensors += 1
        for target in targets:
            wrong = _count_wrong(target, expected, spec.torch_dtype)
            proof.elements += target.count
            if wrong:
                proof.failed.setdefault(
                    target.param_name,
                    f"{wrong} of {target.count} elements of {name} read back through layout "
                    f"{target.layout.name!r} differ from what the engine loaded: the engine keeps this "
                    "parameter in a layout the map does not describe (a kernel's packing, padding or "
                    "quantization)",
                )
        if expected.numel() and bool((expected == expected[0]).all()):
            proof.constant.append(name)
    return proof


def compare_held(
    index: IndexMap, loaded: Callable[[str], torch.Tensor | None]
) -> tuple[dict[str, dict[str, int]], dict[str, np.ndarray]]:
    """How the elements this rank holds compare with the tensors ``loaded`` gives, at any time (after writes too).

    Every element of every target is read back through ``index`` and its layout and compared bit for
    bit with the loaded tensor, cast to the published dtype (a replica's weights against a trainer's
    saved ones: are they the same?).

    Returns:
        `tuple`: per checkpoint tensor with elements on this rank that ``loaded`` has (``None``: left
        out), ``{"read": elements read back, "wrong": how many of them differ}`` (an element this rank
        holds twice counts twice), and which of its flat elements were read (``np.packbits`` of a mask),
        for :func:`merge_compared` to find those no rank holds.

    Raises:
        `TensorMismatch`: a loaded tensor with another number of elements than the checkpoint's.
    """
    counts: dict[str, dict[str, int]] = {}
    masks: dict[str, np.ndarray] = {}
    for name, targets in index.targets.items():
        source = loaded(name) if targets else None
        if source is None:
            continue
        spec = index.specs[name]
        expected = _published_bits(name, source, spec)
        held = torch.zeros(spec.numel, dtype=torch.bool)
        counts[name] = {
            "read": sum(t.count for t in targets),
            "wrong": sum(_count_wrong(t, expected, spec.torch_dtype, held) for t in targets),
        }
        masks[name] = np.packbits(held.numpy())
    return counts, masks


def pack_held(masks: Mapping[str, np.ndarray], *, text: bool) -> bytes | str:
    """Rank side: :func:`compare_held`'s masks as one :func:`~.wire.pack` blob, as :func:`merge_compared` reads them."""
    return pack({name: {"mask": mask} for name, mask in masks.items()}, text=text)


def merge_compared(
    specs: Mapping[str, TensorSpec], answers: Iterable[tuple[Mapping[str, Any], Any]]
) -> dict[str, dict[str, int]]:
    """Follower side: the ranks' :func:`compare_held` answers (counts, and their masks as
    :func:`pack_held` sent them) as one per tensor: ``{"read", "wrong", "missing"}``, where
    ``missing`` counts the elements no rank holds."""
    out: dict[str, dict[str, int]] = {}
    union: dict[str, np.ndarray] = {}
    for counts, packed in answers:
        masks = unpack(packed)
        for name, found in counts.items():
            total = out.setdefault(name, {"read": 0, "wrong": 0})
            total["read"] += int(found["read"])
            total["wrong"] += int(found["wrong"])
            mask = masks[name]["mask"]
            union[name] = union[name] | mask if name in union else mask
    for name, total in out.items():
        total["missing"] = specs[name].numel - int(np.unpackbits(union[name]).sum())
    return out


def _published_bits(name: str, source: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Flat bit patterns of ``source`` in the published dtype of checkpoint tensor ``spec``."""
    if source.numel() != spec.numel:
        raise TensorMismatch(f"{name}: {source.numel()} elements given, the checkpoint's tensor has {spec.numel}",
                             name=name)
    return bits_view(source.to(spec.torch_dtype).reshape(-1).contiguous())


def _count_wrong(
    target: Target, expected: torch.Tensor, published: torch.dtype, held: torch.Tensor | None = None
) -> int:
    """Elements of ``target`` whose bits read through its layout differ from ``expected`` (flat bits);
    the elements read are marked in ``held`` (a flat mask) when given."""
    wrong = 0
    for start in range(0, expected.numel(), PROOF_CHUNK):
        idx = torch.arange(start, min(start + PROOF_CHUNK, expected.numel()), dtype=torch.int64)
        pos, got = read_through(target, idx, published)
        read = idx if pos is None else idx[pos]
        wrong += int((got != expected[read]).sum())
        if held is not None:
            held[read] = True
    return wrong


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one shape, an integer dtype: bit patterns) are equal, compared eight bytes at a
    time where both are contiguous, which on a CPU beats a compare by 2-byte elements."""
    if a.is_contiguous() and b.is_contiguous() and (a.numel() * a.element_size()) % 8 == 0:
        try:
            return torch.equal(a.reshape(-1).view(torch.int64), b.reshape(-1).view(torch.int64))
        except RuntimeError:  # a storage offset that is not a multiple of eight bytes
            pass
    return torch.equal(a, b)


@collector_paused()  # a few dozen small objects a tensor: no collector walks amid them (see there)
def check_written(
    index: IndexMap, patches: Sequence[Patch], *, samples: int = VERIFY_SAMPLES, seed: int = 0
) -> tuple[int, list[dict[str, object]]]:
    """Read ``patches`` back through ``index`` after a write: whole tensors fully, sparse ones sampled.

    Args:
        samples (`int`): positions per sparse patch (0: skip sparse patches).
        seed (`int`): seeds a private generator (the engine's own RNG is never touched).

    Returns:
        `tuple[int, list[dict]]`: elements read back, and per (tensor, runtime parameter) that reads
        back wrong: ``{"tensor", "param", "wrong", "read"}`` (JSON-able, for the RPC answer).
    """
    sampled = [p for p in patches if p.indices is not None and 0 < samples < p.indices.numel()]
    picks = _Picks.draw(sampled, samples, torch.Generator().manual_seed(seed))
    # Counted where the weights live and copied back once per device: no host wait per tensor.
    rows: list[tuple[str, str, torch.Tensor | int, torch.Tensor | int]] = []  # tensor, param, wrong, read
    # Reads compared all at once per device and width: (their rows, bits read, bits written, elements per row).
    compared: dict[tuple[torch.device, torch.dtype], list[tuple[list[int], torch.Tensor, torch.Tensor, list[int]]]]
    compared = {}
    joined, fused = _fused_reads(index, patches, samples, picks)
    for members, got, values, sizes in joined:  # a parameter's tensors, read together
        first = len(rows)
        rows.extend((patch.name, index.targets[patch.name][0].param_name, 0, n) for patch, n in zip(members, sizes))
        compared.setdefault((got.device, got.dtype), []).append((list(range(first, len(rows))), got, values, sizes))
    taken = _taken_together([p for p in sampled if id(p) not in fused], samples, picks)
    for patch in patches:
        idx: torch.Tensor | None
        if id(patch) in fused:  # read with the other tensors of its parameter, above
            continue
        if patch.indices is None:
            idx, values = None, patch.values  # every element: made only for a target read by index
        elif samples <= 0 or not patch.indices.numel():
            continue
        else:
            idx, values = taken[id(patch)] if id(patch) in taken else _sample(patch, samples, picks)
        for target in index.targets[patch.name]:
            region = plain_region(target, values) if patch.indices is None else None
            if region is not None:  # a whole tensor in a plain parameter: one strided compare
                held, written = region
                got = (held if held.dtype == patch.spec.torch_dtype else held.to(patch.spec.torch_dtype))
                got = got.view(written.dtype)
                # On the host, an equal tensor (the rule) is answered without a mask, which is faster.
                # On an accelerator that answer would wait for the device once per tensor.
                if got.device.type == "cpu" and same_bits(got, written):
                    rows.append((patch.name, target.param_name, 0, written.numel()))
                else:
                    differs = got != written
                    rows.append((patch.name, target.param_name, differs.sum(), differs.numel()))
                continue
            if idx is None:
                idx = torch.arange(patch.spec.numel, dtype=torch.int64, device=patch.values.device)
            owned, got = read_masked(target, idx, patch.spec.torch_dtype)
            values = values.to(got.device)
            if owned is None:  # compared below with every other such read of its device and width, at once
                compared.setdefault((got.device, got.dtype), []).append(([len(rows)], got, values, [got.numel()]))
                rows.append((patch.name, target.param_name, 0, got.numel()))
            else:
                owned = owned.to(got.device)
                rows.append((patch.name, target.param_name, ((got != values) & owned).sum(), owned.sum()))
    sums: list[tuple[list[int], torch.Tensor]] = []  # per device and width: its rows, and their mismatches
    for (device, _), reads in compared.items():  # one compare and one sum per device and width
        lengths = stage([torch.tensor([n for _, _, _, sizes in reads for n in sizes])], device)[0]
        differs = torch.cat([got for _, got, _, _ in reads]) != torch.cat([values for _, _, values, _ in reads])
        sums.append(([row for members, _, _, _ in reads for row in members], segment_sums(differs, lengths)))
    counts = host_ints([count for _, _, bad, read in rows for count in (bad, read)], [bad for _, bad in sums])
    at = 2 * len(rows)  # the sums' counts follow the rows' own
    for members, _ in sums:
        for row, n in zip(members, counts[at : at + len(members)]):
            counts[2 * row] = n
        at += len(members)
    del counts[2 * len(rows) :]
    wrong: list[dict[str, object]] = []
    checked = 0
    for (name, param, _, _), bad, read in zip(rows, counts[::2], counts[1::2]):
        checked += read
        if bad:
            wrong.append({"tensor": name, "param": param, "wrong": bad, "read": read})
    return checked, wrong


@dataclass(frozen=True, slots=True)
class _Picks:
    """Random positions among the changes of the sparse patches a read-back samples: per device, one table of
    a row per patch, drawn together on the host and copied once per device (a small copy from pageable memory
    per tensor would make a GPU's host wait for everything queued before it, once per tensor)."""

    tables: dict[torch.device, torch.Tensor]
    """Per device, ``(patches, samples)`` int64 positions (row ``r``'s within that patch's changes)."""
    rows: dict[int, int]
    """``id(patch)`` -> its row in its device's table."""

    @classmethod
    def draw(cls, patches: Sequence[Patch], samples: int, generator: torch.Generator) -> _Picks:
        """``samples`` positions among each of ``patches``' changes (each has more than ``samples``)."""
        if not patches:
            return cls({}, {})
        draw = torch.rand((len(patches), samples), generator=generator, dtype=torch.float64)  # in [0, 1)
        sizes = torch.tensor([p.indices.numel() for p in patches if p.indices is not None], dtype=torch.float64)
        positions = draw.mul_(sizes[:, None]).long()  # in [0, changes)
        by_device: dict[torch.device, list[int]] = {}
        for k, patch in enumerate(patches):
            assert patch.indices is not None
            by_device.setdefault(patch.indices.device, []).append(k)
        tables, rows = {}, {}
        for device, members in by_device.items():
            tables[device] = stage([positions[members] if len(members) < len(patches) else positions], device)[0]
            rows.update((id(patches[k]), row) for row, k in enumerate(members))
        return cls(tables, rows)

    def of(self, patch: Patch) -> torch.Tensor:
        """``patch``'s positions (int64, on its device)."""
        assert patch.indices is not None
        return self.tables[patch.indices.device][self.rows[id(patch)]]


def _sample(patch: Patch, samples: int, picks: _Picks) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and bits of a sparse patch to read back: its drawn ``picks``, or all of them for a patch of
    at most ``samples`` changes."""
    assert patch.indices is not None
    if patch.indices.numel() <= samples:
        return patch.indices, patch.values
    pick = picks.of(patch)
    return patch.indices.index_select(0, pick), patch.values.index_select(0, pick)  # faster than `[pick]`


def _fused_reads(
    index: IndexMap, patches: Sequence[Patch], samples: int, picks: _Picks
) -> tuple[list[tuple[list[Patch], torch.Tensor, torch.Tensor, list[int]]], set[int]]:
    """The read-backs of sparse patches whose one target is a plain parameter holding their tensor whole at a
    flat range of its own, where :data:`~.apply.SHIFT_TOGETHER` or more of them share the parameter (a layer's
    fused experts), read with one gather for the parameter instead of one a tensor: each tensor's positions
    shifted to its place by one lookup for all. The positions drawn for sampled patches are taken from their
    indices and values with one gather each where those lie in one buffer each (the device path's patches:
    slices of one batch's results; a lot per batch where they span several), instead of two a tensor.
    Returns, per such read, (its patches, the bits read back, the bits written there, how many of them are
    each patch's, in turn), and the ``id`` of every patch read so."""
    if samples <= 0:
        return [], set()
    groups: dict[tuple[int, torch.dtype, bool], list[tuple[Patch, Target, int]]] = {}
    for patch in patches:
        placed = index.in_place(patch.name) if patch.indices is not None and patch.indices.numel() else None
        if placed is not None and placed[0].param.device == patch.indices.device:  # type: ignore[union-attr]
            drawn = patch.indices.numel() > samples  # type: ignore[union-attr]
            groups.setdefault((id(placed[0].param), patch.spec.torch_dtype, drawn), []).append((patch, *placed))
    out, done = [], set()
    for (_, published, drawn), members in groups.items():
        if len(members) < SHIFT_TOGETHER:
            continue
        group = [patch for patch, _, _ in members]
        chosen = _sampled_together(group, [shift for _, _, shift in members], picks) if drawn else None
        if chosen is not None:
            (runtime, values), sizes = chosen, [samples] * len(group)
        else:  # each patch's own positions (all its changes, or its draw: from a few buffers), joined
            together = _taken_together(group, samples, picks) if drawn else {}
            taken = [together.get(id(patch)) or _sample(patch, samples, picks) for patch in group]
            runtime = shifted([(idx, shift) for (idx, _), (_, _, shift) in zip(taken, members)])
            values, sizes = torch.cat([v for _, v in taken]), [len(idx) for idx, _ in taken]
        got = PLAIN.read(members[0][1].param.data, runtime, published)
        out.append((group, got, values.to(got.device), sizes))
        done.update(id(patch) for patch in group)
    return out, done


def _taken_together(
    patches: Sequence[Patch], samples: int, picks: _Picks
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The drawn indices and bits of the sampled ``patches`` whose indices and values lie in the same two
    buffers as :data:`~.apply.SHIFT_TOGETHER` or more others' (the device path's patches), taken with two
    gathers for each such lot instead of two a tensor. ``id(patch)`` -> (its indices, its bits)."""
    lots: dict[tuple[int, int], list[Patch]] = {}
    for patch in patches:
        if patch.indices is not None and patch.indices.numel() > samples:
            lots.setdefault(_buffers(patch), []).append(patch)
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for lot in lots.values():
        chosen = _sampled_together(lot, [0] * len(lot), picks) if len(lot) >= SHIFT_TOGETHER else None
        if chosen is not None:
            rows = [column.view(len(lot), samples).unbind(0) for column in chosen]
            out.update(zip(map(id, lot), zip(*rows)))
    return out


def _buffers(patch: Patch) -> tuple[int, int]:
    """Where the buffers that ``patch``'s indices and values are views of start (the same for every patch of
    one batch of a device-path decode)."""
    assert patch.indices is not None
    return patch.indices.untyped_storage().data_ptr(), patch.values.untyped_storage().data_ptr()


def _sampled_together(
    patches: Sequence[Patch], shifts: Sequence[int], picks: _Picks
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each patch's drawn positions taken from its indices and values together (one gather each), where every
    patch's indices are one contiguous slice of a single buffer and its values of another, all on one device:
    its indices shifted by its ``shifts`` entry, and its values, ``samples`` of each patch in turn. ``None``
    where they are not."""
    columns = []
    for column in ([p.indices for p in patches], [p.values for p in patches]):
        first: torch.Tensor = column[0]  # type: ignore[assignment]
        storage = first.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes() // first.element_size()
        offsets = []
        for tensor in column:
            assert tensor is not None
            at = (tensor.data_ptr() - base) // first.element_size()  # within the buffer: in no other
            if (tensor.device != first.device or tensor.dtype != first.dtype or tensor.dim() != 1
                    or tensor.stride(0) != 1 or not 0 <= at <= size - tensor.numel()):
                return None
            offsets.append(at)
        columns.append((first.as_strided((size,), (1,), 0), offsets))
    (indices, at_index), (values, at_value) = columns
    device = indices.device
    if values.device != device or device not in picks.tables:
        return None
    table = stage([torch.tensor([[picks.rows[id(p)], i, v, s] for p, i, v, s in
                                 zip(patches, at_index, at_value, shifts)], dtype=torch.int64)], device)[0]
    drawn = picks.tables[device].index_select(0, table[:, 0])  # (patches, samples): within each patch's changes
    runtime = indices.index_select(0, drawn.add(table[:, 1:2]).view(-1)).view(drawn.shape).add_(table[:, 3:4])
    return runtime.view(-1), values.index_select(0, drawn.add_(table[:, 2:3]).view(-1))


def check_proofs(answers: list[dict[str, Any]]) -> None:
    """Follower side: raise :class:`LayoutMismatch` naming every runtime parameter some rank's
    ``deltasync_init`` answer could not prove (or no checkpoint element reaches)."""
    failed: dict[str, str] = {}
    for answer in answers:
        for param in answer.get("unreached", []):
            failed[param] = (
                "no checkpoint element reaches it through the weight loaders, so deltas could never "
                "update it (a parameter derived from the weights, or one the probe could not reach)"
            )
        proof = answer.get("proof")
        if isinstance(proof, dict):
            failed.update(proof.get("failed", {}))
            if proof.get("constant"):
                logger.info(
                    "deltasync: %d tensors are constant in the checkpoint, so their layout is proven only "
                    "by reading back right: %s", len(proof["constant"]), ", ".join(proof["constant"][:5]),
                )
    if failed:
        lines = [f"{param}: {why}" for param, why in sorted(failed.items())]
        raise LayoutMismatch(
            f"{len(failed)} runtime parameters of the engine cannot be patched exactly, so the follower "
            f"refuses to start (nothing was written): {'; '.join(lines[:4])}{' ...' if len(lines) > 4 else ''}",
            name=sorted(failed)[0],
        )
