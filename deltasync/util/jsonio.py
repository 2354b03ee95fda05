"""Reading JSON that deltasync wrote (manifests, file headers), refusing what parsers read differently.

Two readers of the same bytes must see the same document, or a forged file can
show one manifest to a checker and another to a replica. Python's ``json``
keeps the last of duplicate keys, other parsers the first; it accepts the
non-standard ``NaN`` and ``Infinity`` that others reject; it reads the integer
``-0`` as 0 where others keep a negative zero. All three are refused here.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["load_json"]


def load_json(data: bytes, *, what: str, error: type[Exception]) -> Any:
    """Parse JSON that deltasync wrote, refusing what two parsers could read differently.

    Duplicate object keys (one parser keeps the first, another the last), the
    non-standard ``NaN`` / ``Infinity`` constants, the integer ``-0`` (0 to one
    parser, a negative zero to another; writers spell 0 without a sign), integers
    too long to parse, encodings other than UTF-8 and a byte order mark raise
    ``error``, as does anything that is not JSON.
    """

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)  # in C (a Python loop would dominate the parse); a repeated key leaves it shorter
        if len(out) != len(items):  # name the first key seen twice
            seen: set[str] = set()
            for key, _ in items:
                if key in seen:
                    raise error(f"{what} has the key {key!r:.60} twice")
                seen.add(key)
        return out

    def constant(name: str) -> Any:
        raise error(f"{what} holds {name}, which is not JSON")

    def integer(literal: str) -> int:
        if literal == "-0":
            raise error(f"{what} holds the integer -0: write 0 without a sign")
        return int(literal)

    try:
        text = bytes(data).decode("utf-8")  # UTF-8 only: json.loads would also take UTF-16/32
        if text.startswith("\ufeff"):
            raise error(f"{what} starts with a byte order mark; JSON here is UTF-8 without one")
        # Integers pass through the parser's own conversion unless the text could hold a -0 (rare: the hook
        # costs a call per integer).
        hook = integer if "-0" in text else None
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_int=hook)
    except error:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: JSON, overlong integers
        raise error(f"{what} is not valid JSON: {exc}") from None
