"""Trainer side: what a trainer publishes, and how each version reaches the store.

- :class:`Publisher` (:mod:`.publisher`): one process's weights, diffed on the training thread, encoded and
  uploaded in the background, committed by manifest.
- :class:`ShardedPublisher` (:mod:`.sharded`): one rank of a sharded or data-parallel trainer.
- :mod:`.engine`: the machinery both drive (writing versions, the background worker); :mod:`.options`:
  their options and defaults.
- What a trainer publishes: :mod:`.forms` (weights with several exact forms), :mod:`.lora` (a LoRA run as
  merged weights or adapter, whichever is smaller), :mod:`.peft` (a PEFT model's merged weights), :mod:`.fp8`
  (the block-fp8 view, for replicas that serve fp8 weights).
- :mod:`.diff`: exact change detection against the last published version.
"""

from __future__ import annotations

from .engine import PublisherStats, PublishInfo
from .options import PublishOptions
from .publisher import Publisher
from .sharded import ShardedPublisher

__all__ = ["PublishInfo", "PublishOptions", "Publisher", "PublisherStats", "ShardedPublisher"]
