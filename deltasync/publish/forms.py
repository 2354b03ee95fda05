"""Weights with more than one exact form: each version is published in whichever is smallest.

Some models can be written as different sets of tensor values that serve the
same policy. A LoRA run (:mod:`deltasync.publish.lora`) is the case in point: its
policy ``W + s * B @ A`` is either the *merged* weights (the base names carry
the sum, the adapter factors are zero) or the *adapter* form (the base names
carry the frozen base, the factors are live). Both are one fixed set of named
tensors, so every version is an ordinary delta from the one before, whatever
form each was published in, and a replica that applies deltas exactly holds the
version's form exactly (a switch of form is just a larger delta).

A source offers its forms through :class:`Forms`; :class:`~deltasync.Publisher`
diffs each form against the last published version and commits the one whose
change set is estimated smallest on the wire (:func:`wire_cost`). Diffing costs
one pass per form; encoding happens once, for the chosen form.

The comparison is of what each form costs *per version once adopted*, not of
the one version that switches: a form may name the tensors it holds constant
(``fixed``: a LoRA adapter form's base weights, a merged form's zeroed factors),
and their changes, which are the one-time price of switching into the form,
are left out of its estimate. Judged on the switching version alone, a run
would never leave a form whose every version costs more than the other's but
less than the switch.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Protocol, runtime_checkable

import torch

from ..tensors import ChangeSet
from .diff import Snapshot, diff

__all__ = ["Forms", "smallest", "wire_cost"]

# Bits a gap-coded index costs beyond log2(1 / density): log2(e), the excess of a geometric
# distribution's entropy (positions spread at random) over log2 of its mean.
GAP_EXCESS_BITS = 1.44
# Bits a base-relative value costs beyond the length of its zigzagged step (the codec's framing).
VALUE_EXCESS_BITS = 1.0


@runtime_checkable
class Forms(Protocol):
    """A source of weights with several exact forms (one tensor set, different values)."""

    def forms(self) -> Mapping[str, Mapping[str, torch.Tensor]]:
        """The forms allowed now, by name, each a mapping over the same names, shapes and dtypes.

        A form may name the tensors it holds constant in a ``fixed`` attribute (see the module doc).
        """
        ...


def wire_cost(changes: ChangeSet, *, skip: Collection[str] = ()) -> float:
    """Estimated encoded bytes of a change set, to compare forms without encoding each.

    Modelled on the default ``compact`` codec, from the change set alone:

    - an index costs ``log2(numel / nnz) + 1.44`` bits (the entropy of gaps
      between positions spread at random);
    - a value with a base costs the bit length of its zigzagged step (new bits
      minus old, so a one-ulp step costs about two bits) plus one; without a
      base, its full width;
    - a whole-tensor change costs its non-zero values' full width (zstd removes
      runs of zeros, such as a zeroed adapter; fp32 mantissas do not compress).

    Tensors named in ``skip`` count nothing. The estimate is close enough to the
    encoded size on real RL and LoRA steps for choosing between forms that
    differ by a factor.
    """
    bits = 0.0
    for change in changes.changes:
        if change.spec.name in skip:
            continue
        width = 8 * change.values.element_size()
        if change.indices is None:
            bits += int(torch.count_nonzero(change.values)) * width
            continue
        numel = max(change.spec.numel, change.nnz)
        bits += change.nnz * (math.log2(numel / max(change.nnz, 1)) + GAP_EXCESS_BITS)
        if change.base is None:
            bits += change.nnz * width
            continue
        step = change.values.to(torch.int64) - change.base.to(torch.int64)
        zigzag = torch.where(step >= 0, 2 * step, -2 * step - 1)
        bits += float(torch.log2(zigzag.to(torch.float64) + 1).sum()) + change.nnz * VALUE_EXCESS_BITS
    return bits / 8


def smallest(
    snapshot: Snapshot, source: Forms, *, chunk: int | None = None, prefer: str | None = None
) -> tuple[str, ChangeSet]:
    """The form of ``source`` whose change set from ``snapshot`` is estimated smallest, and that change set.

    Args:
        snapshot (`Snapshot`): the last published weights.
        source (`Forms`): the live weights' forms.
        chunk (`int`, *optional*): elements compared per step (``None``: :func:`diff`'s default for the path).
        prefer (`str`, *optional*): the form that wins a tie (the previous version's: no needless switch).

    Raises:
        `ValueError`: the source offers no form.
    """
    forms = dict(source.forms())
    if not forms:
        raise ValueError(f"{type(source).__name__} offers no form to publish")
    order = sorted(forms, key=lambda name: name != prefer)
    best: tuple[int, str, ChangeSet] | None = None
    for name in order:
        changes = diff(snapshot, forms[name], chunk=chunk)
        cost = wire_cost(changes, skip=getattr(forms[name], "fixed", ()))
        if best is None or cost < best[0]:
            best = (cost, name, changes)
    assert best is not None
    return best[1], best[2]
