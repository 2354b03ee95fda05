"""TRL's AsyncGRPOTrainer with weights synced through a store: :class:`DeltaSyncTransfer` is its ``weight_transfer``.

One line switches a TRL + vLLM run from full weights over NCCL to exact sparse versions::

    trainer = AsyncGRPOTrainer(..., weight_transfer=DeltaSyncTransfer(store="s3://bucket/run1"))

with the server started with deltasync's backend (``--weight-transfer-config '{"backend": "deltasync"}'``,
``VLLM_SERVER_DEV_MODE=1``). At each sync TRL calls ``pause()``, ``send_weights(stream)``, ``resume()``
on the main process; :meth:`DeltaSyncTransfer.send_weights` publishes the stream of full tensors TRL
gives it as the next version (diffing each tensor as it arrives: memory stays the published snapshot
plus the tensor in hand), then has the server apply exactly that version through vLLM's round trip
(``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``). The server's ranks fetch the
version from the store themselves; nothing of the weights goes over HTTP.

Pause and resume follow ``mode``: ``"inflight"`` (default) keeps generating (the engine applies the version
between two of its steps), ``"pause"`` drains requests first.

Metrics: each sync's ``deltasync/*`` figures (bytes, sparsity, compression, publish and apply seconds)
join the trainer's logs, as the trainer callback's do. The trainer is found from the stream TRL hands
over (its ``_streaming_iter`` generator), a TRL internal pinned with the rest in :mod:`.grpo_server`'s
tested version.

Limitations:

- Under FSDP2, TRL's stream gathers every tensor to the main process (``full_tensor``); the other ranks
  iterate it in step. Publishing each rank's shard instead (:class:`~deltasync.publish.ShardedPublisher`)
  would need the other ranks, which TRL does not call: see docs/TRL.md.
- A LoRA run syncs merged weights (TRL merges the adapter before the stream).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch

from ...appliers.vllm.rpc import ServerEngine, version_label
from ...errors import ConfigError
from ...publish.engine import PublishInfo
from ...publish.fp8 import fp8_rule, fp8_stream
from ...publish.publisher import Publisher
from ...tensors.fp8 import BlockFp8
from .metrics import publish_metrics

__all__ = ["DeltaSyncTransfer"]

logger = logging.getLogger("deltasync.trl")


class DeltaSyncTransfer:
    """A ``weight_transfer`` for TRL's AsyncGRPOTrainer: each sync is a sparse version in ``store``.

    Args:
        store (`str`): the run prefix to publish to; the server's workers read the same URL.
        server (`str`, *optional*): the vLLM server's base URL (default: the trainer's
            ``vllm_server_base_url``, read at the first sync, else ``http://127.0.0.1:8000``).
        mode (`"inflight"` or `"pause"`, *optional*, defaults to ``"inflight"``): keep generating during a
            sync, or drain requests first (``/pause?mode=wait``).
        init_info (`dict`, *optional*): more of the backend's ``init_info`` (``cache_dir``...).
        fp8 (`bool` or `BlockFp8`, *optional*): publish the weights' block-fp8 view (:mod:`deltasync.publish.fp8`)
            for a server that serves an fp8 checkpoint: ``True`` for 128x128 blocks, or a rule.
        **publisher_options: options of the :class:`~deltasync.Publisher` (``codec``, ``anchor_every``...).
    """

    def __init__(
        self,
        store: str,
        server: str | None = None,
        *,
        mode: Literal["inflight", "pause"] = "inflight",
        init_info: dict[str, Any] | None = None,
        fp8: bool | BlockFp8 = False,
        **publisher_options: Any,
    ) -> None:
        if mode not in ("inflight", "pause"):
            raise ConfigError(f"mode must be 'inflight' or 'pause', not {mode!r}", argument="mode")
        if not isinstance(store, str) or not store:
            raise ConfigError(f"store must be a store URL, not {store!r}", argument="store")
        self.store_url, self.server_url, self.mode = store, server, mode
        self.init_info = dict(init_info or {})
        self.fp8 = fp8_rule(fp8)
        if self.fp8 is not None and publisher_options.get("dtype", None) is not None:
            raise ConfigError("fp8=True publishes e4m3 and bf16 tensors of its own: leave dtype out", argument="dtype")
        self.publisher_options = {**publisher_options, "dtype": None} if self.fp8 is not None else publisher_options
        self.publisher: Publisher | None = None
        self.server: ServerEngine | None = None
        self.syncs = 0
        self._unlogged: list[PublishInfo] = []
        self._apply_s: list[float] = []
        self._lock = threading.Lock()
        self._attached = False

    # ------------------------------------------------------------------ TRL's WeightTransferProtocol

    def init_weight_transfer(self) -> None:
        """Open the publisher; the server is told which store to follow at the first sync."""
        self.publisher = Publisher(None, self.store_url, on_publish=self._collect, **self.publisher_options)

    def pause(self) -> None:
        """``"pause"`` mode: let the requests in flight finish, admit no new ones."""
        if self.mode == "pause" and self.server is not None:
            self.server.pause("wait")

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish TRL's stream of full tensors as the next version; have the server apply exactly it."""
        if self.publisher is None:
            self.init_weight_transfer()
        assert self.publisher is not None
        self._attach(iterator)
        first = self.server is None
        if first:
            self.server = ServerEngine(self.server_url or _server_of(iterator) or "http://127.0.0.1:8000")
            if self.mode == "pause":
                self.server.pause("wait")  # TRL paused before the server was known
        tensors = iterator if self.fp8 is None else fp8_stream(iterator, self.fp8)
        self.publisher.publish(self.syncs, tensors=tensors)
        self.publisher.flush()
        self.syncs += 1
        version = self.publisher.version
        assert version is not None
        if first:
            self.server.init_weight_transfer_engine({**self.init_info, "store": self.publisher.store.url})
        started = time.perf_counter()
        self.server.start_weight_update()
        self.server.update_weights({"version": version})
        self.server.finish_weight_update(version_label(version, self.publisher.run_id))
        with self._lock:
            self._apply_s.append(time.perf_counter() - started)

    def resume(self) -> None:
        """``"pause"`` mode: admit requests again."""
        if self.mode == "pause" and self.server is not None:
            self.server.resume()

    def destroy(self) -> None:
        """Commit what is pending and close the publisher; the server keeps the last version."""
        if self.publisher is not None:
            self.publisher.close()

    # ------------------------------------------------------------------ metrics

    def metrics(self) -> dict[str, float]:
        """``deltasync/*`` figures since the previous call, as the trainer's logs get them."""
        with self._lock:
            infos, self._unlogged = self._unlogged, []
            applies, self._apply_s = self._apply_s, []
        out = publish_metrics(infos, self.publisher.version if self.publisher is not None else None)
        if applies:
            out["deltasync/apply_s"] = sum(applies) / len(applies)
        return out

    def _collect(self, info: PublishInfo) -> None:  # the publisher's worker thread
        with self._lock:
            self._unlogged.append(info)

    def _attach(self, iterator: Any) -> None:
        """Join the trainer's logs, once: the trainer owns the stream TRL hands over."""
        if self._attached:
            return
        self._attached = True
        trainer = _trainer_of(iterator)
        handler = getattr(trainer, "callback_handler", None)
        if not isinstance(getattr(handler, "callbacks", None), list):
            logger.info("deltasync: the trainer is not reachable from its weight stream; metrics stay in metrics()")
            return
        from transformers import TrainerCallback

        transfer = self

        class _Metrics(TrainerCallback):  # type: ignore[misc]
            def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                       **kwargs: Any) -> None:
                if logs is None:
                    return
                metrics = transfer.metrics()
                logs.update(metrics)
                if state.log_history and state.log_history[-1].get("step") == state.global_step:
                    state.log_history[-1].update(metrics)

        # First, ahead of the reporting integrations (wandb, the printer...), so they log the figures too. A new
        # list: TRL syncs from inside a callback event, whose loop keeps iterating the list it started with.
        handler.callbacks = [_Metrics(), *handler.callbacks]


def _trainer_of(iterator: Any) -> Any:
    """The trainer whose ``_streaming_iter`` generator ``iterator`` is (TRL 1.16), or ``None``."""
    frame = getattr(iterator, "gi_frame", None)
    owner = frame.f_locals.get("self") if frame is not None else None
    return owner if owner is not None and hasattr(owner, "accelerator") else None


def _server_of(iterator: Any) -> str | None:
    """The server URL the trainer generates from (``args.vllm_server_base_url``), if it says."""
    trainer = _trainer_of(iterator)
    url = getattr(getattr(trainer, "args", None), "vllm_server_base_url", None)
    return url if isinstance(url, str) and url else None
