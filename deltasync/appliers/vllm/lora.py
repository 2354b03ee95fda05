"""Node side of a LoRA run published in adapter form: the factors, held on the host, served as a vLLM LoRA.

A run published with :class:`deltasync.publish.lora.LoraWeights` carries, besides the
base model's tensors, the adapter's factors (``...lora_A.weight``,
``...lora_B.weight``, fp32). :class:`AdapterHost` is the part of a
:class:`~deltasync.appliers.vllm.follower.VLLMFollower` that holds them: the
follower writes the base names into the engine as usual and hands the factors
here, where a :class:`~deltasync.appliers.torch_module.TorchModuleApplier` applies
them exactly to host copies. After each version that changed them, the factors
are written as a PEFT adapter directory (:func:`deltasync.publish.lora.write_adapter`,
bit for bit what the trainer's ``save_pretrained`` would write) and served:

- In process (an ``LLM`` started with ``enable_lora=True``):
  :attr:`AdapterHost.request` becomes a new ``LoRARequest`` for it (a new id
  per version: vLLM caches adapters by id), and the previous adapter is removed
  from the engine. While the factors add nothing (every ``lora_B`` zero: the
  run is in its merged form) ``request`` is ``None`` and the engine's own
  weights serve the merged policy. Generate with ``lora_request=follower.lora_request``.
- A ``vllm serve`` server (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):
  the directory is loaded in place under one stable name
  (``/v1/load_lora_adapter``, ``load_inplace``), ``"deltasync"`` unless told
  otherwise, so clients always ask for ``model="deltasync"``. In the merged
  form that adapter is zero and adds nothing.

Either way the load happens inside the follower's apply, while a server's
scheduler is frozen, so no engine step sees the new base weights with the old
adapter. The previous version's directory is deleted once the new one is loaded.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...codec import Decoded
from ...publish.lora import LORA_NAME, adapter_active, adapter_specs, load_config, write_adapter
from ...tensors import TensorSpec
from ..torch_module import TorchModuleApplier
from .rpc import InProcessEngine, ServerEngine

__all__ = ["AdapterHost", "LORA_NAME"]

logger = logging.getLogger("deltasync.vllm")


class AdapterHost:
    """The factors of a LoRA run, held on the host and served by a vLLM engine as a LoRA adapter.

    Args:
        engine (`InProcessEngine` or `ServerEngine`): the follower's engine.
        model_dir (`str` or `Path`): the base checkpoint the engine loaded.
        config: the adapter's ``LoraConfig``, or an adapter directory / ``adapter_config.json``.
        name (`str`, *optional*, defaults to ``"deltasync"``): the adapter's name on a server.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): the trainer's adapter dtype.
    """

    def __init__(
        self,
        engine: InProcessEngine | ServerEngine,
        model_dir: str | Path,
        config: Any,
        *,
        name: str = LORA_NAME,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.engine, self.name = engine, name
        self.config = load_config(config)
        self.config.base_model_name_or_path = str(model_dir)
        self.specs: dict[str, TensorSpec] = {s.name: s for s in adapter_specs(model_dir, self.config, dtype=dtype)}
        self.factors = {n: torch.zeros(s.shape, dtype=s.torch_dtype) for n, s in self.specs.items()}
        self._applier = TorchModuleApplier(self.factors, dtype=None)
        self._root = Path(tempfile.mkdtemp(prefix="deltasync-lora-"))
        # Removed by close(), or when the host is collected or the process exits, whichever comes first.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._root, True)
        self.request: Any = None
        """In process: the ``LoRARequest`` of the newest version's adapter, or ``None`` while it adds nothing."""
        self.directory: Path | None = None
        """Where the newest version's adapter was written (``None`` before the first)."""

    def lookup(self, name: str, indices: np.ndarray) -> np.ndarray:
        """Current bits of factor ``name`` at ``indices``."""
        return self._applier.lookup(name, indices)

    def apply(self, decoded: Mapping[str, Decoded], version: int | None) -> None:
        """Write changed factors; then serve them (or nothing, when they add nothing) from this version on."""
        if not decoded:
            return
        self._applier.apply(decoded)
        if version is None:
            return  # more of the same version follows
        old = self.directory
        if isinstance(self.engine, ServerEngine):
            self.directory = write_adapter(self.factors, self.config, self._root / f"v{version}")
            self.engine.load_lora(self.name, str(self.directory))
        else:
            self._serve_in_process(version)
        if old is not None and old != self.directory:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("deltasync: v%s serves %s", version, self.directory or "the base weights (no adapter)")

    def _serve_in_process(self, version: int) -> None:
        from vllm.lora.request import LoRARequest

        old, self.request, self.directory = self.request, None, None
        if adapter_active(self.factors):
            self.directory = write_adapter(self.factors, self.config, self._root / f"v{version}")
            self.request = LoRARequest(f"{self.name}-v{version}", version + 1, str(self.directory))
        if old is not None:
            self.engine.llm.llm_engine.remove_lora(old.lora_int_id)

    def close(self) -> None:
        """Delete the adapter directories."""
        self._cleanup()
