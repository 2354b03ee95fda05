"""Mapping layer, engine-agnostic: checkpoint elements -> runtime parameter elements on this rank.

An :class:`IndexMap` holds, for every checkpoint tensor, the :class:`Target` s
where its elements live on this rank. A target covers part of one checkpoint
tensor inside one runtime parameter, in one of three forms:

- a *flat range* (a box of whole rows moved by one shift: fused stacking,
  row and vocab shards, one expert's rows inside a stacked expert tensor):
  checkpoint flat ``[a, b)`` -> runtime flat ``+ shift``;
- a *box*: per dimension a checkpoint range ``[lo, hi)`` and a constant offset
  (column shards, q/k/v or gate/up stacked along a later dimension); a runtime
  parameter with more dimensions than the checkpoint tensor holds it at fixed
  leading coordinates (one expert of ``w2_weight [E, H, I]``), a constant
  ``base`` added to every runtime flat index;
- an explicit *table*: sorted checkpoint flat indices and their runtime flat
  indices, for anything else an engine's loaders do (logged when used).

:func:`fit_targets` turns observed pairs (checkpoint flat index, runtime flat
index) into targets, checking a box exactly before it is accepted; how the
pairs are observed is the engine's business (vLLM: :mod:`.vllm_mapping`).

Parameter layouts
-----------------
How a runtime parameter's elements are read and written by runtime flat index
is a :class:`Layout`, and this module's registry is the one place a layout is
registered (:func:`register_layout`). Every target carries the layout that
claimed its parameter when the map was built; the apply layer reads and
writes only through it. Registered today:

- ``plain`` (:data:`PLAIN`): a dense parameter whose ``.data`` holds the
  elements in row-major order, in the published dtype (written bit for bit) or
  a wider float (written by exact up-cast). It claims every strided tensor and
  is asked last.

- ``vllm-cpu-packed-experts`` (:mod:`.cpu_experts`, registered when the vLLM
  worker extension is imported): fused expert weights that vLLM's CPU MoE kernel
  prepacked after loading, patched where the kernel reads them.

Later layouts register here and are asked first, newest first (quantized block
formats: values and scales rewritten per block). A layout that is wrong for a
parameter is caught before the first write by :mod:`.verify`.

Limitations:

- A layout maps elements one to one; a parameter whose elements are computed
  from several checkpoint elements (scales, sums) needs a layout that says how
  to rewrite them, and none is registered today.
- Tables cost two int64 per element; boxes cost nothing per element.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.autograd.graph import increment_version

from ..codec.kernels import put
from ..errors import TensorMismatch
from ..tensors import TensorSpec, bits_dtype, write_at

__all__ = [
    "Layout",
    "PLAIN",
    "register_layout",
    "unregister_layout",
    "layout_names",
    "layout_for",
    "Target",
    "from_start",
    "IndexMap",
    "fit_targets",
    "strides",
    "unravel",
    "uncovered_elements",
]

# The vLLM applier's logger: the one users configure for index-map and apply messages.
logger = logging.getLogger("deltasync.vllm")


# ---------------------------------------------------------------------- layouts


@dataclass(frozen=True, slots=True)
class Layout:
    """How elements of one kind of runtime parameter are read and written by runtime flat index."""

    name: str
    """Registry name, shown in errors and logs."""
    claims: Callable[[str, torch.nn.Parameter], bool]
    """``claims(param_name, param)``: whether this layout addresses the parameter's elements."""
    read: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
    """``read(data, runtime, published)``: bit patterns (published dtype) at runtime flat indices."""
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], None]
    """``write(data, runtime, bits, published)``: store bit patterns at runtime flat indices, in place."""


def _plain_read(data: torch.Tensor, runtime: torch.Tensor, published: torch.dtype) -> torch.Tensor:
    # index_select, not data[runtime]: the general indexing kernel is slower at scattered reads on the CPU.
    picked = data.view(-1).index_select(0, runtime)
    if picked.dtype != published:
        picked = picked.to(published)
    return picked.view(bits_dtype(published))


