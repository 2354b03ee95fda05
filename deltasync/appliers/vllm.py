"""vLLM worker extension: apply deltas in place, O(changed elements), in every worker.

Start vLLM with this class as its worker extension::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR \\
        --worker-extension-cls deltasync.appliers.vllm.DeltaSyncWorkerExtension
    python -m deltasync.appliers.vllm_follower --store s3://bucket/run1 \\
        --server http://127.0.0.1:8000 --model MODEL_DIR

or ``LLM(MODEL_DIR, worker_extension_cls="deltasync.appliers.vllm.DeltaSyncWorkerExtension")``
with :class:`~deltasync.appliers.vllm_follower.VLLMFollower` in the same process.
The follower downloads and decodes once per node; the workers only read and
write the changed elements, through ``collective_rpc`` (which runs between
engine steps, so it never races a forward pass).

How checkpoint elements are found in vLLM's fused and sharded parameters: on
``deltasync_init`` each worker *probes* its own weight loaders. For one decoder
layer at a time it swaps the runtime parameters' ``.data`` for scratch
tensors filled with -1 (float32 while the group has fewer than 2**24
elements, so every index is exact, else float64; every other parameter gets a zero-stride trap that
refuses writes), calls ``model.load_weights`` with tensors whose elements are
their own global index, reads where each checkpoint element landed, and puts
the original ``.data`` objects back (the real weights are never written; the
storage pointers never change). Each (checkpoint tensor, parameter) pair is
compressed to a *box* (per dimension a checkpoint range and a constant offset:
q/k/v -> qkv_proj, gate/up -> gate_up_proj, row/column/vocab shards, replicated
KV heads), checked exactly against the probe, or else kept as an explicit
sorted index table (logged). Elements owned by other ranks do not map here.

CPU backend: vLLM repacks Linear weights after loading (oneDNN / sgl kernels)
and leaves ``layer.weight`` empty. Two ways to stay exact:

- ``DELTASYNC_VLLM_PLAIN_WEIGHTS=1`` in the workers' environment (read when
  this module is imported in the worker, before the model loads) keeps Linear
  weights plain (``torch.nn.functional.linear``): every layer is patched in
  place. Slower matmuls on CPU; this is what the tests use.
- Without it, each packed layer's plain weight is kept on the host (captured as
  it is packed; about one more copy of the Linear weights), patched in place,
  and the touched layers are re-packed after each apply: O(size of the touched
  layers), not O(changed elements). Logged per layer at init. A tied
  ``lm_head`` shares the embedding, and its packed copy is rebuilt with it.

Limitations:

- Unquantized weights only, held in the published dtype (bf16) or a wider
  float (written by exact up-cast). Quantized layers, weights that loaders
  transform arithmetically (scaling, permutation by math), and causal-conv
  weights packed by the CPU backend are refused at init, by name.
- Pipeline parallel is untested; expert parallel / MoE layers map through the
  explicit table path if their loaders are probe-able, which is untested.
- Index maps cost memory only for explicit tables; probing needs float32/64
  scratch for one decoder layer (or the embedding group) at a time, and takes
  about 5 s for SmolLM2-135M on one CPU core (once, at follower start).
- Worker-side apply is O(changed elements) but a scattered write: on one CPU
  core about 15 ms for a 0.57 % SmolLM2 delta (bare ``index_copy_`` of the
  same elements: 11 ms; full ``load_weights``: 25-32 ms).
- LoRA adapters are not touched (they are not checkpoint tensors).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import TensorMismatch
from ..tensors import TensorSpec, bits_dtype
from ._vllm_wire import pack, specs_from_json, unpack

__all__ = ["DeltaSyncWorkerExtension", "PLAIN_WEIGHTS_ENV", "install_cpu_hooks"]

logger = logging.getLogger("deltasync.vllm")

PLAIN_WEIGHTS_ENV = "DELTASYNC_VLLM_PLAIN_WEIGHTS"
_LAYER_TOKEN = re.compile(r"(?:^|\.)([A-Za-z_][A-Za-z0-9_]*\.\d+)\.")

# Layers whose weights the CPU backend packed: layer -> (plain weight Parameter, remove_weight).
_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.nn.Parameter, bool]] = weakref.WeakKeyDictionary()
_ORIGINAL_DISPATCH: Any = None


# ---------------------------------------------------------------------- CPU packing hooks


def _plain_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Keep 2-D Linear weights plain: ``cpu_linear`` is ``F.linear`` on ``layer.weight``."""
    if getattr(layer, "weight", None) is not None and layer.weight.ndim != 2:
        _ORIGINAL_DISPATCH(layer, remove_weight)
        return
    layer.cpu_linear = torch.nn.functional.linear


