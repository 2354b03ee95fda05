"""The run prefix's shared records: what a writer and its readers agree on, through the store alone.

- :mod:`.keys`: where objects live in a run prefix.
- :mod:`.manifest`: the manifest (the commit point), its validity, route planning and retention. Pure.
- :mod:`.commit`: taking a prefix, the compare-and-swap manifest write, retention and garbage rules.
- :mod:`.retired`: objects retention dropped, waiting out their grace period.
- :mod:`.resume`: where a restarted trainer stands.
- :mod:`.acks`: replica acknowledgements, how a fleet is seen without a control plane.

Pure rules: every module here does I/O only through a :class:`~deltasync.stores.Store` it is given.
"""

from __future__ import annotations

from .manifest import Manifest, ObjectRef, VersionEntry
from .resume import Committed, last_committed

__all__ = ["Committed", "Manifest", "ObjectRef", "VersionEntry", "last_committed"]
