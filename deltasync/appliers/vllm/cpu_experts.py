"""Parameter layout, vLLM CPU backend: fused expert weights prepacked for the grouped-GEMM kernel.

vLLM's CPU MoE kernel (``CPUUnquantizedExperts``) pads the expert intermediate
size, then *prepacks* ``w13_weight [E, 2*I_pad, H]`` and ``w2_weight [E, H,
I_pad]`` after loading: the same fixed permutation of the elements inside each
expert, chosen by the kernel's ISA. The weight loaders (and so the mapping
probe) address the plain, unpacked layout; the kernel reads the packed one.
Writing through plain indices lands every patch in the wrong place.

This module makes those parameters patchable in place, O(changed elements):

- :func:`install_expert_hooks` wraps vLLM's ``cpu_prepack_moe_weight`` before
  the model loads (the worker extension calls it on import) and tags each packed
  tensor with the ISA it was packed for; vLLM's ``replace_parameter`` carries
  the tag onto the new parameter.
- :func:`prepack_permutation` probes the kernel's permutation once per
  (expert shape, dtype, ISA) by packing digit-valued tensors through the real
  op (integers below 256 are exact in bf16, so three passes cover 2**24
  elements), then checks it is a bijection, moves bits unchanged (random
  values) and is the same for every expert (two experts packed together).
- :data:`PACKED_EXPERTS` is the registered layout that claims tagged
  parameters: plain runtime flat index ``r`` of expert ``e = r // S`` lives at
  ``e * S + perm[r % S]`` in the packed tensor. Reads and writes are
  ``index_select`` / ``index_copy_`` at those positions.

Limitations:

- The permutation costs one int64 per element of *one* expert (for a
  30B-A3B expert, ``w13`` is 2 x 768 x 2048: 25 MB), kept per shape.
- Quantized packing (``cpu_prepack_moe_weight_int8``) is not claimed: those
  parameters fall to the plain layout and the replica's proof refuses them.
- The zentorch MoE path does not prepack; its parameters stay plain.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from ...tensors import bits_view
from ..mapping import PLAIN, Layout, register_layout

__all__ = ["PREPACK_ATTR", "PACKED_EXPERTS", "install_expert_hooks", "prepack_permutation", "packed_isa"]

PREPACK_ATTR = "deltasync_prepacked_isa"
"""Attribute set on every tensor vLLM's CPU MoE prepack returns: the ISA it was packed for."""

_ORIGINAL_PREPACK: Any = None
_WHEN: Callable[[], bool] | None = None  # which engines' experts are tagged (None: every engine)
_INSTALLED = False
# data_ptr of a claimed packed parameter -> its ISA (filled when a map claims the parameter).
_ISA_AT: dict[int, str] = {}


def _tagging_prepack(weight: torch.Tensor, isa: str) -> torch.Tensor:
    out = _ORIGINAL_PREPACK(weight, isa)
    if _WHEN is None or _WHEN():
        setattr(out, PREPACK_ATTR, isa)
    return out


def install_expert_hooks(when: Callable[[], bool] | None = None) -> bool:
    """Wrap vLLM's CPU MoE prepack so packed expert tensors carry their ISA; ``False`` without vllm.

    ``when``: tag only the tensors of engines it says ``True`` for (``None``: every engine; once so, it
    stays so), as :func:`~.cpu_hooks.install_cpu_hooks`. Must run before the model loads (tensors packed
    earlier carry no tag, stay claimed by the plain layout, and the replica's proof refuses them).
    """
    global _ORIGINAL_PREPACK, _WHEN, _INSTALLED
    try:
        import vllm._custom_ops as ops
    except Exception:  # vllm missing or built without CPU ops: nothing to hook
        return False
    if _ORIGINAL_PREPACK is None:
        _ORIGINAL_PREPACK = getattr(ops, "cpu_prepack_moe_weight", None)
        if _ORIGINAL_PREPACK is None:
            return False
    _WHEN = None if when is None or (_INSTALLED and _WHEN is None) else when
    # cpu_moe.py imports the function by name; rebind every module-level copy (read __dict__: lazy modules).
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("cpu_prepack_moe_weight") is _ORIGINAL_PREPACK:
            namespace["cpu_prepack_moe_weight"] = _tagging_prepack
    _INSTALLED = True
    return True


