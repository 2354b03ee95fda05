"""Loader stand-ins for parameters that vLLM's post-processing re-created without their weight loaders.

After loading, a quantized layer's ``process_weights_after_loading`` replaces its parameters (the block-fp8
``weight`` and ``weight_scale_inv``: vLLM's loader classes, with ``load_qkv_weight`` and the like) by plain
``Parameter`` objects over the same bytes. The probe (:mod:`.mapping`) must still run the loaders to see
where each checkpoint element lands, so it borrows what vLLM itself records for reloading weights: the
parameters as the layer created them, kept as meta tensors (``record_metadata_for_reloading``, vLLM 0.32).
Each stand-in is that parameter, of its class and with its loader, on the runtime parameter's device;
the probe puts it where the loaders look, fills it with scratch, and maps what lands in it onto the
runtime parameter. A layer whose post-processing changed the layout (a transpose, a repack) is mapped
onto bytes that do not read back as the checkpoint: the proof refuses it (:mod:`..verify`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["recorded_stand_ins", "stand_ins_attached"]


def recorded_stand_ins(
    model: torch.nn.Module, params: Mapping[str, torch.nn.Parameter]
) -> dict[str, tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """Per runtime parameter name in ``params`` that post-processing re-created as another class of the same
    shape: its layer, its name there, and a stand-in of the class the layer created (without storage of its
    own until the probe gives it scratch). Empty where vLLM recorded nothing (versions without reloading)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError:
        return {}
    found: dict[str, tuple[torch.nn.Module, str, torch.nn.Parameter]] = {}
    for prefix, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is None:
            continue
        recorded, _ = info.restore_metadata
        for name, meta in recorded.items():
            full = f"{prefix}.{name}" if prefix else name
            current = layer._parameters.get(name)
            if full not in params or current is None or type(current) is type(meta):
                continue
            if tuple(current.shape) != tuple(meta.shape):
                continue  # a layout post-processing changed: nothing to stand in for
            stand = _on(meta, current.device)
            found[full] = (layer, name, restore_layer_refs(stand, layer))
    return found


def _on(meta: torch.Tensor, device: torch.device) -> Any:
    """A zero-stride tensor of ``meta``'s class, shape and attributes on ``device`` (no storage per element)."""
    stand = torch.zeros(1, dtype=meta.dtype, device=device).expand(tuple(meta.shape))
    stand.__class__ = meta.__class__
    stand.__dict__ = meta.__dict__.copy()
    return stand


@contextlib.contextmanager
def stand_ins_attached(stand_ins: Mapping[str, tuple[torch.nn.Module, str, torch.nn.Parameter]]) -> Iterator[None]:
    """Put each stand-in where the loaders look for its parameter, and the runtime parameter back on exit."""
    kept = {full: layer._parameters[name] for full, (layer, name, _) in stand_ins.items()}
    try:
        for layer, name, stand in stand_ins.values():
            layer._parameters[name] = stand
        yield
    finally:
        for full, (layer, name, _) in stand_ins.items():
            layer._parameters[name] = kept[full]
