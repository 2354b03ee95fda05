"""Mapping layer, vLLM: build a rank's :class:`~.mapping.IndexMap` by probing vLLM's weight loaders.

vLLM's per-model ``load_weights`` knows where each checkpoint element goes
(q/k/v stacked into ``qkv_proj``, gate/up into ``gate_up_proj``, row, column
and vocab shards, replicated KV heads). Instead of re-implementing that, each
worker *probes* it: for one decoder layer at a time it swaps the runtime
parameters' ``.data`` for scratch tensors filled with -1 (float32 while the
group has fewer than 2**24 elements, so every index is exact, else float64;
every other parameter gets a zero-stride trap that refuses writes), calls
``model.load_weights`` with tensors whose elements are their own global index,
reads where each checkpoint element landed, and puts the original ``.data``
objects back (the real weights are never written; the storage pointers never
change, so CUDA graphs stay valid). The landed pairs become targets through
:func:`~.mapping.fit_targets`. Elements owned by other ranks do not map here.

Parameters that a kernel keeps elsewhere (the CPU backend's packed Linear
weights) are probed through stand-ins the caller passes: :mod:`.cpu_hooks`
provides the plain host copies and puts them back where the loaders look
while the probe runs. Parameters that a quantized layer's post-processing
re-created without their loaders (block fp8) are probed through the
parameters vLLM recorded for reloading (:mod:`.recorded`).

Limitations:

- Loaders that transform values arithmetically (scaling, permutation by math)
  are refused, by parameter name; loaders that skip elements leave them
  unmapped (the follower refuses an engine where some element maps nowhere).
- Probing needs float32/64 scratch for one decoder layer (or the embedding
  group) at a time, and takes seconds even for a small model on one CPU core.
- Groups are found by the first ``name.<number>.`` token of a checkpoint
  name; a loader writing outside its group makes that group probe against
  every parameter (slower, logged).
"""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from ...errors import TensorMismatch
from ...tensors import TensorSpec
from ..mapping import IndexMap, fit_targets
from .recorded import recorded_stand_ins, stand_ins_attached

__all__ = ["probe_index_map", "runtime_params", "layer_token"]

logger = logging.getLogger("deltasync.vllm")

_LAYER_TOKEN = re.compile(r"(?:^|\.)([A-Za-z_][A-Za-z0-9_]*\.\d+)\.")


def layer_token(name: str) -> str | None:
    """The decoder-layer token of a parameter name (``"layers.3"``), or ``None`` outside the layers."""
    match = _LAYER_TOKEN.search(name)
    return match.group(1) if match else None


def runtime_params(
    model: torch.nn.Module, stand_ins: Mapping[str, torch.nn.Parameter] | None = None
) -> dict[str, torch.nn.Parameter]:
    """Every parameter once, by its first name, with ``stand_ins`` replacing same-named (packed) ones."""
    params = dict(model.named_parameters())
    params.update(stand_ins or {})
    seen: set[int] = set()
    unique = {}
    for name, p in params.items():
        if id(p) not in seen:
            seen.add(id(p))
            unique[name] = p
    return unique


def probe_index_map(
    model: torch.nn.Module, specs: list[TensorSpec], params: Mapping[str, torch.nn.Parameter]
) -> IndexMap:
    """This rank's map for ``specs``, probed one decoder layer at a time through ``model.load_weights``.

    Args:
        model (`torch.nn.Module`): the worker's model (its loaders are probed; its weights never change).
        specs (`list[TensorSpec]`): the checkpoint tensors.
        params (`Mapping[str, torch.nn.Parameter]`): the runtime parameters, from :func:`runtime_params`.

    Raises:
        `TensorMismatch`: a loader transforms values, or no layout claims a parameter it fills.
    """
    index = IndexMap(specs)
    groups: dict[str | None, list[TensorSpec]] = {}
    for spec in specs:
        groups.setdefault(layer_token(spec.name), []).append(spec)
    stand_ins = recorded_stand_ins(model, params)  # quantized layers' loaders, which post-processing dropped
    loaders = {n: stand for n, (_, _, stand) in stand_ins.items()}
    with stand_ins_attached(stand_ins):
        for token, members in groups.items():
            try:
                _probe(model, index, members, params, _group_params(params, token), loaders)
            except RuntimeError as exc:
                # A loader wrote outside the expected group (the trap refused it): probe against everything.
                logger.warning("deltasync: probing group %s wider (%s)", token, exc)
                _probe(model, index, members, params, set(params), loaders)
    return index


def _group_params(params: Mapping[str, torch.nn.Parameter], token: str | None) -> set[str]:
    if token is None:
        return {n for n in params if layer_token(n) is None}
    pattern = re.compile(rf"(?:^|\.){re.escape(token)}\.")
    return {n for n in params if pattern.search(n)}


def _probe(
    model: torch.nn.Module,
    index: IndexMap,
    members: list[TensorSpec],
    params: Mapping[str, torch.nn.Parameter],
    scratch_names: set[str],
    loaders: Mapping[str, torch.nn.Parameter],
) -> None:
    """Probe ``members`` with scratch in ``scratch_names`` (traps elsewhere); add what landed to ``index``.

    ``loaders``: where a runtime parameter's loader writes when that is another object (:mod:`.recorded`);
    what lands there is mapped onto the runtime parameter."""
    offsets = [int(x) for x in np.cumsum([0] + [s.numel for s in members])]
    # float32 holds every integer below 2**24 exactly: half the bytes of float64 for one decoder layer.
    dtype = torch.float32 if offsets[-1] < 2**24 else torch.float64
    probed = {n: loaders.get(n, p) for n, p in params.items()}
    saved = {n: p.data for n, p in probed.items()}
    scratch: dict[str, torch.Tensor] = {}
    try:
        for n, p in probed.items():
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
        for n, p in probed.items():
            p.data = saved[n]
    for n, buf in scratch.items():
        _collect(index, members, offsets, n, params[n], buf)


def _collect(
    index: IndexMap, members: list[TensorSpec], offsets: list[int], n: str, param: torch.nn.Parameter, buf: torch.Tensor
) -> None:
    """Add to ``index`` the checkpoint elements the probe left in scratch ``buf`` of parameter ``n``."""
    flat = buf.view(-1)
    r = (flat >= 0).nonzero().squeeze(1)
    if not r.numel():
        return
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
            index.targets[spec.name].extend(fit_targets(param, n, spec, c - offsets[k], rk))
