"""Codec registry: index and value encodings, looked up by the name files carry.

Built-in codecs:

- ``compact`` (default): gap-coded indices and base-relative values, zstd.
- ``compact-abs``: like ``compact`` but values stand alone (no base needed).
- ``compact-exp``: like ``compact`` with positions coded among the elements of the same
  base exponent: fewer bytes for an O(numel) pass on both sides (for slow links).
- ``exp-rice``: ``compact-exp``'s positions and steps Rice-coded per exponent class: fewer
  bytes still, at the same O(numel) cost (for slow links).
- ``raw``: int32 indices + plain values, the interoperable baseline.
- ``dense``: the whole tensor, chosen automatically for densely changed tensors.

New codecs register by name with a ``"module:Class"`` path, imported on first use::

    register_codec("mine", "my_pkg.codecs:MyCodec")
"""

from __future__ import annotations

import importlib

from .base import BaseLookup, Codec, Decoded, Encoded, Params, Parts

__all__ = [
    "Codec", "Encoded", "Decoded", "BaseLookup", "Parts", "Params", "register_codec", "get_codec", "codec_names",
]

DEFAULT_CODEC = "compact"

_REGISTRY: dict[str, str] = {
    "compact": "deltasync.codec.compact:CompactCodec",
    "compact-abs": "deltasync.codec.compact:CompactAbsCodec",
    "compact-exp": "deltasync.codec.ranked:CompactExpCodec",
    "exp-rice": "deltasync.codec.rice:ExpRiceCodec",
    "raw": "deltasync.codec.raw:RawCodec",
    "dense": "deltasync.codec.dense:DenseCodec",
}
_LOADED: dict[str, Codec] = {}


def register_codec(name: str, target: str) -> None:
    """Register a codec class under ``name`` as ``"module:Class"``.

    Raises:
        `ValueError`: ``name`` is taken or ``target`` is not ``"module:Class"``.
    """
    if name in _REGISTRY:
        raise ValueError(f"codec {name!r} is already registered; registered: {codec_names()}")
    if target.count(":") != 1:
        raise ValueError(f"codec target must be 'module:Class', got {target!r}")
    _REGISTRY[name] = target


def codec_names() -> list[str]:
    """Names of every registered codec."""
    return sorted(_REGISTRY)


def get_codec(name: str) -> Codec:
    """The codec registered as ``name`` (instantiated once).

    Raises:
        `ValueError`: no codec has that name.
    """
    if name not in _LOADED:
        if name not in _REGISTRY:
            raise ValueError(f"unknown codec {name!r}; registered: {codec_names()}")
        module, cls = _REGISTRY[name].split(":")
        codec = getattr(importlib.import_module(module), cls)()
        if codec.name != name:
            raise ValueError(f"{_REGISTRY[name]} declares name {codec.name!r}, registered as {name!r}")
        _LOADED[name] = codec
    return _LOADED[name]
