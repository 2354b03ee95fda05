"""Checks every constructor shares: whole numbers and finite amounts, refused with a :class:`ConfigError`
that names the argument, before anything is read or written."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError

__all__ = ["check_int", "check_number"]


def check_int(name: str, value: Any, *, low: int, high: int | None = None) -> None:
    """Refuse ``value`` unless it is an integer (not a bool) in ``[low, high]`` (no upper bound: ``None``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name} must be an integer {span}, got {value!r}", argument=name)


def check_number(name: str, value: Any, *, zero_ok: bool = False) -> None:
    """Refuse ``value`` unless it is a finite real number (not a bool), above zero (or zero, with ``zero_ok``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}", argument=name)
