"""Replica side: follow a run's manifest, fetch and verify its objects, hand validated patches to an applier.

- :class:`Subscriber` (:mod:`.subscriber`): which manifest to trust, which version is held, when to poll.
- :class:`Applier` (:mod:`.applier`): what a replica's weights offer a subscriber.
- :mod:`.fetch`: a route's downloads, verified and decoded; :mod:`.ranged`: some tensors of an object by
  byte range; :mod:`.cache`: a read-through cache shared by a node's replicas.
"""

from __future__ import annotations

from .applier import Applier
from .cache import CachedStore
from .subscriber import Subscriber, UpdateInfo

__all__ = ["Applier", "CachedStore", "Subscriber", "UpdateInfo"]
