"""Helpers the ``deltasync`` commands share: opening a run prefix, reading its manifest, formatting.

Store URLs are printed through :func:`safe_url`, so nothing that can carry a credential reaches a
terminal or a log; a missing directory or manifest is a typed :class:`~deltasync.errors.ObjectNotFound`
whose message says what to check.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import ObjectNotFound, StoreError
from ..manifest import MANIFEST_KEY, Manifest

if TYPE_CHECKING:
    from ..stores import Store


def safe_url(url: str) -> str:
    """``url`` without user info, query string or fragment: nothing that can carry a credential."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def _open(url: str) -> Store:
    """Open an existing store, keeping credentials that a mistyped URL may carry out of messages."""
    from ..stores import open_store

    if "://" not in url or url.startswith("file://"):
        # Opening a local store creates its directory; a read must not leave one behind.
        path = Path(unquote(urlsplit(url).path) if url.startswith("file://") else url).expanduser()
        if not path.is_dir():
            raise _no_manifest(url, "no such directory; ")
    try:
        return open_store(url)
    except ValueError as exc:
        raise StoreError(f"cannot open store: {str(exc).replace(url, safe_url(url))}") from None


def _no_manifest(url: str, why: str = "") -> ObjectNotFound:
    return ObjectNotFound(
        f"no {MANIFEST_KEY} at {safe_url(url)}: {why}nothing has been published there (check the URL)",
        key=MANIFEST_KEY,
    )


def _load_manifest(store: Store) -> tuple[Manifest, str | None]:
    """The manifest and its etag; a missing manifest is a clear, typed error."""
    try:
        got = store.get_if_changed(MANIFEST_KEY, None)
    except ObjectNotFound:
        raise _no_manifest(store.url) from None
    assert got is not None  # no etag given, so the object is always returned
    data, info = got
    return Manifest.from_bytes(data), info.etag


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.1f} {unit}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = abs(seconds)
    for limit, unit, scale in ((60, "s", 1), (3600, "min", 60), (86400, "h", 3600)):
        if s < limit:
            break
    else:
        unit, scale = "d", 86400
    text = f"{s / scale:.1f} {unit}"
    return text if seconds >= 0 else f"-{text}"
