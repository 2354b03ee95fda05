"""What every applier checks before it writes: the file fits the weights it holds."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import TensorMismatch
from ..format import Header, check_compatible
from ..tensors import TensorSpec

__all__ = ["check_header"]


def check_header(header: Header, specs: Mapping[str, TensorSpec], fingerprint: str, *, holder: str = "receiver") -> None:
    """Refuse a file made for another model, or carrying tensors this holder lacks or lays out otherwise.

    Raises:
        `FingerprintMismatch`: made for another model.
        `TensorMismatch`: a carried tensor is unknown here or has another shape or dtype.
    """
    check_compatible(header, fingerprint)
    for name, entry in header.tensors.items():
        spec = specs.get(name)
        if spec is None:
            raise TensorMismatch(f"unknown tensor {name!r} in file; the {holder} does not hold it", name=name)
        if spec != entry.spec:
            raise TensorMismatch(
                f"{name}: file has {entry.spec.dtype}{list(entry.spec.shape)}, "
                f"{holder} has {spec.dtype}{list(spec.shape)}",
                name=name,
            )
