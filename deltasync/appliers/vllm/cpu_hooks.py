"""Transport, worker side: vLLM CPU-backend hooks that keep packed Linear weights patchable.

vLLM's CPU backend repacks Linear weights after loading (oneDNN / sgl kernels)
and leaves ``layer.weight`` empty, so they cannot be patched where vLLM
computes with them. :func:`install_cpu_hooks` replaces vLLM's CPU GEMM dispatch
before the model loads (the worker extension module calls it on import), in
one of two modes:

- ``plain``: ``DELTASYNC_VLLM_PLAIN_WEIGHTS=1`` in the workers' environment
  keeps 2-D Linear weights plain (``torch.nn.functional.linear``): every layer
  is patched in place. Slower matmuls on CPU; this is what the tests use.
- ``stash`` (default): layers are packed as vLLM does, but each packed layer's
  plain weight is kept on the host (about one more copy of the Linear
  weights). The mapping layer probes and the apply layer patches that copy
  (:func:`plain_weights`, :class:`plain_weights_attached`), and
  :func:`repack_touched` re-runs vLLM's packing for the layers an apply
  touched: O(size of the touched layers), not O(changed elements). A tied
  ``lm_head`` shares the embedding, and its packed copy is rebuilt with it.

Limitations:

- Off the CPU platform, or without vllm, nothing is installed.
- Only unquantized GEMM dispatch is hooked; causal-conv weights packed by the
  CPU backend are not, and their loaders fail the probe (refused by name).
- The hooks must be installed before the model loads; layers packed earlier
  are not seen.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "PLAIN_WEIGHTS_ENV",
    "install_cpu_hooks",
    "packed_layer_names",
    "plain_weights",
    "plain_weights_attached",
    "repack_touched",
]

PLAIN_WEIGHTS_ENV = "DELTASYNC_VLLM_PLAIN_WEIGHTS"

# Layers whose weights the CPU backend packed: layer -> (plain weight Parameter, remove_weight).
_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.nn.Parameter, bool]] = weakref.WeakKeyDictionary()
_ORIGINAL_DISPATCH: Any = None
_WHEN: Callable[[], bool] | None = None  # which engines get deltasync's dispatch (None: every engine)
_INSTALLED = False


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


def install_cpu_hooks(when: Callable[[], bool] | None = None) -> str | None:
    """Replace vLLM's CPU GEMM dispatch (plain or stashing); returns the mode installed.

    Args:
        when (`Callable[[], bool]`, *optional*): asked as each layer is packed: deltasync's dispatch for the
            engines it says ``True`` for, vLLM's own for the others (the plugin passes "this engine selects the
            deltasync backend"). ``None``: every engine of this process (the worker extension, named by the
            engine's own flags). Once installed for every engine, it stays so.

    Called before the model loads: the worker extension module calls it on import, the plugin when vLLM
    loads it. Does nothing without vllm or off the CPU platform.
    """
    global _ORIGINAL_DISPATCH, _WHEN, _INSTALLED
    try:
        import vllm.model_executor.layers.utils as utils
        from vllm.platforms import current_platform
    except Exception:  # vllm missing or broken: nothing to hook
        return None
    if not current_platform.is_cpu():
        return None
    if _ORIGINAL_DISPATCH is None:
        _ORIGINAL_DISPATCH = utils.dispatch_cpu_unquantized_gemm
    _WHEN = None if when is None or (_INSTALLED and _WHEN is None) else when
    # linear.py and vocab_parallel_embedding.py import the function at call time;
    # rebind any module-level copy too (read __dict__: lazy modules import on getattr).
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("dispatch_cpu_unquantized_gemm") is _ORIGINAL_DISPATCH:
            namespace["dispatch_cpu_unquantized_gemm"] = _dispatch
    _INSTALLED = True
    return _mode()


def _mode() -> str:
    return "plain" if os.environ.get(PLAIN_WEIGHTS_ENV, "").lower() in ("1", "true", "yes") else "stash"


def _dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """vLLM's CPU GEMM dispatch where deltasync keeps weights patchable (:func:`install_cpu_hooks`)."""
    if _WHEN is not None and not _WHEN():
        _ORIGINAL_DISPATCH(layer, remove_weight)
    elif _mode() == "plain":
        _plain_dispatch(layer, remove_weight)
    else:
        _stashing_dispatch(layer, remove_weight)


def packed_layer_names(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s layers whose weights were packed and are patched through a host copy (sorted)."""
    return sorted(n for n, m in model.named_modules() if m in _PACKED)


def plain_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``"<layer>.weight"`` -> the plain host weight, for every packed layer of ``model``.

    These stand in for the packed parameters in the index map: probes and
    patches reach the host copy, and :func:`repack_touched` refreshes the kernel's.
    """
    return {
        f"{module_name}.weight" if module_name else "weight": _PACKED[module][0]
        for module_name, module in model.named_modules()
        if module in _PACKED
    }


def repack_touched(params: Iterable[torch.nn.Parameter]) -> int:
    """Re-run vLLM's packing for every layer whose plain weight is among ``params``; returns how many."""
    touched = {id(p) for p in params}
    layers = [m for m, (w, _) in list(_PACKED.items()) if id(w) in touched]
    for layer in layers:
        _repack(layer)
    return len(layers)


def _repack(layer: torch.nn.Module) -> None:
    """Re-run vLLM's packing for ``layer`` from its (patched) plain weight."""
    weight, remove = _PACKED[layer]
    if remove:
        layer.weight = weight
    _ORIGINAL_DISPATCH(layer, remove)


class plain_weights_attached:
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