def _plain_write(data: torch.Tensor, runtime: torch.Tensor, bits: torch.Tensor, published: torch.dtype) -> None:
    flat = data.view(-1)
    if data.dtype == published:
        _write_bits(flat.view(bits_dtype(data.dtype)), runtime, bits)
    else:
        write_at(flat, runtime, bits.view(published).to(data.dtype))


def _write_bits(flat: torch.Tensor, runtime: torch.Tensor, bits: torch.Tensor) -> None:
    """``flat[runtime] = bits`` in place: on the CPU by the compiled scatter (:func:`~deltasync.codec.kernels.put`,
    faster than torch's kernels into weights not in cache), elsewhere by :func:`~deltasync.tensors.write_at`."""
    if flat.is_cpu and runtime.is_cpu and bits.is_cpu and runtime.dtype == torch.int64 and bits.dtype == flat.dtype:
        put(flat.detach().numpy(), runtime.contiguous().numpy(), bits.detach().contiguous().numpy())
        increment_version(flat)  # as torch's in-place writes do
    else:
        write_at(flat, runtime, bits)


PLAIN = Layout(
    name="plain",
    claims=lambda name, param: param.layout == torch.strided,
    read=_plain_read,
    write=_plain_write,
)

_LAYOUTS: dict[str, Layout] = {PLAIN.name: PLAIN}


def register_layout(layout: Layout) -> None:
    """Register a parameter layout; it is asked before every layout registered earlier.

    Raises:
        `ValueError`: a layout with that name is registered already.
    """
    if layout.name in _LAYOUTS:
        raise ValueError(f"layout {layout.name!r} is already registered; registered: {layout_names()}")
    _LAYOUTS[layout.name] = layout


def unregister_layout(name: str) -> Layout:
    """Remove a registered layout (not ``plain``); maps built afterwards no longer use it.

    Raises:
        `ValueError`: no such layout, or ``"plain"``.
    """
    if name == PLAIN.name or name not in _LAYOUTS:
        raise ValueError(f"cannot unregister layout {name!r}; registered: {layout_names()}")
    return _LAYOUTS.pop(name)


def layout_names() -> list[str]:
    """Names of every registered layout, in the order they are asked."""
    return list(reversed(_LAYOUTS))


def layout_for(param_name: str, param: torch.nn.Parameter) -> Layout:
    """The newest registered layout that claims ``param``.

    Raises:
        `TensorMismatch`: no layout claims it, so it cannot be patched in place.
    """
    for layout in reversed(_LAYOUTS.values()):
        if layout.claims(param_name, param):
            return layout
    raise TensorMismatch(
        f"no registered parameter layout can patch {param_name!r} in place (layouts: {layout_names()})",
        name=param_name,
    )


# ---------------------------------------------------------------------- targets


def from_start(data: torch.Tensor, start: int) -> torch.Tensor:
    """``data``'s elements, flat, from runtime flat index ``start`` on: where a tensor that lies whole at one
    flat range (:meth:`Target.whole_start`) is read or written by its own flat indices, with no kernel to
    shift them."""
    flat = data.view(-1)
    return flat[start:] if start else flat


