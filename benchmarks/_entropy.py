"""How few bytes a change set could take: empirical entropy floors for the payload benchmark.

Two floors, in bytes, for one change set against the receiver's base (the
snapshot before the step):

- ``iid``: every changed position drawn independently with the tensor's own
  density (``numel * H(nnz / numel)`` bits per tensor) plus the empirical
  entropy of the value steps (new bits minus old, per tensor);
- ``exponent``: the same, conditioned on what the receiver already holds: the
  bf16 exponent of each element's base value. Positions are coded per exponent
  class (``n_e * H(k_e / n_e)``) and steps per exponent class. A decoder of this
  kind needs every element's exponent, an O(numel) pass per version.

Both are order-0 empirical entropies (the code is assumed to know the per-tensor,
per-class frequencies for free), so they are floors for coders of that family,
not for every conceivable coder.
"""

from __future__ import annotations

import numpy as np
import torch

from deltasync.publish.diff import Snapshot
from deltasync.tensors import ChangeSet, bits_view


def _binary_entropy_bits(n: np.ndarray, k: np.ndarray) -> float:
    """Sum over classes of ``n * H(k / n)`` in bits."""
    n, k = n.astype(np.float64), k.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        h = -(p * np.log2(np.where(p > 0, p, 1)) + (1 - p) * np.log2(np.where(p < 1, 1 - p, 1)))
    return float((n * h).sum())


def _symbol_entropy_bits(symbols: np.ndarray, classes: np.ndarray | None = None) -> float:
    """Empirical order-0 entropy of ``symbols`` in bits (conditioned on ``classes`` when given)."""
    if symbols.size == 0:
        return 0.0
    if classes is None:
        classes = np.zeros(symbols.size, dtype=np.int64)
    pairs = classes.astype(np.int64) << 33 | (symbols.astype(np.int64) & ((1 << 33) - 1))
    _, joint = np.unique(pairs, return_counts=True)
    _, marginal = np.unique(classes, return_counts=True)
    joint, marginal = joint.astype(np.float64), marginal.astype(np.float64)
    return float(-(joint * np.log2(joint)).sum() + (marginal * np.log2(marginal)).sum())


def entropy_floors(changes: ChangeSet, snapshot: Snapshot) -> dict[str, float]:
    """The ``iid`` and ``exponent`` floors of ``changes`` (bytes), and per changed element."""
    iid = exponent = 0.0
    for change in changes.changes:
        base = bits_view(snapshot[change.spec.name]).reshape(-1)
        numel = base.numel()
        if change.indices is None:
            idx = torch.nonzero(bits_view(base) != change.values.reshape(-1)).reshape(-1)
            new = change.values.reshape(-1)[idx]
        else:
            idx, new = change.indices, change.values
        k = idx.numel()
        old = base[idx]
        width = 16 if base.element_size() == 2 else 32
        mantissa = 7 if width == 16 else 23
        steps = (new.to(torch.int64) - old.to(torch.int64)).numpy()
        iid += _binary_entropy_bits(np.array([numel]), np.array([k])) + _symbol_entropy_bits(steps)
        exp_all = ((base.to(torch.int64) & ((1 << (width - 1)) - 1)) >> mantissa).numpy()
        exp_changed = exp_all[idx.numpy()]
        n_e = np.bincount(exp_all, minlength=1 << (width - 1 - mantissa))
        k_e = np.bincount(exp_changed, minlength=n_e.size)
        exponent += _binary_entropy_bits(n_e, k_e) + _symbol_entropy_bits(steps, exp_changed)
    nnz = max(changes.nnz, 1)
    return {"iid": iid / 8, "exponent": exponent / 8, "iid_per_change": iid / 8 / nnz,
            "exponent_per_change": exponent / 8 / nnz}
