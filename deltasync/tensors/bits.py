"""Bit patterns: floats compared and written as the integers of the same width, never as floats.

Change detection and patching work on the *bit patterns* of floating-point
elements (``int8`` views of e4m3, ``int16`` of bf16/fp16, ``int32`` of fp32), never on
float values: float ``!=`` misses ``-0.0 -> +0.0`` and calls every NaN changed.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["BITS_BY_SIZE", "EXPONENT_SHIFT", "NUMPY_BITS_BY_SIZE", "SCATTERED", "bits_dtype", "bits_view", "write_at"]

BITS_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}
"""The signed integer dtype holding the bit patterns of a float of this many bytes."""

NUMPY_BITS_BY_SIZE = {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32)}
"""The same as numpy dtypes."""

EXPONENT_SHIFT = {1: 3, 2: 7, 4: 23}
"""Per element width in bytes, the shift that brings a bit pattern's exponent to the low bits: the stored
mantissa bits of e4m3, bf16 and fp32 (fp16 shares bf16's, as the codecs' exponent classes always have)."""


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The signed integer dtype with the same width as ``dtype``."""
    return BITS_BY_SIZE[dtype.itemsize]


def bits_view(tensor: torch.Tensor) -> torch.Tensor:
    """Reinterpret a floating tensor's storage as integers of the same width (no copy)."""
    return tensor.view(bits_dtype(tensor.dtype))


SCATTERED = 20
"""On the CPU, writes of fewer than one element in this many go through ``index_put_``."""


def write_at(flat: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``flat[index] = values`` in place, for a 1-D ``flat`` and unique ``index`` on its device.

    Both of torch's kernels are exact here (indices are unique, so ``index_put_``'s unspecified
    order among duplicates never arises); they differ in speed on the CPU. For scattered writes
    (0.1-3 % of a tensor's elements, the density of RL steps) ``index_put_`` spreads the cache misses over
    torch's threads and beats ``index_copy_`` into weights not in cache, while ``index_copy_`` stays ahead
    for denser writes (``benchmarks/throughput.py`` and ``benchmarks/device_sync.py`` time both). Other
    devices keep ``index_copy_``.
    """
    if flat.device.type == "cpu" and index.numel() * SCATTERED < flat.numel():
        flat.index_put_((index,), values)
    else:
        flat.index_copy_(0, index, values)