@dataclass(slots=True)
class Target:
    """Where part of one checkpoint tensor lives in one runtime parameter on this rank."""

    param: torch.nn.Parameter
    """The runtime parameter (its ``.data`` is read at use time, never replaced)."""
    param_name: str
    ckpt_shape: tuple[int, ...]
    layout: Layout = PLAIN
    """How the parameter's elements are read and written."""
    lo: tuple[int, ...] | None = None
    """Box form: checkpoint coordinates [lo, hi) map to runtime coordinates + offset."""
    hi: tuple[int, ...] | None = None
    offset: tuple[int, ...] | None = None
    base: int = 0
    """Box form: runtime flat offset of the fixed leading coordinates (runtime has more dimensions)."""
    flat: tuple[int, int, int] | None = None
    """Box that is a flat range: checkpoint flat [a, b) -> runtime flat + shift."""
    table: tuple[torch.Tensor, torch.Tensor] | None = None
    """Explicit form: sorted checkpoint flat indices and their runtime flat indices."""

    @property
    def count(self) -> int:
        """Number of checkpoint elements this target holds."""
        if self.table is not None:
            return int(self.table[0].numel())
        assert self.lo is not None and self.hi is not None
        return math.prod([h - l for l, h in zip(self.lo, self.hi)])

    def translate(self, idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Positions in ``idx`` owned here (``None``: all of them) and their runtime flat indices."""
        owned, runtime = self.locate(idx)
        if owned is None:
            return None, runtime
        pos = owned.nonzero().squeeze(1)  # the one host wait: how many are owned
        return pos, runtime[pos]

    def whole_start(self) -> int | None:
        """The runtime flat index where the whole checkpoint tensor starts, where it lies whole at one flat
        range in its own order (in place, or shifted): from there (:func:`from_start`) a checkpoint flat index
        needs no translating. Else ``None``."""
        if self.flat is None:
            return None
        a, b, shift = self.flat
        return shift if a == 0 and b == math.prod(self.ckpt_shape) else None

    def locate(self, idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Which of ``idx`` are owned here (a mask; ``None``: all of them) and a runtime flat index for
        every one of them, without waiting for the device: an index not owned here gets some element of
        the parameter (always in bounds), to be masked out by the caller."""
        if self.flat is not None:
            a, b, shift = self.flat
            if self.whole_start() is not None:  # the whole tensor, shifted: no mask
                return None, idx + shift if shift else idx
            return (idx >= a) & (idx < b), idx.clamp(a, b - 1) + shift
        if self.table is not None:
            keys, values = self.table
            if not keys.numel():
                return torch.zeros_like(idx, dtype=torch.bool), torch.zeros_like(idx)
            at = torch.searchsorted(keys, idx).clamp_(max=keys.numel() - 1)
            return keys[at] == idx, values[at]
        assert self.lo is not None and self.hi is not None and self.offset is not None
        coords = unravel(idx, self.ckpt_shape)
        owned = torch.ones_like(idx, dtype=torch.bool)
        runtime = torch.full_like(idx, self.base)
        trailing = strides(tuple(self.param.shape))[self.param.dim() - len(self.ckpt_shape) :]
        for c, lo, hi, off, stride in zip(coords, self.lo, self.hi, self.offset, trailing):
            owned &= (c >= lo) & (c < hi)
            runtime += (c.clamp(lo, hi - 1) + off) * stride
        return owned, runtime

    def region(self, data: torch.Tensor, whole: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The elements this target holds as two views of one shape: of the parameter's ``data`` (contiguous)
        and of ``whole`` (every element of the checkpoint tensor, flat, in its order). A whole tensor is then
        written and read back with one strided copy and compare instead of an index per element, several times
        faster for an anchor (``benchmarks/vllm_anchor.py``). ``None`` for a table."""
        if self.table is not None:
            return None
        if self.flat is not None:
            a, b, shift = self.flat
            return data.view(-1)[a + shift : b + shift], whole[a:b]
        assert self.lo is not None and self.hi is not None and self.offset is not None
        trailing = tuple(self.param.shape)[self.param.dim() - len(self.ckpt_shape) :]
        block = data.view(-1)[self.base : self.base + math.prod(trailing)].view(trailing)
        held = tuple(slice(lo + off, hi + off) for lo, hi, off in zip(self.lo, self.hi, self.offset))
        return block[held], whole.view(self.ckpt_shape)[tuple(slice(lo, hi) for lo, hi in zip(self.lo, self.hi))]

    def describe(self) -> list[Any]:
        """``["box", lo, hi]`` or ``["table", count]``: what the follower's coverage check reads."""
        if self.table is not None:
            return ["table", self.count]
        return ["box", list(self.lo or ()), list(self.hi or ())]


def strides(shape: tuple[int, ...]) -> list[int]:
    """Row-major strides, in elements, of a contiguous tensor of ``shape``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Row-major coordinates, one tensor per dimension, of flat indices into ``shape``."""
    coords: list[torch.Tensor] = []
    rest = flat
    for d in reversed(shape[1:]):
        coords.append(rest % d)
        rest = rest // d
    coords.append(rest)
    return coords[::-1]


def fit_targets(
    param: torch.nn.Parameter, name: str, spec: TensorSpec, c: torch.Tensor, r: torch.Tensor
) -> list[Target]:
    """Targets mapping checkpoint flat ``c`` to runtime flat ``r``: one verified box, else tables.

    Raises:
        `TensorMismatch`: no registered layout claims ``param``.
    """
    layout = layout_for(name, param)
    box = _fit_box(param, name, spec, c, r, layout)
    if box is not None:
        return [box]
    # Explicit tables; an element replicated within one parameter goes to a second table.
    order = torch.argsort(c, stable=True)
    c, r = c[order], r[order]
    first = torch.ones_like(c, dtype=torch.bool)
    first[1:] = c[1:] != c[:-1]
    positions = torch.arange(c.numel(), device=c.device)
    run_start = torch.cummax(torch.where(first, positions, 0), 0).values
    rank = positions - run_start
    logger.info("deltasync: %s -> %s kept as an explicit index table (%d elements)", spec.name, name, c.numel())
    return [
        Target(param, name, spec.shape, layout, table=(c[rank == k].contiguous(), r[rank == k].contiguous()))
        for k in range(int(rank.max()) + 1 if c.numel() else 0)
    ]


def _fit_box(
    param: torch.nn.Parameter, name: str, spec: TensorSpec, c: torch.Tensor, r: torch.Tensor, layout: Layout
) -> Target | None:
    """One box target exactly equal to the pairs ``(c, r)``, or ``None``."""
    shape, rshape = spec.shape, tuple(param.shape)
    if not c.numel() or len(shape) > len(rshape):
        return None
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    first, last = int(c.min()), int(c.max())
    shift = r - c
    # Fast exact check for whole rows moved by one shift (fused stacking, row and vocab shards,
    # one expert's rows in a stacked expert tensor): a run of checkpoint elements, one shift.
    if (
        last - first + 1 == c.numel()
        and first % row == 0
        and c.numel() % row == 0
        and int(shift.min()) == int(shift.max())
    ):
        lo = (first // row,) + (0,) * (len(shape) - 1)
        hi = ((last + 1) // row,) + tuple(shape[1:])
        return Target(param, name, shape, layout, lo=lo, hi=hi, flat=(first, last + 1, int(shift[0])))
    cc = unravel(c, shape)
    rc = unravel(r, rshape)
    lead, rc = rc[: len(rshape) - len(shape)], rc[len(rshape) - len(shape) :]
    # Extra leading runtime dimensions must be fixed (one expert's slot): they add a constant base.
    if any(int(x.min()) != int(x.max()) for x in lead):
        return None
    base = sum(int(x[0]) * s for x, s in zip(lead, strides(rshape)))
    offsets = [rd - cd for cd, rd in zip(cc, rc)]
    if all(int(o.min()) == int(o.max()) for o in offsets):
        lo = tuple(int(x.min()) for x in cc)
        hi = tuple(int(x.max()) + 1 for x in cc)
        # Constant offsets make the map injective; full count makes it the whole box.
        if math.prod([h - l for l, h in zip(lo, hi)]) == c.numel():
            offset = tuple(int(o[0]) for o in offsets)
            return Target(param, name, shape, layout, lo=lo, hi=hi, offset=offset, base=base)
    return None


# ---------------------------------------------------------------------- the map


class IndexMap:
    """Checkpoint tensor name -> its targets on this rank.

    Args:
        specs (`Iterable[TensorSpec]`): the checkpoint tensors; each starts with no targets.
    """

    def __init__(self, specs: Iterable[TensorSpec]) -> None:
        self.specs: dict[str, TensorSpec] = {s.name: s for s in specs}
        self.targets: dict[str, list[Target]] = {name: [] for name in self.specs}

    @classmethod
    def whole(cls, params: Mapping[str, torch.nn.Parameter]) -> IndexMap:
        """The map of a rank that holds every checkpoint tensor whole, in a runtime parameter of its own
        of the same name and shape (``params``' tensors themselves, no copy): one flat range each."""
        index = cls(TensorSpec.of(name, p) for name, p in params.items())
        for name, p in params.items():
            zeros = (0,) * p.dim()
            index.targets[name].append(Target(p, name, tuple(p.shape), lo=zeros, hi=tuple(p.shape), offset=zeros,
                                              flat=(0, p.numel(), 0)))
        return index

    def flat_bits(self, name: str) -> np.ndarray | None:
        """Tensor ``name``'s published bit patterns as one flat numpy view of the weights, where this rank's
        first target of it holds all of it in one plain parameter on the CPU, contiguous and in the published
        dtype (a whole-tensor flat range); else ``None``.

        A host decode reads its base there in place (:class:`~deltasync.codec.base.FlatLookup`): the elements
        :func:`~.apply.read_bits` reads through this map, which takes each element from the first target that
        holds it (a tied or replicated copy after it is written, never read), without a read per tensor."""
        targets = self.targets.get(name)
        if not targets:
            return None
        target, spec = targets[0], self.specs[name]
        numel = spec.numel
        start = target.whole_start() if target.layout is PLAIN else None
        if start is None:
            return None
        data = target.param.data
        if not (data.is_cpu and data.is_contiguous() and data.dtype == spec.torch_dtype) or start < 0 \
                or start + numel > data.numel():
            return None
        return from_start(data, start)[:numel].view(bits_dtype(data.dtype)).numpy()

    def in_place(self, name: str) -> tuple[Target, int] | None:
        """Tensor ``name``'s one target and the runtime flat index it starts at, where this rank holds it
        whole at one flat range of a contiguous plain parameter and nowhere else (a tensor of its own, a layer's
        fused experts, q/k/v): read and written there by its own flat indices (:func:`from_start`), or with
        the start added to them. Else ``None``."""
        targets = self.targets.get(name)
        if not targets or len(targets) != 1 or targets[0].layout is not PLAIN:
            return None
        start = targets[0].whole_start()
        return (targets[0], start) if start is not None and targets[0].param.is_contiguous() else None

    def owned(self) -> dict[str, list[Any]]:
        """Per checkpoint tensor, what each target covers (:meth:`Target.describe`)."""
        return {name: [t.describe() for t in ts] for name, ts in self.targets.items()}

    def counts(self) -> dict[str, int]:
        """Per checkpoint tensor, how many of its elements this rank holds (replicas counted each)."""
        return {n: sum(t.count for t in ts) for n, ts in self.targets.items()}

    def layouts(self) -> dict[str, str]:
        """Runtime parameter -> the name of the layout it is read and written through (sorted)."""
        return dict(sorted({t.param_name: t.layout.name for ts in self.targets.values() for t in ts}.items()))

    def table_params(self) -> list[str]:
        """Runtime parameters reached through an explicit table (sorted)."""
        return sorted({t.param_name for ts in self.targets.values() for t in ts if t.table is not None})


def uncovered_elements(specs: Mapping[str, TensorSpec], owned: Iterable[Mapping[str, list[Any]]]) -> list[str]:
    """``"name (N elements)"`` for every tensor that the ranks' :meth:`IndexMap.owned` answers leave short."""
    answers = list(owned)
    missing = []
    for name, spec in specs.items():
        covered = np.zeros(spec.shape or (1,), dtype=bool)
        tables = 0
        for answer in answers:
            for kind, *rest in answer.get(name, []):
                if kind == "box":
                    covered[tuple(slice(lo, hi) for lo, hi in zip(*rest))] = True
                else:
                    tables += int(rest[0])
        if int(covered.sum()) + tables < spec.numel:
            missing.append(f"{name} ({spec.numel - int(covered.sum()) - tables} elements)")
    return missing
