"""What changed between two versions: per tensor, the flat indices, new and old bit patterns.

The diff produces a :class:`ChangeSet`; the codecs and the file encoder consume it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .specs import TensorSpec

__all__ = ["ChangeSet", "TensorChange"]


@dataclass(frozen=True, slots=True)
class TensorChange:
    """The changed elements of one tensor between the snapshot and the live weights."""

    spec: TensorSpec
    """Name, full shape and published dtype of the tensor."""
    indices: torch.Tensor | None
    """Sorted flat indices (int64, CPU) of changed elements; ``None`` when ``dense``."""
    values: torch.Tensor
    """New bit patterns (int16/int32, CPU): at ``indices``, or every element when dense."""
    base: torch.Tensor | None
    """Old bit patterns at ``indices`` (for base-relative codecs); ``None`` when dense."""
    nnz: int
    """Number of elements whose bit pattern changed."""
    whole_base: torch.Tensor | None = None
    """Every old bit pattern of the tensor, flat (a view of the snapshot, valid until it advances): for
    codecs that code positions against what the receiver holds, and for carrying a densely changed
    tensor sparsely when that is smaller. ``None`` where the source does not provide it."""

    def as_sparse(self) -> TensorChange:
        """This change as indices and values (a dense change needs ``whole_base``)."""
        if not self.dense:
            return self
        if self.whole_base is None:
            raise ValueError(f"{self.spec.name}: a dense change without its base cannot be made sparse")
        old = self.whole_base.reshape(-1).cpu()
        new = self.values.reshape(-1)
        indices = torch.nonzero(torch.ne(new, old)).reshape(-1)
        return TensorChange(self.spec, indices, new[indices], old[indices], self.nnz, self.whole_base)

    @property
    def dense(self) -> bool:
        """True when the whole tensor is carried instead of its changed elements."""
        return self.indices is None


@dataclass(frozen=True, slots=True)
class ChangeSet:
    """Every change between a snapshot and the live weights: the plan of one delta."""

    changes: tuple[TensorChange, ...]
    """Changed tensors in publishing order; unchanged tensors are absent."""
    specs: tuple[TensorSpec, ...]
    """All published tensors, changed or not (the fingerprint covers these)."""

    @property
    def numel(self) -> int:
        """Elements in the whole model."""
        return sum(s.numel for s in self.specs)

    @property
    def nnz(self) -> int:
        """Changed elements in the whole model."""
        return sum(c.nnz for c in self.changes)

    @property
    def density(self) -> float:
        """Fraction of elements that changed (0 for an empty model)."""
        total = self.numel
        return self.nnz / total if total else 0.0
