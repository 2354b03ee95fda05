"""Object stores, chosen by URL.

=========================================  =====================================
URL                                        backend
=========================================  =====================================
``/some/dir``, ``file:///some/dir``        :class:`LocalStore` (the default)
``memory://name``                          :class:`MemoryStore`
``s3://bucket/prefix``                     ``deltasync.stores.s3.S3Store`` (extra ``s3``)
``hf://buckets/namespace/name/prefix``     ``deltasync.stores.hf.HFBucketStore`` (extra ``hf``)
=========================================  =====================================

Backends register by scheme with a ``"module:Class"`` path and are imported on
first use, so optional clients load only when their scheme is opened.

Any of them can be read through a cache shared by the processes of a node:
``open_store(url, cache_dir="/dev/shm/deltasync")`` wraps the store in
``deltasync.stores.cache.CachedStore`` (see there; ``cache_max_bytes`` sets its cap).
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import ObjectInfo, Store, check_key
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["Store", "ObjectInfo", "LocalStore", "MemoryStore", "open_store", "register_store", "check_key"]

_BACKENDS: dict[str, str] = {
    "file": "deltasync.stores.local:LocalStore",
    "memory": "deltasync.stores.memory:MemoryStore",
    "s3": "deltasync.stores.s3:S3Store",
    "hf": "deltasync.stores.hf:HFBucketStore",
}


def register_store(scheme: str, target: str) -> None:
    """Register a backend class (``"module:Class"`` with a ``from_url`` classmethod).

    Raises:
        `ValueError`: the scheme is taken.
    """
    if scheme in _BACKENDS:
        raise ValueError(f"store scheme {scheme!r} is already registered; registered: {sorted(_BACKENDS)}")
    _BACKENDS[scheme] = target


def open_store(url: str | Store, **options: Any) -> Store:
    """Open the store a URL names (a :class:`Store` passes through).

    Args:
        url (`str`): a path, ``file://``, ``memory://``, ``s3://`` or ``hf://buckets/`` URL.
        cache_dir (`str`, *optional*): read the manifest's objects through a cache in this directory,
            shared by the processes that name it (:class:`~deltasync.stores.cache.CachedStore`).
        cache_max_bytes (`int`, *optional*): the cache's size cap.
        **options: backend options (credentials, endpoint, ...), see each backend.

    Raises:
        `ValueError`: unknown scheme, or cache options without ``cache_dir``.
    """
    cache_dir = options.pop("cache_dir", None)
    cache_max_bytes = options.pop("cache_max_bytes", None)
    if cache_max_bytes is not None and cache_dir is None:
        raise ValueError("cache_max_bytes needs cache_dir (the directory to cache in)")
    if cache_dir is not None:
        from .cache import DEFAULT_MAX_BYTES, CachedStore

        inner = open_store(url, **options)
        if isinstance(inner, CachedStore):
            return inner
        return CachedStore(inner, cache_dir, max_bytes=cache_max_bytes or DEFAULT_MAX_BYTES)
    if isinstance(url, Store):
        return url
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme not in _BACKENDS:
        raise ValueError(f"unknown store scheme {scheme!r} in {url!r}; registered: {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[scheme].split(":")
    backend: Any = getattr(importlib.import_module(module), cls)
    return backend.from_url(url, **options)  # type: ignore[no-any-return]
