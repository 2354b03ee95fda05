"""The one error hierarchy of deltasync.

Every error deltasync raises on purpose derives from :class:`DeltaSyncError`.
Children also inherit the builtin that matches their meaning, so code that
already catches ``ValueError`` or ``FileNotFoundError`` keeps working.

Errors carry the data that explains them (key, version, tensor name) as
attributes and are picklable, so they cross process boundaries intact (vLLM
workers, subscriber processes).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DeltaSyncError",
    "ConfigError",
    "DeltaFormatError",
    "CodecError",
    "FingerprintMismatch",
    "TensorMismatch",
    "LayoutMismatch",
    "QuantizationError",
    "VersionError",
    "IntegrityError",
    "ManifestError",
    "ConflictError",
    "StoreError",
    "ObjectNotFound",
    "PreconditionFailed",
    "MissingDependency",
    "UnsupportedVersion",
    "ReplicaTimeout",
]


class DeltaSyncError(Exception):
    """Root of every error deltasync raises on purpose."""

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.message = message
        self.context = context
        for key, value in context.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild from message and keyword context so the error survives pickling
        # across process boundaries (spawned engines, subscriber processes).
        return (_rebuild, (type(self), self.message, self.context))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[DeltaSyncError], message: str, context: dict[str, Any]) -> DeltaSyncError:
    return cls(message, **context)


class ConfigError(DeltaSyncError, ValueError):
    """An argument, store URL or model given to a constructor cannot work; the message names it
    (``argument``) and says what is accepted. Raised before anything is read or written."""


class DeltaFormatError(DeltaSyncError, ValueError):
    """A delta or anchor file is malformed: bad header, metadata, or tensor layout."""


class CodecError(DeltaFormatError):
    """An encoded index or value stream cannot be decoded exactly as declared."""


class FingerprintMismatch(DeltaSyncError, ValueError):
    """A file or manifest was made for a different model (names, shapes or dtypes)."""


class TensorMismatch(DeltaSyncError, ValueError):
    """A tensor named by a delta is missing, or has another shape or dtype, on the receiver."""


class LayoutMismatch(TensorMismatch):
    """An engine keeps a parameter in a layout its index map does not describe, so it cannot be patched exactly.

    Raised when a replica's map does not prove against the weights the engine
    loaded (a kernel's packing, padding or quantization the map does not know),
    and when patches read back differently right after they were written.
    ``name`` is the runtime parameter.
    """


class QuantizationError(DeltaSyncError, ValueError):
    """A tensor has no view under the published quantization rule (an inf or NaN where fp8 has none);
    ``name`` names it. Raised at publish, before anything of the version is written."""


class VersionError(DeltaSyncError, ValueError):
    """A version does not follow from the one the receiver holds (wrong base, going backwards)."""


class IntegrityError(DeltaSyncError, ValueError):
    """Downloaded bytes do not match the size or hash the manifest promised."""


class ManifestError(DeltaSyncError, ValueError):
    """A manifest is malformed, unsafe (path traversal) or inconsistent."""


class ConflictError(DeltaSyncError, RuntimeError):
    """Another writer owns this run prefix (a second trainer, or a lost lease)."""


class StoreError(DeltaSyncError, OSError):
    """A storage backend failed after retries; ``backend`` and ``key`` say where."""


class ObjectNotFound(StoreError, FileNotFoundError):
    """The key does not exist in the store."""


class PreconditionFailed(StoreError):
    """A conditional write lost: the object exists, or changed since it was read."""


class MissingDependency(DeltaSyncError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


class UnsupportedVersion(DeltaSyncError, ImportError):
    """An integration meets a library version it was not tested with (its internals may differ)."""


class ReplicaTimeout(DeltaSyncError, TimeoutError):
    """Replicas did not reach the version a caller waits for in time."""


def require(module: str, extra: str) -> Any:
    """Import an optional dependency or raise :class:`MissingDependency` naming the extra.

    Args:
        module (`str`): the module to import, e.g. ``"obstore"``.
        extra (`str`): the deltasync extra that installs it, e.g. ``"s3"``.

    Returns:
        The imported module.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependency(
            f"{module!r} is required for this feature: pip install 'deltasync[{extra}]'",
            module=module,
            extra=extra,
        ) from exc
