"""``raw``: int32 flat indices and plain values, uncompressed.

The layout of the public TRL prototype: part ``idx`` is an ``I32`` array of flat
indices, part ``val`` holds the new elements in the published dtype (``BF16``).
Any safetensors reader can use it without deltasync, which makes it the codec
for interoperability and the baseline every other codec is measured against.
Tensors of 2**31 elements or more need another codec.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CodecError
from ..tensors import TensorChange, TensorSpec
from .base import BaseLookup, Codec, Decoded, Encoded, Params, Parts, check_indices, check_part, to_numpy, value_bits

_I32_LIMIT = 2**31


class RawCodec(Codec):
    """int32 indices + values in the published dtype."""

    name = "raw"

    def supports(self, change: TensorChange) -> bool:
        return not change.dense and change.spec.numel < _I32_LIMIT

    def encode(self, change: TensorChange, *, level: int) -> Encoded:
        assert change.indices is not None
        return Encoded(
            parts={
                "idx": change.indices.to(torch.int32),
                "val": change.values.view(change.spec.torch_dtype),
            }
        )

    def decode(self, parts: Parts, params: Params, spec: TensorSpec, nnz: int, base: BaseLookup | None) -> Decoded:
        idx = check_part(parts, "idx", torch.int32, (nnz,), spec)
        val = check_part(parts, "val", spec.torch_dtype, (nnz,), spec)
        if spec.numel >= _I32_LIMIT:
            raise CodecError(f"{spec.name}: too large for the raw codec", name=spec.name)
        indices = check_indices(to_numpy(idx), spec)
        values = value_bits(val, spec)
        return Decoded(indices, np.ascontiguousarray(values))
