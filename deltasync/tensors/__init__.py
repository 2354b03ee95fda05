"""Tensors as deltasync sees them: specs and the fingerprint, bit patterns, changes, device helpers.

- :mod:`.specs`: what gets published (names, shapes, dtypes) and the model fingerprint.
- :mod:`.bits`: bit views and the in-place write of changed elements.
- :mod:`.changes`: the changed elements of a version, as the diff finds them and the codecs take them.
- :mod:`.device`: staging, positions and sums without host waits, for the device paths.
- :mod:`.saved_layout`: a transformers model's tensors in the names and layout its checkpoints use.
"""

from __future__ import annotations

from .bits import BITS_BY_SIZE, EXPONENT_SHIFT, NUMPY_BITS_BY_SIZE, SCATTERED, bits_dtype, bits_view, write_at
from .changes import ChangeSet, TensorChange
from .device import host_ints, positions, scattered_positions, segment_owners, segment_sums, settle, stage
from .specs import (
    DTYPE_BY_NAME,
    CAST_DTYPES,
    TensorSpec,
    check_cast_dtype,
    check_publishable,
    describe_differences,
    dtype_from_name,
    dtype_name,
    fingerprint,
    published_dtype,
    published_tensors,
    weights_digest,
)

__all__ = [
    "BITS_BY_SIZE", "DTYPE_BY_NAME", "EXPONENT_SHIFT", "NUMPY_BITS_BY_SIZE", "SCATTERED", "ChangeSet", "TensorChange", "TensorSpec", "bits_dtype",
    "bits_view", "CAST_DTYPES", "check_cast_dtype", "check_publishable", "describe_differences", "dtype_from_name", "dtype_name", "fingerprint",
    "host_ints", "positions", "published_dtype", "published_tensors", "scattered_positions", "segment_owners",
    "segment_sums", "settle", "stage", "weights_digest", "write_at",
]
