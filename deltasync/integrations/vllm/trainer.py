"""Trainer side of the ``deltasync`` backend for code that drives vLLM's own weight-transfer trainer API.

vLLM's ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=...)`` builds a trainer
engine from the ``backend`` its init info names; ``send_weights()`` then pushes one round. With
:class:`DeltaSyncTrainerInitInfo` it builds a :class:`DeltaSyncTrainerEngine`, which:

- at ``trainer_init``: opens a publisher on the run's store (the sender, rank 0) and tells the engine's
  backend which store to follow (``client.init_weight_transfer_engine``);
- at each ``send_weights()``: iterates ``source`` (on every rank, in step: an FSDP source gathers each
  tensor as it goes), publishes the stream as the next version, diffing each tensor as it arrives (memory:
  the published snapshot plus the tensor in hand), and drives the round trip: ``start_weight_update``,
  ``update_weights({"version": v})``, ``finish_weight_update(label)``.

Example:
    ```python
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    engine = WeightTransferTrainerFactory.trainer_init(
        DeltaSyncTrainerInitInfo(store="s3://bucket/run1", rank=0),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"), source=ModuleSource(model),
    )
    engine.send_weights()          # after each optimizer step
    ```
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from ...appliers.vllm.rpc import version_label
from ...errors import ConfigError
from ...publish.publisher import Publisher
from .plugin import register

__all__ = ["DeltaSyncTrainerEngine", "DeltaSyncTrainerInitInfo"]

logger = logging.getLogger("deltasync.vllm")

register()  # a trainer process is no vLLM process: vLLM loads no plugin there, so the backend registers here


@dataclass
class DeltaSyncTrainerInitInfo(TrainerInitInfo):
    """What the trainer side of the ``deltasync`` backend needs: the run's store, the engine's options."""

    backend: ClassVar[str] = "deltasync"

    store: str = ""
    """The run prefix to publish to; the engine's workers read the same URL."""
    publisher_options: dict[str, Any] = field(default_factory=dict)
    """Options of the :class:`~deltasync.Publisher` (``codec``, ``anchor_every``, store options...)."""
    init_info: dict[str, Any] = field(default_factory=dict)
    """More of the engine's ``init_info`` (``cache_dir``...); ``store`` is added."""

    def __post_init__(self) -> None:
        if not isinstance(self.store, str) or not self.store:
            raise ConfigError(f"store must be the run's store URL, not {self.store!r}", argument="store")


class DeltaSyncTrainerEngine(TrainerWeightTransferEngine[DeltaSyncTrainerInitInfo]):
    """vLLM's trainer-side engine for the ``deltasync`` backend: see the module docstring."""

    init_info_cls = DeltaSyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 publisher: Publisher | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.publisher = publisher
        self.step = 0

    @classmethod
    def trainer_init(
        cls, init_info: DeltaSyncTrainerInitInfo, *, client: Any, source: Any = None
    ) -> DeltaSyncTrainerEngine:
        """Open the publisher (rank 0) and point the engine's backend at the store."""
        publisher = None
        if init_info.is_sender:
            publisher = Publisher(None, init_info.store, **init_info.publisher_options)
            client.init_weight_transfer_engine({**init_info.init_info, "store": publisher.store.url})
        return cls(client=client, source=source, is_sender=init_info.is_sender, publisher=publisher)

    def send_weights(self, source: Any = None) -> None:
        """Publish ``source`` (or the one given at ``trainer_init``) as the next version, and have the engine
        apply it; every rank iterates the source, rank 0 publishes and drives the engine."""
        stream = source if source is not None else self.source
        if stream is None:
            raise ConfigError("send_weights needs a source: pass one to trainer_init or here", argument="source")
        if not self.is_sender or self.publisher is None:
            for _ in stream:  # the collectives of a sharded source, in step with the sender
                pass
            return
        self.publisher.publish(self.step, tensors=iter(stream))
        self.publisher.flush()
        self.step += 1
        version = self.publisher.version
        assert version is not None
        run_id = self.publisher.run_id
        self.client.start_weight_update()
        self.client.update_weights({"version": version})
        self.client.finish_weight_update(version_label(version, run_id))

    def shutdown(self) -> None:
        """Close the publisher (its last version committed)."""
        if self.publisher is not None:
            self.publisher.close()
