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
from .publisher import Publisher
from .resume import Committed, last_committed
from .stores import open_store
from .subscriber import Subscriber

__version__ = "0.1.0"

__all__ = [
    "Publisher", "Subscriber", "TorchModuleApplier", "open_store", "last_committed", "Committed", "DeltaSyncError",
    "__version__",
]