def packed_isa(param: torch.Tensor) -> str | None:
    """The ISA ``param`` was prepacked for by vLLM's CPU MoE kernel, or ``None``."""
    isa = getattr(param, PREPACK_ATTR, None)
    return isa if isinstance(isa, str) and param.dim() == 3 else None


def _exact_integers(dtype: torch.dtype) -> int:
    """Every integer in ``[0, n)`` is exact in ``dtype``."""
    mantissa = round(-math.log2(torch.finfo(dtype).eps))  # stored significand bits: 7 for bf16
    return 1 << (mantissa + 1)


@functools.lru_cache(maxsize=None)
def prepack_permutation(shape: tuple[int, int], dtype: torch.dtype, isa: str) -> torch.Tensor:
    """``perm[r]``: where plain flat index ``r`` of one ``shape`` expert lands once packed for ``isa``.

    Probed through the real prepack op, then checked: a bijection, bits moved
    unchanged, the same inside every expert.

    Raises:
        `RuntimeError`: the op is missing, or is not a per-expert permutation of the elements.
    """
    prepack = _ORIGINAL_PREPACK
    if prepack is None:
        raise RuntimeError("vLLM's cpu_prepack_moe_weight is not available; call install_expert_hooks first")
    n, k = shape
    size = n * k
    base = _exact_integers(dtype)
    plain = torch.arange(size, dtype=torch.int64)
    source = torch.zeros(size, dtype=torch.int64)  # packed position -> plain index stored there
    scale = 1
    while True:  # one pass per base-``base`` digit of the plain index
        values = ((plain // scale) % base).to(dtype).view(1, n, k)
        source += prepack(values, isa).reshape(-1).to(torch.int64) * scale
        scale *= base
        if scale >= size:
            break
    if not torch.equal(torch.sort(source).values, plain):
        raise RuntimeError(f"vLLM's CPU MoE prepack ({isa}, {list(shape)}) is not a permutation of the elements")
    # Bits move unchanged, and two experts packed together are packed one by one.
    sample = torch.randn(2, n, k).to(dtype)
    packed = prepack(sample, isa).reshape(2, -1)
    expected = sample.reshape(2, -1)[:, source]
    if not torch.equal(bits_view(packed), bits_view(expected)):
        raise RuntimeError(f"vLLM's CPU MoE prepack ({isa}, {list(shape)}) changes values or mixes experts")
    perm = torch.empty_like(source)
    perm[source] = plain
    return perm


def _positions(data: torch.Tensor, runtime: torch.Tensor) -> torch.Tensor:
    isa = _ISA_AT.get(data.data_ptr())
    if isa is None:
        raise RuntimeError("deltasync: a packed expert parameter was replaced since its map was built")
    _, n, k = data.shape
    size = n * k
    perm = prepack_permutation((n, k), data.dtype, isa).to(runtime.device)
    within = runtime % size
    return (runtime - within).add_(perm[within])


def _claims(name: str, param: torch.nn.Parameter) -> bool:
    isa = packed_isa(param)
    if isa is None or not param.is_contiguous():
        return False
    _ISA_AT[param.data_ptr()] = isa
    return True


PACKED_EXPERTS = Layout(
    name="vllm-cpu-packed-experts",
    claims=_claims,
    read=lambda data, runtime, published: PLAIN.read(data, _positions(data, runtime), published),
    write=lambda data, runtime, bits, published: PLAIN.write(data, _positions(data, runtime), bits, published),
)

register_layout(PACKED_EXPERTS)
