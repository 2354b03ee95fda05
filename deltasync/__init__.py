"""deltasync: exact sparse bf16 weight sync for asynchronous RL, through object storage.

The trainer publishes; replicas follow; the store is the wire::

    from deltasync import Publisher, Subscriber, TorchModuleApplier

    publisher = Publisher(model, "s3://bucket/run1")      # trainer
    publisher.publish(step)

    Subscriber("s3://bucket/run1", TorchModuleApplier(replica_model)).start()   # replica
"""

from __future__ import annotations

from .appliers import TorchModuleApplier
from .errors import DeltaSyncError
from .protocol.resume import Committed, last_committed
from .publish.publisher import Publisher
from .replica.applier import Applier
from .replica.subscriber import Subscriber
from .stores import open_store

__version__ = "0.1.0"

__all__ = [
    "Publisher", "Subscriber", "Applier", "TorchModuleApplier", "open_store", "last_committed", "Committed",
    "DeltaSyncError", "__version__",
]
