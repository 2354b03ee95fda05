"""Reading JSON that deltasync wrote (manifests, file headers), refusing what parsers read differently.

Two readers of the same bytes must see the same document, or a forged file can
show one manifest to a checker and another to a replica. Python's ``json``
keeps the last of duplicate keys, other parsers the first; it accepts the
non-standard ``NaN`` and ``Infinity`` that others reject. Both are refused here.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["load_json"]


def load_json(data: bytes, *, what: str, error: type[Exception]) -> Any:
    """Parse JSON that deltasync wrote, refusing what two parsers could read differently.

    Duplicate object keys (one parser keeps the first, another the last), the
    non-standard ``NaN`` / ``Infinity`` constants, integers too long to
    parse, encodings other than UTF-8 and a byte order mark raise ``error``, as
    does anything that is not JSON.
    """

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)  # built in C; a key twice leaves it shorter (a loop here took 2/3 of a table's parse)
        if len(out) != len(items):  # name the first key seen twice
            seen: set[str] = set()
            for key, _ in items:
                if key in seen:
                    raise error(f"{what} has the key {key!r:.60} twice")
                seen.add(key)
        return out

    def constant(name: str) -> Any:
        raise error(f"{what} holds {name}, which is not JSON")

    try:
        text = bytes(data).decode("utf-8")  # UTF-8 only: json.loads would also take UTF-16/32
        if text.startswith("\ufeff"):
            raise error(f"{what} starts with a byte order mark; JSON here is UTF-8 without one")
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except error:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON, overlong integers
        raise error(f"{what} is not valid JSON: {exc}") from None
