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
        **options: backend options (credentials, endpoint, ...), see each backend.

    Raises:
        `ValueError`: unknown scheme.
    """
    if isinstance(url, Store):
        return url
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme not in _BACKENDS:
        raise ValueError(f"unknown store scheme {scheme!r} in {url!r}; registered: {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[scheme].split(":")
    backend: Any = getattr(importlib.import_module(module), cls)
    return backend.from_url(url, **options)  # type: ignore[no-any-return]
