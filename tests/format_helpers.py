"""Forged files for tests: a safetensors file with its JSON header edited and its body left as it was."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any


def with_header_text(data: bytes, edit: Callable[[str], str]) -> bytes:
    """The file with its safetensors header JSON text passed through ``edit`` (padded to 8 bytes, as writers
    pad it; the body is untouched)."""
    length = struct.unpack("<Q", data[:8])[0]
    encoded = edit(data[8 : 8 + length].decode()).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + length :]


def with_header(data: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """The file with its safetensors header, parsed, changed in place by ``edit`` (the body is untouched)."""

    def apply(text: str) -> str:
        header = json.loads(text)
        edit(header)
        return json.dumps(header)

    return with_header_text(data, apply)
