"""Checkpoint names for a trainer's module: zero-copy views in the layout its checkpoints use.

transformers 5 keeps some weights in memory in another layout than its
checkpoints and the engines that load them: Mixture-of-Experts models hold
every expert of a layer in one fused parameter
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``)
while ``save_pretrained``, vLLM's loaders and the replica's index map use one
tensor per expert (``mlp.experts.{e}.gate_proj.weight [I, H]``, ...).
deltasync publishes in the checkpoint's names, so a replica follows the same
tensors it loaded, and a delta names the experts it touches.

:func:`checkpoint_views` learns the layout from transformers' own save-time
conversion (``revert_weight_conversion``), without copying weights: each
converted parameter is run once through the conversion as a tensor of its own
flat indices, and every checkpoint tensor that comes out must be an affine view
(offset and strides) of that one parameter. The views are then built with
``as_strided`` on the live parameter, so publishing reads the trainer's memory
directly (no per-element tables, no copies). The plan is learned once per
module and kept while the module lives.

Limitations:

- Only plain, unsharded transformers models are converted: a model with a
  DTensor, ZeRO-3 or non-contiguous parameter, or a checkpoint tensor that
  combines several parameters, keeps the module's own names (the last case
  logged), and a replica that loaded a checkpoint with other names then
  refuses the run with ``FingerprintMismatch``. Sharded dense models are
  unaffected: their names are their checkpoint's.
- The learning pass allocates one int32 (int64 past 2**31 elements) index
  tensor the size of the largest converted parameter, once.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

__all__ = ["View", "checkpoint_plan", "checkpoint_views"]

logger = logging.getLogger("deltasync")


@dataclass(frozen=True, slots=True)
class View:
    """A checkpoint tensor as an affine view of one parameter (row-major flat offsets)."""

    source: str
    """The module's parameter name."""
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """Flat offset of the view's first element in the parameter."""


_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, View] | None] = weakref.WeakKeyDictionary()


def checkpoint_plan(model: torch.nn.Module) -> dict[str, View] | None:
    """Checkpoint name -> :class:`View`, or ``None`` when the module's names are its checkpoint's."""
    if model not in _PLANS:
        _PLANS[model] = _learn(model)
    return _PLANS[model]


def checkpoint_views(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]] | None:
    """``(checkpoint name, view)`` of every published tensor, or ``None`` when nothing is converted."""
    plan = checkpoint_plan(model)
    params = dict(model.named_parameters())
    if plan is not None and any(view.source not in params for view in plan.values()):
        _PLANS[model] = plan = _learn(model)  # the module changed in place (an adapter was wrapped in)
    if plan is None:
        return None

    def views() -> Iterator[tuple[str, torch.Tensor]]:
        for name, view in plan.items():
            param = params[view.source].detach()
            yield name, param.as_strided(view.size, view.stride, param.storage_offset() + view.offset)

    return views()


def _learn(model: torch.nn.Module) -> dict[str, View] | None:
    if "transformers" not in sys.modules or not hasattr(model, "config"):
        return None  # not a transformers model: its names are its checkpoint's
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    params = dict(model.named_parameters())
    if not all(_convertible(p) for p in params.values()):
        # Sharded parameters (DTensor, DeepSpeed ZeRO-3 slices) are published by the sharded path,
        # which needs the parameters themselves; fused layouts there keep their module names.
        return None
    meta = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in params.items()}
    try:
        converted = revert_weight_conversion(model, dict(meta))
    except Exception as exc:  # an architecture transformers cannot revert: publish its own names
        logger.warning("deltasync: publishing module names; transformers could not name the checkpoint (%s)", exc)
        return None
    if converted.keys() == params.keys() and all(converted[n] is meta[n] for n in params):
        return None  # the module's names are its checkpoint's (in whatever order)
    plan: dict[str, View] = {}
    for name, param in params.items():
        if name in converted and converted[name] is meta[name]:
            plan[name] = View(name, tuple(param.shape), tuple(param.stride()), 0)
            continue
        views = _probe(model, name, param)
        if views is None:
            logger.warning("deltasync: publishing module names; %s is not a view in the checkpoint", name)
            return None
        plan.update(views)
    order = {ckpt: i for i, ckpt in enumerate(converted)}
    return dict(sorted(plan.items(), key=lambda item: order.get(item[0], len(order))))


def _convertible(param: torch.Tensor) -> bool:
    """A plain, whole, contiguous parameter (not a DTensor, not a ZeRO-3 slice holder, not on meta)."""
    return (
        type(param.data) is torch.Tensor
        and not hasattr(param, "ds_tensor")
        and param.is_contiguous()
        and param.device.type != "meta"
    )


def _probe(model: torch.nn.Module, name: str, param: torch.Tensor) -> dict[str, View] | None:
    """Run ``name`` through the reverse conversion as its own flat indices; fit each output as a view."""
    from transformers.core_model_loading import revert_weight_conversion

    dtype = torch.int32 if param.numel() < 2**31 else torch.int64
    index = torch.arange(param.numel(), dtype=dtype)
    try:
        out = revert_weight_conversion(model, {name: index.view(param.shape)})
    except Exception:
        return None
    views = {}
    for ckpt, tensor in out.items():
        view = _fit(name, index, tensor)
        if view is None:
            return None
        views[ckpt] = view
    return views


def _fit(source: str, index: torch.Tensor, tensor: torch.Tensor) -> View | None:
    """``tensor`` (values are flat indices into ``index``) as offset + strides, verified element by element."""
    if tensor.dtype != index.dtype or not tensor.numel():
        return None
    flat = tensor.reshape(-1)
    offset = int(flat[0])
    stride = []
    for d, n in enumerate(tensor.shape):
        unit = [0] * tensor.dim()
        if n > 1:
            unit[d] = 1
        stride.append(int(tensor[tuple(unit)]) - offset if n > 1 else 0)
    if any(s < 0 for s in stride) or offset + sum((n - 1) * s for n, s in zip(tensor.shape, stride)) >= index.numel():
        return None
    expected = index.as_strided(tuple(tensor.shape), tuple(stride), offset)
    if not torch.equal(expected, tensor):
        return None
    return View(source, tuple(tensor.shape), tuple(stride), offset)

