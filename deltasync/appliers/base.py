"""Where :func:`check_header` was first defined; it now lives in the apply layer (:mod:`.apply`).

Kept so ``from deltasync.appliers.base import check_header`` still works; new
code imports it from :mod:`deltasync.appliers.apply`.
"""

from __future__ import annotations

from .apply import check_header

__all__ = ["check_header"]
