"""Helpers the ``deltasync`` commands share: opening a run prefix, reading its manifest, formatting.

Store URLs are printed through :func:`safe_url`, so nothing that can carry a credential reaches a
terminal or a log; a missing directory or manifest is a typed :class:`~deltasync.errors.ObjectNotFound`
whose message says what to check. Tables are printed by :func:`print_table` from :class:`Column`
layouts, so every command lines its columns up the same way.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import ObjectNotFound, StoreError
from ..protocol.keys import MANIFEST_KEY
from ..protocol.manifest import MAX_MANIFEST_BYTES, Manifest

if TYPE_CHECKING:
    from ..stores import Store

__all__ = [
    "Column", "add_pin_arguments", "format_duration", "format_size", "load_manifest", "open_existing", "pin",
    "print_json", "print_table", "safe_url",
]


def safe_url(url: str) -> str:
    """``url`` without user info, query string or fragment: nothing that can carry a credential."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def open_existing(url: str) -> Store:
    """Open an existing store, keeping credentials that a mistyped URL may carry out of messages.

    Raises:
        `ObjectNotFound`: a local path that is not a directory (opening it would create it).
        `StoreError`: the URL names no store (the message shows it without credentials).
    """
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


def load_manifest(store: Store) -> tuple[Manifest, str | None]:
    """The manifest and its etag; a missing manifest is a clear, typed error.

    Raises:
        `ObjectNotFound`: nothing has been published at the store (the message says to check the URL).
    """
    try:
        got = store.get_if_changed(MANIFEST_KEY, None, max_bytes=MAX_MANIFEST_BYTES)
    except ObjectNotFound:
        raise _no_manifest(store.url) from None
    assert got is not None  # no etag given, so the object is always returned
    data, info = got
    return Manifest.from_bytes(data), info.etag


def format_size(n: int | None) -> str:
    """``n`` bytes for a person, in decimal units as everywhere in deltasync (CLI, demo, benchmarks, docs):
    ``"512 B"``, ``"1.5 KB"``, ... ``"3.0 GB"`` (``"?"`` when unknown)."""
    if n is None:
        return "?"
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for unit in ("KB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000:
            break
    return f"{value:.1f} {unit}"


def format_duration(seconds: float | None) -> str:
    """Seconds for a person, in the largest unit under its limit: ``"42.0 s"``, ``"-1.5 min"``, ``"2.0 d"``."""
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


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a table printed by :func:`print_table`."""

    title: str
    """Heading, aligned like the cells."""
    width: int = 0
    """Cells are padded to this many characters (0: not padded, for the last column)."""
    align: Literal["<", ">"] = "<"
    """``"<"`` left-aligns, ``">"`` right-aligns (numbers)."""
    gap: int = 1
    """Spaces between this column and the next."""


def print_json(info: object) -> None:
    """``info`` as indented JSON on stdout: what a command prints with ``--json``."""
    json.dump(info, sys.stdout, indent=2)
    print()


def print_table(columns: Sequence[Column], rows: Iterable[Sequence[object]]) -> None:
    """Print a blank line, the column titles, then one line per row of cells (formatted by the caller).

    Example:
        ```python
        >>> print_table([Column("name", 6), Column("bytes", 8, ">")], [("a", "1.0 KB")])
        <BLANKLINE>
        name      bytes
        a       1.0 KB
        ```
    """
    print("\n" + _line(columns, [c.title for c in columns]))
    for row in rows:
        print(_line(columns, row))


def _line(columns: Sequence[Column], cells: Sequence[object]) -> str:
    last = len(columns) - 1
    return "".join(
        f"{cell!s:{column.align}{column.width or ''}}" + ("" if i == last else " " * column.gap)
        for i, (column, cell) in enumerate(zip(columns, cells))
    )


def add_pin_arguments(parser: Any) -> None:
    """``--version V`` (exactly that version, ahead or back) and ``--at-most V`` (the newest up to it)."""
    pinned = parser.add_mutually_exclusive_group()
    pinned.add_argument("--version", type=int, default=None, metavar="V",
                        help="go to exactly version V (ahead of the one held, or back) and stay there")
    pinned.add_argument("--at-most", type=int, default=None, metavar="V",
                        help="follow the newest version up to V, then stay")


def pin(replica: Any, args: Any) -> None:
    """Pin ``replica`` (a subscriber or a server follower) as ``args`` say (:func:`add_pin_arguments`)."""
    if args.version is not None:
        replica.go_to(args.version)
    elif args.at_most is not None:
        replica.follow(at_most=args.at_most)
