"""The demos, outside the core package: ``deltasync demo`` and the synthetic workload.

- :mod:`.runner`: ``deltasync demo`` (also ``python -m deltasync.demo``), the main job end to end
  on one machine: a CPU trainer publishes every step, two replica processes follow bit-exactly.
- :mod:`.board`: what the demo prints, collected from the trainer's and the replicas' reports.
- :mod:`.workload`: random sparse updates with special values, for soak tests and benchmarks that
  need many versions without a real optimizer.

Nothing in the core package imports these modules; the command line hooks the demo in. The
runner's names are re-exported here, so ``from deltasync.demo import run`` keeps working.
"""

from __future__ import annotations

from .runner import (
    BATCH_SIZE,
    DEFAULT_LR,
    DEFAULT_STEPS,
    MAX_POLL_S,
    POLL_S,
    QUICK_STEPS,
    REPLICAS,
    WAIT_S,
    CommitHasher,
    add_arguments,
    main,
    quiet_transformers,
    run,
    weights_digest,
)

__all__ = [
    "main", "run", "add_arguments", "weights_digest", "CommitHasher", "quiet_transformers",
    "DEFAULT_STEPS", "QUICK_STEPS", "DEFAULT_LR", "BATCH_SIZE", "REPLICAS", "POLL_S", "MAX_POLL_S", "WAIT_S",
]
