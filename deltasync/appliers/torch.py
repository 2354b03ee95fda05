"""Apply deltas in place into a PyTorch module (or any mapping of tensors).

Writes go through ``index_copy_`` into the existing storage of each parameter on
its own device: O(changed elements), no reallocation, so optimizers, hooks and
captured graphs that hold the tensors keep seeing the live weights. Parameters
may be held in the published dtype (bit-exact writes of the bit patterns) or in
a wider float dtype (values are cast up, which is exact for bf16 -> fp32), and
may be non-contiguous views (transposed, sliced): flat indices are logical
(row-major) positions, written through the tensor's own strides.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..codec import Decoded
from ..errors import ConfigError
from ..format import Header
from ..tensors import TensorSpec, bits_view, fingerprint, published_tensors
from .apply import check_header

__all__ = ["TorchModuleApplier"]


class TorchModuleApplier:
    """Applies decoded deltas and anchors to a module's tensors in place.

    Args:
        target (`nn.Module` or `Mapping[str, Tensor]`): the receiving weights.
        dtype (`torch.dtype`, *optional*, defaults to `torch.bfloat16`): the
            published dtype; ``None`` takes each tensor's own dtype.
    """

    def __init__(
        self,
        target: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype | None = torch.bfloat16,
    ) -> None:
        if not isinstance(target, (torch.nn.Module, Mapping)):
            raise ConfigError(
                f"target must be an nn.Module or a mapping of name -> tensor, not {type(target).__name__}",
                argument="target",
            )
        self._tensors = dict(published_tensors(target))
        self.specs = {name: TensorSpec.of(name, t, dtype) for name, t in self._tensors.items()}
        self.fingerprint = fingerprint(self.specs.values())

    def validate(self, header: Header) -> None:
        """Refuse a file that does not fit these tensors, before anything is decoded.

        Raises:
            `FingerprintMismatch`: made for another model.
            `TensorMismatch`: a carried tensor is unknown here or laid out differently.
        """
        check_header(header, self.specs, self.fingerprint)

    def lookup(self, name: str, indices: np.ndarray) -> np.ndarray:
        """Current published bit patterns at ``indices`` of tensor ``name`` (read only)."""
        tensor = self._tensors[name].detach()
        index = _tensor(indices).to(tensor.device)
        if tensor.is_contiguous():
            picked = tensor.view(-1).index_select(0, index)  # ~3.5x faster than flat[idx] on CPU
        else:  # a transposed or sliced view: address elements by their logical coordinates
            picked = tensor[torch.unravel_index(index, tensor.shape)]
        published = self.specs[name].torch_dtype
        return bits_view(picked.to(published)).cpu().numpy()

    def apply(self, decoded: Mapping[str, Decoded]) -> None:
        """Write validated patches in place; call :meth:`validate` first."""
        with torch.no_grad():
            for name, patch in decoded.items():
                self._apply_one(name, patch)

    def _apply_one(self, name: str, patch: Decoded) -> None:
        tensor = self._tensors[name]
        published = self.specs[name].torch_dtype
        values = _tensor(patch.values).view(published).to(tensor.device)
        target = tensor.detach()
        if tensor.dtype == published:
            target, values = bits_view(target), bits_view(values)
        else:
            values = values.to(tensor.dtype)
        if patch.indices is None:
            target.copy_(values.view(target.shape))
        elif target.is_contiguous():
            target.view(-1).index_copy_(0, _tensor(patch.indices).to(target.device), values)
        else:  # a transposed or sliced view: write through its own strides, still in place
            coords = torch.unravel_index(_tensor(patch.indices).to(target.device), target.shape)
            target.index_put_(coords, values)

    def state(self) -> dict[str, torch.Tensor]:
        """The receiving tensors by published name (live views, not copies)."""
        return dict(self._tensors)


def _tensor(array: np.ndarray) -> torch.Tensor:
    # torch refuses to wrap read-only buffers without a warning; those are small copies.
    return torch.from_numpy(array if array.flags.writeable else array.copy())
