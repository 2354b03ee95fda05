"""Decoding where the weights live: a version's files, decoded by the worker that holds every element.

A vLLM follower decodes base-relative deltas on its own host: it reads the base
at every changed element from the workers (one RPC of indices, one of bits back)
and then sends them the patches (indices and values, 10 bytes per change). When
one worker holds every element of the checkpoint (an engine of one rank), the
follower can send it the version's files instead, a byte or two per change, and
the worker decodes them against its own weights, read through its index map:
one RPC instead of two, and a small fraction of the bytes.

The worker checks everything before it writes, as the follower would have: the
files decode exactly as declared, every tensor's decoded values match the
publisher's digest (which proves its base), and every patch fits the map
(:func:`~.apply.plan_patches`). A refusal travels back as data
(:func:`refusal_to_json`) and is raised on the follower's side as the same typed
error (:func:`refusal_from_json`); nothing was written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import errors
from ..diff import Snapshot, diff
from ..errors import DeltaSyncError
from ..format import combine, decode, encode_delta
from .apply import Payload, merge_bits, read_bits
from .mapping import IndexMap
from .wire import patch_parts

__all__ = ["decode_here", "refusal_to_json", "refusal_from_json", "warm_decoder"]


def decode_here(index: IndexMap, files: Sequence[bytes | memoryview], *, whole: bool) -> Payload:
    """Decode the files of one version against this rank's weights; nothing is written.

    Args:
        index: this rank's map; it must hold every element the files change.
        files: the version's files (a trainer's shards: several).
        whole: the files are an anchor (every element carried exactly once).

    Returns:
        `Payload`: ``{name: {"idx": int64 flat indices, "val": bits}}`` (no ``idx``: the whole tensor), ready
        for :func:`~.apply.plan_patches`.

    Raises:
        `DeltaSyncError`: a file that does not decode exactly, values whose digest differs (this rank does
            not hold the delta's base), or an element this rank does not hold.
    """

    def lookup(name: str, indices: np.ndarray) -> np.ndarray:
        request = np.ascontiguousarray(indices, dtype=np.int64)
        held = read_bits(index, {name: {"idx": request}})[name]  # checked: a known name, indices in bounds
        return merge_bits(index.specs[name], request.size, [held], missing="changed elements are not held by this rank")

    parts = [decode(bytearray(f), base=lookup) for f in files]  # writable: its streams are viewed in place
    return {name: patch_parts(patch) for name, patch in combine(parts, whole=whole).items()}


def warm_decoder() -> None:
    """Decode a tiny delta once, the way a worker decodes, so that a replica's first real decode does
    not also load the compiled kernels (their first calls took about 0.25 s here)."""
    before = torch.linspace(-1.0, 1.0, 4096).to(torch.bfloat16)
    bits = before.view(torch.int16).clone()
    bits[::97] += 1
    data = encode_delta(diff(Snapshot.capture({"w": before}), {"w": bits.view(torch.bfloat16)}),
                        version=1, base_version=0)
    held = before.view(torch.int16).numpy()
    decode(bytearray(data), base=lambda name, indices: held[indices])


def refusal_to_json(exc: DeltaSyncError) -> dict[str, Any]:
    """A typed error as JSON-able data (its class name, message, and its plain context values)."""
    plain = (str, int, float, bool, type(None))
    return {
        "type": type(exc).__name__,
        "message": exc.message,
        "context": {k: v for k, v in exc.context.items() if isinstance(v, plain)},
    }


def refusal_from_json(raw: dict[str, Any]) -> DeltaSyncError:
    """The error :func:`refusal_to_json` described, as its own class (a :class:`DeltaSyncError` if unknown)."""
    cls = getattr(errors, str(raw.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, DeltaSyncError)):
        cls = DeltaSyncError
    try:
        return cls(str(raw.get("message")), **dict(raw.get("context") or {}))
    except TypeError:  # a class whose constructor wants other arguments
        return DeltaSyncError(str(raw.get("message")))