def _stashing_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """Pack as vLLM does, but remember the plain weight so it can be patched and re-packed."""
    weight = getattr(layer, "weight", None)
    _ORIGINAL_DISPATCH(layer, remove_weight)
    # Any 2-D weight may now have a packed copy (oneDNN / sgl handle) that patches must refresh.
    if isinstance(weight, torch.nn.Parameter) and weight.ndim == 2 and not weight.is_meta:
        _PACKED[layer] = (weight, remove_weight)


def install_cpu_hooks() -> str | None:
    """Replace vLLM's CPU GEMM dispatch (plain or stashing); returns the mode installed.

    Called when this module is imported, so in a worker it runs before the model
    loads. Does nothing without vllm or off the CPU platform.
    """
    global _ORIGINAL_DISPATCH
    try:
        import vllm.model_executor.layers.utils as utils
        from vllm.platforms import current_platform
    except Exception:  # vllm missing or broken: nothing to hook
        return None
    if not current_platform.is_cpu():
        return None
    if _ORIGINAL_DISPATCH is None:
        _ORIGINAL_DISPATCH = utils.dispatch_cpu_unquantized_gemm
    plain = os.environ.get(PLAIN_WEIGHTS_ENV, "").lower() in ("1", "true", "yes")
    replacement = _plain_dispatch if plain else _stashing_dispatch
    # linear.py and vocab_parallel_embedding.py import the function at call time;
    # rebind any module-level copy too (read __dict__: lazy modules import on getattr).
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("dispatch_cpu_unquantized_gemm") is _ORIGINAL_DISPATCH:
            namespace["dispatch_cpu_unquantized_gemm"] = replacement
    return "plain" if plain else "stash"


_CPU_HOOK_MODE = install_cpu_hooks()


def _repack(layer: torch.nn.Module) -> None:
    """Re-run vLLM's packing for ``layer`` from its (patched) plain weight."""
    weight, remove = _PACKED[layer]
    if remove:
        layer.weight = weight
    _ORIGINAL_DISPATCH(layer, remove)


# ---------------------------------------------------------------------- index maps


