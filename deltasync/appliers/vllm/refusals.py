"""How the ``deltasync`` backend's refusals cross vLLM's process boundaries and reach an HTTP caller as a 4xx.

vLLM turns any exception raised in a worker into a plain error carrying only its text, and its server
answers that with a 500. The backend therefore writes its refusals as text that says what they are
(:func:`refusal_text`: the HTTP status they deserve, the deltasync error class, the message), and the
plugin's server-side handler (:func:`status_of`) answers those, and only those, with their status;
every other error keeps vLLM's own answer.

No vllm import: the server process reads these before any engine exists.
"""

from __future__ import annotations

import re

from ...errors import (
    CodecError,
    ConfigError,
    DeltaFormatError,
    DeltaSyncError,
    FingerprintMismatch,
    IntegrityError,
    ManifestError,
    ObjectNotFound,
    StoreError,
    TensorMismatch,
    VersionError,
)

__all__ = ["STATUS", "refusal_text", "status_of"]

# The HTTP status of each refusal, by the most specific deltasync error class it is an instance of.
STATUS: tuple[tuple[type[DeltaSyncError], int], ...] = (
    (ConfigError, 400),  # a malformed init_info or update_info: fix the request
    (ObjectNotFound, 404),  # the store lacks an object or the run: nothing was published there (yet)
    (FingerprintMismatch, 409),  # another model's run: this engine cannot follow it
    (TensorMismatch, 409),  # the run carries tensors this engine does not hold
    (VersionError, 409),  # the version asked for is not reachable from what the engine holds
    (CodecError, 422),  # a damaged or hostile object: refused before any write
    (DeltaFormatError, 422),
    (IntegrityError, 422),
    (ManifestError, 422),
    (StoreError, 502),  # the store did not answer: not the request's fault
)
_MARK = re.compile(r"deltasync refused \(HTTP (\d{3}) (\w+)\): (.*)", re.S)


def refusal_text(exc: DeltaSyncError) -> str:
    """``exc`` as the text the backend raises: ``deltasync refused (HTTP 409 FingerprintMismatch): ...``;
    errors of no class in :data:`STATUS` are marked 500."""
    status = next((code for cls, code in STATUS if isinstance(exc, cls)), 500)
    return f"deltasync refused (HTTP {status} {type(exc).__name__}): {exc}"


def status_of(text: str) -> tuple[int, str, str] | None:
    """``(status, error class name, message)`` of a refusal the text carries (wrapped by vLLM or not), or
    ``None`` when it carries none (vLLM then answers as it would)."""
    found = _MARK.search(text)
    if found is None:
        return None
    message = found.group(3)
    # vLLM wraps a worker's error as "... error '<text>', please check the stack trace ...".
    message = re.sub(r"', please check the stack trace.*$", "", message, flags=re.S)
    return int(found.group(1)), found.group(2), message
