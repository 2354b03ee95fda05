"""What a reader checks of a block-fp8 view's values (docs/FORMAT.md, "Block fp8").

The reference quantizer never writes an e4m3 NaN (its input is finite and clamped to 448) and never a
scale that is not a positive finite float32, so a file that holds one was not written by the rule, and a
replica that applied it would serve a poisoned layer: the decoded values of every ``F8_E4M3`` tensor and
of every ``F32`` tensor named ``<T>_scale_inv`` are checked before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..codec import Decoded
from ..errors import CodecError
from ..tensors import TensorSpec
from ..tensors.fp8 import FP8_DTYPE, SCALE_SUFFIX

__all__ = ["check_quantized"]

# e4m3fn's NaN patterns are S.1111.111 (0x7F, 0xFF): the low seven bits all set.
_NAN_BITS = 0x7F
# float32 bit patterns of positive finite values: the sign clear, the exponent not all ones, not zero.
_F32_INF = 0x7F800000


def check_quantized(specs: Mapping[str, TensorSpec], decoded: Mapping[str, Decoded]) -> None:
    """Refuse decoded e4m3 NaNs and block scales that are not positive and finite.

    Raises:
        `CodecError`: naming the first such tensor.
    """
    for name, patch in decoded.items():
        spec = specs[name]
        dtype = spec.torch_dtype
        if dtype == FP8_DTYPE:
            if _any(patch.values, lambda v: (v & _NAN_BITS) == _NAN_BITS):
                raise CodecError(f"{name}: an e4m3 NaN, which no block-fp8 view holds; the file is refused",
                                 name=name)
        elif dtype == torch.float32 and name.endswith(SCALE_SUFFIX):
            if _any(patch.values, lambda v: (v <= 0) | (v >= _F32_INF)):
                raise CodecError(f"{name}: a block scale that is not a positive finite float32; the file is "
                                 "refused", name=name)


def _any(values: np.ndarray | torch.Tensor, test: object) -> bool:
    """Whether ``test`` holds for any of the bit patterns ``values`` (signed integers of the element width)."""
    if isinstance(values, torch.Tensor):
        return bool(test(values).any())  # type: ignore[operator]
    return bool(np.any(test(values)))  # type: ignore[operator]
