"""``dense``: the whole tensor, for tensors where most elements changed.

Part ``val`` holds every element of the new tensor in the published dtype and
its full shape. The publisher picks it automatically when indexing the changes
would cost more than sending the tensor (see ``DENSE_FRACTION`` in
:mod:`deltasync.diff`); it is also how anchors carry tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..diff import TensorChange
from ..tensors import TensorSpec, bits_dtype
from .base import BaseLookup, Codec, Decoded, Encoded, check_part, to_numpy


class DenseCodec(Codec):
    """Every element, in the published dtype."""

    name = "dense"

    def supports(self, change: TensorChange) -> bool:
        return change.dense

    def encode(self, change: TensorChange, *, level: int) -> Encoded:
        if not change.dense:
            raise ValueError("the dense codec carries changes captured whole (dense=True)")
        return Encoded(parts={"val": change.values.view(change.spec.torch_dtype).view(change.spec.shape)})

    def decode(
        self,
        parts: Mapping[str, torch.Tensor],
        params: Mapping[str, Any],
        spec: TensorSpec,
        nnz: int,
        base: BaseLookup | None,
    ) -> Decoded:
        val = check_part(parts, "val", spec.torch_dtype, spec.shape, spec)
        values = to_numpy(val.reshape(-1).view(bits_dtype(spec.torch_dtype)))
        return Decoded(None, values)
