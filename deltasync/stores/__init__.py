"""Object stores, chosen by URL.

=========================================  =====================================
URL                                        backend
=========================================  =====================================
``/some/dir``, ``file:///some/dir``        :class:`LocalStore` (the default; also ``file:rel/dir``)
``memory://name``                          :class:`MemoryStore`
``s3://bucket/prefix``                     ``deltasync.stores.s3.S3Store`` (extra ``s3``)
``hf://buckets/namespace/name/prefix``     ``deltasync.stores.hf.HFBucketStore`` (extra ``hf``)
=========================================  =====================================

Backends register by scheme with a ``"module:Class"`` path and are imported on
first use, so optional clients load only when their scheme is opened. A URL that
names no backend (``gs://x``, ``s3:/bucket``, ``file://run1``, ``""``) raises
:class:`~deltasync.errors.ConfigError` listing the accepted forms, before anything
is read. A path with a colon after its first segment (``./a:b``, ``runs/t=10:00``)
is a path.

Any of them can be read through a cache shared by the processes of a node: that cache reads
manifests, so it lives with the replica (``deltasync.replica.cache``: ``Subscriber(url, applier,
cache_dir=...)``, or ``CachedStore(open_store(url), cache_dir)``), not here.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

from ..errors import ConfigError
from .base import URL_FORMS, ObjectInfo, Store, check_key
from .local import LocalStore
from .memory import MemoryStore

__all__ = [
    "Store", "ObjectInfo", "LocalStore", "MemoryStore", "open_store", "register_store", "store_schemes", "check_key",
]

_BACKENDS: dict[str, str] = {
    "file": "deltasync.stores.local:LocalStore",
    "memory": "deltasync.stores.memory:MemoryStore",
    "s3": "deltasync.stores.s3:S3Store",
    "hf": "deltasync.stores.hf:HFBucketStore",
}

_CACHE_OPTIONS = ("cache_dir", "cache_max_bytes")

# RFC 3986 scheme syntax: a letter, then letters, digits, "+", "-" or ".", then ":".
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


def register_store(scheme: str, target: str) -> None:
    """Register a backend class (``"module:Class"`` with a ``from_url`` classmethod).

    Raises:
        `ValueError`: the scheme is taken.
    """
    if scheme in _BACKENDS:
        raise ValueError(f"store scheme {scheme!r} is already registered; registered: {sorted(_BACKENDS)}")
    _BACKENDS[scheme] = target


def store_schemes() -> list[str]:
    """The URL schemes of the registered backends (``"file"`` is the local filesystem), sorted."""
    return sorted(_BACKENDS)


def open_store(url: str | os.PathLike[str] | Store, **options: Any) -> Store:
    """Open the store a URL names (a :class:`Store` passes through).

    Args:
        url (`str`, `os.PathLike` or `Store`): a path, ``file:///abs/path`` (also ``file:rel/path``),
            ``memory://name``, ``s3://bucket/prefix`` or ``hf://buckets/namespace/name/prefix``.
        **options: backend options (credentials, endpoint, ...), see each backend.

    Raises:
        `ConfigError`: the URL names no backend (empty, not a string, an unknown scheme, a malformed
            URL; the message lists the accepted forms), or a cache option (a replica's, not a store's).
    """
    for name in _CACHE_OPTIONS:
        if name in options:
            raise ConfigError(
                f"open_store takes no {name}: a shared cache is a replica's (it reads manifests); pass it to "
                "Subscriber(url, applier, cache_dir=...), or wrap the store: "
                "deltasync.replica.cache.CachedStore(open_store(url), cache_dir)",
                argument=name,
            )
    if isinstance(url, Store):
        return url
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    backend: Any = _load(_BACKENDS[_scheme(url)])
    return backend.from_url(url, **options)  # type: ignore[no-any-return]


def _load(target: str) -> type:
    """The class a ``"module:Class"`` string names, importing its module on first use."""
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def _scheme(url: object) -> str:
    """The registered scheme ``url`` names (``"file"`` for a plain path).

    Raises:
        `ConfigError`: ``url`` is empty or not a string, its scheme is unknown, or it looks like a
            URL with a slash missing (``s3:/bucket``, ``memory:name``, ``gs:/x``).
    """
    if not isinstance(url, str) or not url:
        raise ConfigError(
            f"a store URL must be a non-empty string (or a Store), not {url!r}; use {URL_FORMS}", argument="url"
        )
    match = _SCHEME.match(url)
    if match is None:
        return "file"
    scheme, rest = match.group(1), url[match.end() :]
    if scheme == "file":
        return scheme
    if rest.startswith("//"):
        if scheme in _BACKENDS:
            return scheme
        raise ConfigError(
            f"unknown store scheme {scheme!r} in {url!r}; registered: {sorted(_BACKENDS)}; use {URL_FORMS}",
            argument="url",
        )
    if scheme in _BACKENDS:
        raise ConfigError(
            f"{url!r} needs '//' after '{scheme}:' (did you mean '{scheme}://{rest.lstrip('/')}'?); use {URL_FORMS}",
            argument="url",
        )
    if rest.startswith("/"):
        raise ConfigError(
            f"unknown store scheme {scheme!r} in {url!r}; registered: {sorted(_BACKENDS)}; use {URL_FORMS} "
            f"(for a directory whose name holds a colon, write './{url}')",
            argument="url",
        )
    return "file"  # a relative path whose first segment holds a colon: "runs:7", "t=10:00"
