"""Acting on a live run from outside its publishing loop.

- :mod:`.rollback`: :func:`rollback`, a new version whose weights equal an earlier one's, bit for bit, the
  versions between retracted (``deltasync rollback URL --to r``).
"""

from __future__ import annotations

from .rollback import Rollback, rollback, weights_at

__all__ = ["Rollback", "rollback", "weights_at"]
