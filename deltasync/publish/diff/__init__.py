"""Exact change detection against the last published weights, on the host or on the weights' device.

- :mod:`.snapshot`: the :class:`Snapshot` of the last published version and :func:`diff`, the host path.
- :mod:`.device`: the same diff for a snapshot on an accelerator, two host waits per version.
- :mod:`.chunks`: how the device path cuts weights into chunks, and how the snapshot lays small tensors out.
"""

from __future__ import annotations

from .snapshot import DEFAULT_CHUNK, DENSE_FRACTION, DEVICE_CHUNK, Snapshot, diff, diff_stream

__all__ = ["DEFAULT_CHUNK", "DENSE_FRACTION", "DEVICE_CHUNK", "Snapshot", "diff", "diff_stream"]
