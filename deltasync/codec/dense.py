"""``dense``: the whole tensor, for tensors where most elements changed.

Part ``val`` holds every element of the new tensor in the published dtype and
its full shape. The publisher picks it automatically when indexing the changes
would cost more than sending the tensor (see ``DENSE_FRACTION`` in
:mod:`deltasync.publish.diff.snapshot`); it is also how anchors carry tensors.
"""

from __future__ import annotations

from ..tensors import TensorChange, TensorSpec
from .base import BaseLookup, Codec, Decoded, Encoded, Params, Parts, check_part, value_bits


class DenseCodec(Codec):
    """Every element, in the published dtype."""

    name = "dense"
    streams = frozenset({"val"})

    def supports(self, change: TensorChange) -> bool:
        return change.dense

    def encode(self, change: TensorChange, *, level: int) -> Encoded:
        if not change.dense:
            raise ValueError("the dense codec carries changes captured whole (dense=True)")
        return Encoded(parts={"val": change.values.view(change.spec.torch_dtype).view(change.spec.shape)})

    def decode(self, parts: Parts, params: Params, spec: TensorSpec, nnz: int, base: BaseLookup | None) -> Decoded:
        val = check_part(parts, "val", spec.torch_dtype, spec.shape, spec)
        return Decoded(None, value_bits(val, spec))