@dataclass(slots=True)
class _Target:
    """Where part of one checkpoint tensor lives in one runtime parameter on this rank."""

    param: torch.nn.Parameter
    """The runtime parameter (its ``.data`` is read at use time, never replaced)."""
    param_name: str
    ckpt_shape: tuple[int, ...]
    lo: tuple[int, ...] | None = None
    """Box form: checkpoint coordinates [lo, hi) map to runtime coordinates + offset."""
    hi: tuple[int, ...] | None = None
    offset: tuple[int, ...] | None = None
    flat: tuple[int, int, int] | None = None
    """Box that is a flat range: checkpoint flat [a, b) -> runtime flat + shift."""
    table: tuple[torch.Tensor, torch.Tensor] | None = None
    """Explicit form: sorted checkpoint flat indices and their runtime flat indices."""

    @property
    def count(self) -> int:
        if self.table is not None:
            return int(self.table[0].numel())
        assert self.lo is not None and self.hi is not None
        return int(np.prod([h - l for l, h in zip(self.lo, self.hi)]))

    def translate(self, idx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Positions in ``idx`` owned here (``None``: all of them) and their runtime flat indices."""
        if self.flat is not None:
            a, b, shift = self.flat
            if a == 0 and b == int(np.prod(self.ckpt_shape)):  # the whole tensor, shifted: no mask
                return None, idx + shift if shift else idx
            pos = ((idx >= a) & (idx < b)).nonzero().squeeze(1)
            return pos, idx[pos] + shift
        if self.table is not None:
            keys, values = self.table
            at = torch.searchsorted(keys, idx).clamp_(max=max(keys.numel() - 1, 0))
            pos = (keys[at] == idx).nonzero().squeeze(1) if keys.numel() else idx.new_empty(0)
            return pos, values[at[pos]]
        assert self.lo is not None and self.hi is not None and self.offset is not None
        coords = _unravel(idx, self.ckpt_shape)
        mask = torch.ones_like(idx, dtype=torch.bool)
        for c, lo, hi in zip(coords, self.lo, self.hi):
            mask &= (c >= lo) & (c < hi)
        pos = mask.nonzero().squeeze(1)
        runtime = torch.zeros_like(pos)
        for c, off, stride in zip(coords, self.offset, _strides(tuple(self.param.shape))):
            runtime += (c[pos] + off) * stride
        return pos, runtime

    def describe(self) -> list[Any]:
        if self.table is not None:
            return ["table", self.count]
        return ["box", list(self.lo or ()), list(self.hi or ())]


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def _unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    coords: list[torch.Tensor] = []
    rest = flat
    for d in reversed(shape[1:]):
        coords.append(rest % d)
        rest = rest // d
    coords.append(rest)
    return coords[::-1]


def _fit(param: torch.nn.Parameter, name: str, spec: TensorSpec, c: torch.Tensor, r: torch.Tensor) -> list[_Target]:
    """Targets mapping checkpoint flat ``c`` to runtime flat ``r``: one verified box, else tables."""
    shape, rshape = spec.shape, tuple(param.shape)
    if c.numel() and len(shape) == len(rshape):
        row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        first, last = int(c.min()), int(c.max())
        shift = r - c
        # Fast exact check for whole rows moved by one shift (fused stacking, row and vocab shards).
        if (
            last - first + 1 == c.numel()
            and first % row == 0
            and c.numel() % row == 0
            and shape[1:] == rshape[1:]
            and int(shift.min()) == int(shift.max())
        ):
            delta = int(shift[0])
            if delta % row == 0:
                lo = (first // row,) + (0,) * (len(shape) - 1)
                hi = ((last + 1) // row,) + tuple(shape[1:])
                offset = (delta // row,) + (0,) * (len(shape) - 1)
                return [_Target(param, name, shape, lo=lo, hi=hi, offset=offset, flat=(first, last + 1, delta))]
        cc, rc = _unravel(c, shape), _unravel(r, rshape)
        offsets = [rd - cd for cd, rd in zip(cc, rc)]
        if all(int(o.min()) == int(o.max()) for o in offsets):
            lo = tuple(int(x.min()) for x in cc)
            hi = tuple(int(x.max()) + 1 for x in cc)
            # Constant offsets make the map injective; full count makes it the whole box.
            if int(np.prod([h - l for l, h in zip(lo, hi)])) == c.numel():
                return [_Target(param, name, shape, lo=lo, hi=hi, offset=tuple(int(o[0]) for o in offsets))]
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
        _Target(param, name, shape, table=(c[rank == k].contiguous(), r[rank == k].contiguous()))
        for k in range(int(rank.max()) + 1 if c.numel() else 0)
    ]


class _IndexMap:
    """Checkpoint tensor name -> its targets on this rank, built by probing the weight loaders."""

    def __init__(self, model: torch.nn.Module, specs: list[TensorSpec]) -> None:
        self.specs = {s.name: s for s in specs}
        self.targets: dict[str, list[_Target]] = {s.name: [] for s in specs}
        self.params = _runtime_params(model)
        with _plain_weights_attached(model):
            groups: dict[str | None, list[TensorSpec]] = {}
            for spec in specs:
                groups.setdefault(_layer_token(spec.name), []).append(spec)
            for token, members in groups.items():
                self._probe(model, token, members)

    def _group_params(self, token: str | None) -> set[str]:
        if token is None:
            return {n for n in self.params if _layer_token(n) is None}
        pattern = re.compile(rf"(?:^|\.){re.escape(token)}\.")
        return {n for n in self.params if pattern.search(n)}

    def _probe(self, model: torch.nn.Module, token: str | None, members: list[TensorSpec]) -> None:
        scratch_names = self._group_params(token)
        try:
            self._probe_with(model, members, scratch_names)
        except RuntimeError as exc:
            # A loader wrote outside the expected group (the trap refused it): probe against everything.
            logger.warning("deltasync: probing group %s wider (%s)", token, exc)
            self._probe_with(model, members, set(self.params))

    def _probe_with(self, model: torch.nn.Module, members: list[TensorSpec], scratch_names: set[str]) -> None:
        offsets = [int(x) for x in np.cumsum([0] + [s.numel for s in members])]
        # float32 holds every integer below 2**24 exactly: half the bytes of float64 for one decoder layer.
        dtype = torch.float32 if offsets[-1] < 2**24 else torch.float64
        saved = {n: p.data for n, p in self.params.items()}
        scratch: dict[str, torch.Tensor] = {}
        try:
            for n, p in self.params.items():
                if n in scratch_names or p.numel() <= 1:
                    scratch[n] = torch.full(tuple(p.shape), -1.0, dtype=dtype, device=p.device)
                    p.data = scratch[n]
                else:  # zero-stride trap: any write into it raises
                    p.data = torch.zeros(1, dtype=dtype, device=p.device).expand(tuple(p.shape))

            def probes() -> Iterator[tuple[str, torch.Tensor]]:
                for spec, start in zip(members, offsets):
                    yield spec.name, torch.arange(start, start + spec.numel, dtype=dtype).view(spec.shape)

            with torch.no_grad():
                model.load_weights(probes())
        finally:
            for n, p in self.params.items():
                p.data = saved[n]
        for n, buf in scratch.items():
            flat = buf.view(-1)
            r = (flat >= 0).nonzero().squeeze(1)
            if not r.numel():
                continue
            g = flat[r].to(torch.int64)
            low_g, high_g = int(g.min()), int(g.max())
            if high_g >= offsets[-1]:
                raise TensorMismatch(
                    f"the weight loader of {n!r} transforms values on load; it cannot be patched in place", name=n
                )
            low = bisect.bisect_right(offsets, low_g) - 1
            high = bisect.bisect_right(offsets, high_g) - 1
            for k in range(low, high + 1):
                if low == high:
                    c, rk = g, r
                else:
                    sel = ((g >= offsets[k]) & (g < offsets[k + 1])).nonzero().squeeze(1)
                    c, rk = g[sel], r[sel]
                if c.numel():
                    spec = members[k]
                    self.targets[spec.name].extend(_fit(self.params[n], n, spec, c - offsets[k], rk))

    def owned(self) -> dict[str, list[Any]]:
        return {name: [t.describe() for t in ts] for name, ts in self.targets.items()}


def _layer_token(name: str) -> str | None:
    match = _LAYER_TOKEN.search(name)
    return match.group(1) if match else None


def _runtime_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter, with the plain weight standing in for a packed one."""
    params = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        if module in _PACKED:
            params[f"{module_name}.weight" if module_name else "weight"] = _PACKED[module][0]
    seen: set[int] = set()
    unique = {}
    for name, p in params.items():
        if id(p) not in seen:
            seen.add(id(p))
            unique[name] = p
    return unique


class _plain_weights_attached:
    """While probing, put packed layers' plain weights back where the loaders look for them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.swapped: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []

    def __enter__(self) -> None:
        for module in self.model.modules():
            if module in _PACKED and _PACKED[module][1]:
                self.swapped.append((module, module.weight))
                module.weight = _PACKED[module][0]

    def __exit__(self, *exc: object) -> None:
        for module, packed in self.swapped:
            module.weight = packed


# ---------------------------------------------------------------------- the extension


class DeltaSyncWorkerExtension:
    """Methods vLLM mixes into every worker; called through ``collective_rpc``.

    Arguments and results are strings or JSON-able dicts (see
    :mod:`deltasync.appliers._vllm_wire`), so the same calls work in process
    and through a server's ``/collective_rpc``. The follower drives them; users
    do not call them directly.
    """

    def deltasync_init(self, specs_json: str) -> dict[str, Any]:
        """Build this rank's index map for the checkpoint tensors ``specs_json`` lists."""
        started = time.perf_counter()
        specs = specs_from_json(specs_json)
        model = self.get_model()  # type: ignore[attr-defined]
        index = _IndexMap(model, specs)
        self._deltasync_index = index
        self._deltasync_dtypes = {s.name: s.torch_dtype for s in specs}
        self._deltasync_version: int | None = getattr(self, "_deltasync_version", None)
        packed = sorted(n for n, m in model.named_modules() if m in _PACKED)
        if packed:
            logger.warning(
                "deltasync: %d CPU-packed layers are patched through a host copy and re-packed per apply "
                "(set %s=1 to patch them in place): %s", len(packed), PLAIN_WEIGHTS_ENV, ", ".join(packed[:8]),
            )
        tables = sorted({t.param_name for ts in index.targets.values() for t in ts if t.table is not None})
        return {
            "rank": _rank(self),
            "owned": index.owned(),
            "counts": {n: sum(t.count for t in ts) for n, ts in index.targets.items()},
            "cpu_hooks": _CPU_HOOK_MODE,
            "repacked_layers": packed,
            "tables": tables,
            "ms": 1e3 * (time.perf_counter() - started),
        }

    def deltasync_lookup(self, payload: bytes | str) -> dict[str, Any]:
        """Current bits at the requested checkpoint indices this rank owns.

        ``payload``: ``{name: {"idx": int64}}``. Result ``data``: ``{name: {"pos": int64
        positions into idx, "bits": int16/int32}}``.
        """
        index = _require_index(self)
        out: dict[str, dict[str, np.ndarray]] = {}
        for name, parts in unpack(payload).items():
            targets = index.targets.get(name)
            if targets is None:
                raise TensorMismatch(f"unknown tensor {name!r}", name=name)
            spec = index.specs[name]
            idx = _checked_indices(parts.get("idx"), spec)
            pos_all, bits_all = [], []
            covered = torch.zeros(idx.numel(), dtype=torch.bool) if len(targets) > 1 else None
            for target in targets:
                data = target.param.data
                pos, runtime = target.translate(idx.to(data.device))
                pos_cpu = torch.arange(idx.numel()) if pos is None else pos.cpu()
                if covered is not None:  # an element replicated in two places is read once
                    fresh = ~covered[pos_cpu]
                    pos_cpu, runtime = pos_cpu[fresh], runtime[fresh.to(runtime.device)]
                    covered[pos_cpu] = True
                picked = data.view(-1)[runtime]
                if picked.dtype != spec.torch_dtype:
                    picked = picked.to(spec.torch_dtype)
                pos_all.append(pos_cpu)
                bits_all.append(picked.view(bits_dtype(spec.torch_dtype)).cpu())
            out[name] = {
                "pos": torch.cat(pos_all).numpy() if pos_all else np.zeros(0, np.int64),
                "bits": torch.cat(bits_all).numpy() if bits_all else np.zeros(0, _np_bits(spec)),
            }
        return {"rank": _rank(self), "data": pack(out, text=isinstance(payload, str))}

    def deltasync_apply(self, payload: bytes | str, version: int | str | None = None) -> dict[str, Any]:
        """Write ``{name: {"idx": int64, "val": bits}}`` where this rank holds it (``idx`` absent: whole tensor).

        Every entry is checked (names, bounds, sizes, dtypes) before the first write.
        """
        started = time.perf_counter()
        index = _require_index(self)
        patches = []
        for name, parts in unpack(payload).items():
            spec = index.specs.get(name)
            if spec is None:
                raise TensorMismatch(f"unknown tensor {name!r}; this engine does not hold it", name=name)
            values = parts.get("val")
            if values is None or values.dtype != _np_bits(spec) or values.ndim != 1:
                raise TensorMismatch(f"{name}: values must be 1-D {_np_bits(spec)}", name=name)
            if not values.flags.writeable:
                values = values.copy()
            if "idx" in parts:
                idx = _checked_indices(parts["idx"], spec)
            elif values.size == spec.numel:
                idx = None
            else:
                raise TensorMismatch(f"{name}: {values.size} values for {spec.numel} elements", name=name)
            if idx is not None and idx.numel() != values.size:
                raise TensorMismatch(f"{name}: {idx.numel()} indices but {values.size} values", name=name)
            patches.append((name, spec, idx, torch.from_numpy(values)))
        written, touched = 0, set()
        with torch.no_grad():
            for name, spec, idx, values in patches:
                for target in index.targets[name]:
                    written += _write(target, spec, idx, values)
                    touched.add(id(target.param))
            repacked = [m for m, (w, _) in list(_PACKED.items()) if id(w) in touched]
            for module in repacked:
                _repack(module)
        if version is not None:
            self._deltasync_version = int(version)
        return {
            "rank": _rank(self),
            "written": written,
            "repacked": len(repacked),
            "ms": 1e3 * (time.perf_counter() - started),
        }

    def deltasync_version(self) -> dict[str, Any]:
        """The deltasync version this rank last applied (``None`` before the first)."""
        return {"rank": _rank(self), "version": getattr(self, "_deltasync_version", None)}

    def deltasync_gather(self, name: str, text: bool = False) -> dict[str, Any]:
        """Every element of checkpoint tensor ``name`` this rank holds, read through the map (for tests).

        Result ``data``: ``{name: {"idx": int64 checkpoint indices, "bits": ...}}``. O(numel).
        """
        index = _require_index(self)
        spec = index.specs[name]
        idx = torch.arange(spec.numel, dtype=torch.int64)
        return self.deltasync_lookup(pack({name: {"idx": idx.numpy()}}, text=text)) | {"numel": spec.numel}


def _write(target: _Target, spec: TensorSpec, idx: torch.Tensor | None, values: torch.Tensor) -> int:
    data = target.param.data
    if idx is None:
        idx = torch.arange(spec.numel, dtype=torch.int64)
    pos, runtime = target.translate(idx.to(data.device))
    if pos is not None and not pos.numel():
        return 0
    vals = values.to(data.device)
    if pos is not None:
        vals = vals[pos]
    flat = data.view(-1)
    if data.dtype == spec.torch_dtype:
        flat.view(bits_dtype(data.dtype)).index_copy_(0, runtime, vals)
    else:
        flat.index_copy_(0, runtime, vals.view(spec.torch_dtype).to(data.dtype))
    return int(runtime.numel())


def _checked_indices(raw: np.ndarray | None, spec: TensorSpec) -> torch.Tensor:
    if raw is None or raw.dtype != np.int64 or raw.ndim != 1:
        raise TensorMismatch(f"{spec.name}: indices must be 1-D int64", name=spec.name)
    idx = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= spec.numel):
        raise TensorMismatch(f"{spec.name}: index out of range [0, {spec.numel})", name=spec.name)
    return idx


def _np_bits(spec: TensorSpec) -> np.dtype:
    return np.dtype(np.int16) if spec.torch_dtype.itemsize == 2 else np.dtype(np.int32)


def _require_index(worker: Any) -> _IndexMap:
    index = getattr(worker, "_deltasync_index", None)
    if index is None:
        raise RuntimeError("deltasync: no index map in this worker; call deltasync_init first")
    return index


def _rank(worker: Any) -> int:
    return int(getattr(worker, "rank", 0))
