"""Every TRL internal deltasync touches, in one version-pinned module.

:class:`DeltaSyncGRPOTrainer` is TRL's ``GRPOTrainer`` whose vLLM *server*
mode syncs weights through a deltasync store instead of NCCL:

- the trainer never opens the NCCL communicator (``VLLMClient.init_communicator``
  is not called), so it needs no GPU, no shared network and no rendezvous port
  with the inference servers; it still generates through the server's
  OpenAI-compatible ``/v1/completions`` with TRL's own ``VLLMClient``;
- ``sync_weights`` becomes "publish, then wait if the policy asks"
  (:meth:`DeltaSyncCallback.sync`). The server is kept current by the deltasync
  follower (``deltasync follow``), not by the trainer;
  the follower also resets the server's prefix cache after each apply, so every
  client of the server (not only this trainer) stops reusing stale KV blocks.

Why a subclass and not a function applied to a trainer: ``GRPOTrainer.__init__``
opens the communicator, so the change must be in place before construction,
and a subclass scopes it to one trainer object. During ``__init__`` only, the
``VLLMGeneration`` name in ``trl.trainer.grpo_trainer`` is bound to a subclass
carrying this trainer's callback (under a lock; restored afterwards), because
TRL builds its generation backend from that module global and offers no
factory hook. Colocate mode keeps TRL's own (in-process) sync; the callback
still publishes for external replicas.

TRL internals used (checked at import): ``trl.trainer.grpo_trainer.VLLMGeneration``,
``VLLMGeneration._init_vllm`` / ``sync_weights`` / ``mode`` / ``server_*`` /
``group_port`` / ``accelerator`` / ``vllm_client``, and
``trl.generation.vllm_generation.VLLMClient``. Tested with TRL 1.16.0 only;
other versions raise :class:`TRLVersionError` unless ``DELTASYNC_TRL_UNTESTED=1``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ...errors import UnsupportedVersion, require
from .callback import DeltaSyncCallback

__all__ = ["DeltaSyncGRPOTrainer", "TRLVersionError", "TESTED_TRL_VERSIONS"]

TESTED_TRL_VERSIONS = frozenset({"1.16.0"})
UNTESTED_ENV = "DELTASYNC_TRL_UNTESTED"

logger = logging.getLogger("deltasync.trl")


class TRLVersionError(UnsupportedVersion):
    """The installed TRL is not a version this integration was tested with (its internals may differ)."""


def _check_trl() -> Any:
    trl = require("trl", "trl")
    version = getattr(trl, "__version__", "unknown")
    if version not in TESTED_TRL_VERSIONS and os.environ.get(UNTESTED_ENV) != "1":
        raise TRLVersionError(
            f"deltasync's GRPOTrainer integration patches TRL internals and was tested with TRL "
            f"{', '.join(sorted(TESTED_TRL_VERSIONS))}, not {version}: pip install 'trl==1.16.0', or set "
            f"{UNTESTED_ENV}=1 to try anyway (DeltaSyncCallback alone works with any version)",
            found=version,
        )
    from trl.generation import vllm_generation
    from trl.trainer import grpo_trainer

    missing = [
        what
        for what, ok in [
            ("trl.trainer.grpo_trainer.VLLMGeneration", hasattr(grpo_trainer, "VLLMGeneration")),
            ("trl.generation.vllm_generation.VLLMClient", hasattr(vllm_generation, "VLLMClient")),
            ("VLLMGeneration._init_vllm", hasattr(getattr(grpo_trainer, "VLLMGeneration", None), "_init_vllm")),
            ("VLLMGeneration.sync_weights", hasattr(getattr(grpo_trainer, "VLLMGeneration", None), "sync_weights")),
        ]
        if not ok
    ]
    if missing:
        raise TRLVersionError(f"TRL {version} lacks what deltasync patches: {', '.join(missing)}", found=version)
    return trl


_trl = _check_trl()
logger.info(
    "deltasync: TRL %s lists vLLM 0.22-0.31 as supported and warns about any other version; deltasync's GRPO "
    "server mode uses only vLLM's OpenAI-compatible endpoints and is tested with vLLM 0.32",
    getattr(_trl, "__version__", "?"),
)
from trl import GRPOTrainer  # noqa: E402
from trl.generation import vllm_generation as _vllm_generation  # noqa: E402
from trl.trainer import grpo_trainer as _grpo_module  # noqa: E402

_BaseGeneration = _grpo_module.VLLMGeneration
_construct_lock = threading.Lock()


class _DeltaSyncGeneration(_BaseGeneration):  # type: ignore[misc, valid-type]
    """TRL's vLLM backend with server-mode weight sync through a store (``_deltasync`` set per trainer)."""

    _deltasync: DeltaSyncCallback

    def _init_vllm(self) -> None:
        if self.mode != "server":
            return super()._init_vllm()
        if self.accelerator.is_main_process:
            base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
            # TRL's client, for generation; no init_communicator(): weights travel through the store.
            self.vllm_client = _vllm_generation.VLLMClient(
                base_url=base_url, group_port=self.group_port, connection_timeout=self.server_timeout
            )
        self.accelerator.wait_for_everyone()
        return None

    def sync_weights(self) -> None:
        if self.mode != "server":
            return super().sync_weights()
        # Every rank: under FSDP each takes part in publishing; only the main process waits for replicas
        # (the other ranks receive its generations). The follower resets the server's prefix cache.
        callback = self._deltasync
        callback.sync()
        if callback.serves_adapter and self.accelerator.is_main_process and self.vllm_client.model != callback.lora_name:
            # A LoRA run in adapter form is served under one adapter name, which the server's follower loads
            # with the first version it applies: generate from it, never from the bare base model.
            callback.publisher.flush()
            callback.wait_for(callback.version)
            self.vllm_client.model = callback.lora_name
        return None


class DeltaSyncGRPOTrainer(GRPOTrainer):  # type: ignore[misc, valid-type]
    """``GRPOTrainer`` that publishes every step to a deltasync store and, in vLLM server mode, syncs through it.

    Args:
        *args, **kwargs: as for ``trl.GRPOTrainer``.
        deltasync (`DeltaSyncCallback` or `str`): the callback (sync policy, store options), or a store URL
            for ``DeltaSyncCallback(url)``.

    Example:
        ```python
        >>> trainer = DeltaSyncGRPOTrainer(
        ...     model=model, reward_funcs=reward, train_dataset=data,
        ...     args=GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://replica:8000"),
        ...     deltasync=DeltaSyncCallback("s3://bucket/run1", sync="on_policy"),
        ... )
        >>> trainer.train()
        ```
    """

    def __init__(self, *args: Any, deltasync: DeltaSyncCallback | str, **kwargs: Any) -> None:
        callback = deltasync if isinstance(deltasync, DeltaSyncCallback) else DeltaSyncCallback(deltasync)
        kwargs["callbacks"] = [c for c in (kwargs.get("callbacks") or []) if c is not callback]
        generation = type("DeltaSyncVLLMGeneration", (_DeltaSyncGeneration,), {"_deltasync": callback})
        with _construct_lock:
            _grpo_module.VLLMGeneration = generation
            try:
                super().__init__(*args, **kwargs)
            finally:
                _grpo_module.VLLMGeneration = _BaseGeneration
        self.deltasync = callback.attach(self)  # ahead of report_to integrations: deltasync/* metrics reach them
        if self.use_vllm and self.vllm_mode == "server" and self.accelerator.is_main_process:
            callback.watch_server(self.vllm_generation.vllm_client.base_url)
