"""Where a replica goes when no version is named: the newest, at most a version, exactly one, or nowhere.

:class:`~deltasync.replica.subscriber.Subscriber` and
:class:`~deltasync.appliers.vllm.server_follower.ServerFollower` keep a :class:`Pin` each, set by their
``follow`` / ``hold`` / ``go_to`` methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ConfigError

__all__ = ["Pin", "check_version"]


@dataclass(frozen=True, slots=True)
class Pin:
    """Where a replica's updates go when no version is named."""

    mode: Literal["follow", "at-most", "exact", "hold"]
    version: int | None = None
    """The version of an ``"at-most"`` or ``"exact"`` pin."""

    @classmethod
    def following(cls, at_most: int | None = None) -> Pin:
        """The newest version, or the newest up to ``at_most`` (checked: a version number)."""
        return cls("follow" if at_most is None else "at-most", check_version("at_most", at_most))

    @classmethod
    def exactly(cls, version: int) -> Pin:
        """Exactly ``version`` (checked: a version number)."""
        return cls("exact", check_version("version", version, optional=False))

    @property
    def exact(self) -> int | None:
        return self.version if self.mode == "exact" else None

    def target(self, latest: int, held: int | None) -> int | None:
        """The version to go to from ``held`` (``None``: stay)."""
        if self.mode == "hold":
            return None
        if self.mode == "at-most":
            assert self.version is not None
            capped = min(latest, self.version)
            return None if held is not None and held >= capped else capped
        return latest if self.mode == "follow" else self.version

    def __str__(self) -> str:
        return {"follow": "the newest", "hold": "the version held"}.get(self.mode) or (
            f"{'at most' if self.mode == 'at-most' else 'exactly'} v{self.version}")


def check_version(name: str, version: Any, *, optional: bool = True) -> int | None:
    """``version`` if it is a version number (or ``None``, when ``optional``); else a :class:`ConfigError`."""
    if version is None and optional:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ConfigError(f"{name} must be a version number (an integer >= 0), not {version!r}", argument=name)
    return version
