"""Node side of a LoRA run published in adapter form: the factors, held on the host, served as a vLLM LoRA.

A run published with :class:`deltasync.lora.LoraWeights` carries, besides the
base model's tensors, the adapter's factors (``...lora_A.weight``,
``...lora_B.weight``, fp32). :class:`AdapterHost` is the part of a
:class:`~deltasync.appliers.vllm_follower.VLLMFollower` that holds them: the
follower writes the base names into the engine as usual and hands the factors
here, where a :class:`~deltasync.appliers.torch.TorchModuleApplier` applies
them exactly to host copies. After each version that changed them, the factors
are written as a PEFT adapter directory (:func:`deltasync.lora.write_adapter`,
bit for bit what the trainer's ``save_pretrained`` would write) and
:attr:`AdapterHost.request` becomes a new ``LoRARequest`` for it; the previous
adapter is removed from the engine and its directory deleted. While the
factors add nothing (every ``lora_B`` zero: the run is in its merged form),
``request`` is ``None`` and the engine serves its base weights, which then hold
the merged policy.

The engine must be started with ``enable_lora=True`` and a ``max_lora_rank``
of at least the adapter's rank. Generation passes ``lora_request=follower.lora_request``.

Limitation: in-process engines (``LLM``) only; a ``vllm serve`` replica would
load each directory through ``/v1/load_lora_adapter``, which is not wired here.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..codec import Decoded
from ..lora import adapter_active, adapter_specs, load_config, write_adapter
from ..tensors import TensorSpec
from .torch import TorchModuleApplier

__all__ = ["AdapterHost"]

logger = logging.getLogger("deltasync.vllm")


class AdapterHost:
    """The factors of a LoRA run, held on the host and served to an in-process vLLM engine as a LoRA adapter.

    Args:
        llm (`vllm.LLM`): the engine (started with ``enable_lora=True``).
        model_dir (`str` or `Path`): the base checkpoint the engine loaded.
        config: the adapter's ``LoraConfig``, or an adapter directory / ``adapter_config.json``.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): the trainer's adapter dtype.
    """

    def __init__(self, llm: Any, model_dir: str | Path, config: Any, *, dtype: torch.dtype = torch.float32) -> None:
        self.llm = llm
        self.config = load_config(config)
        self.config.base_model_name_or_path = str(model_dir)
        self.specs: dict[str, TensorSpec] = {s.name: s for s in adapter_specs(model_dir, self.config, dtype=dtype)}
        self.factors = {n: torch.zeros(s.shape, dtype=s.torch_dtype) for n, s in self.specs.items()}
        self._applier = TorchModuleApplier(self.factors, dtype=None)
        self._root = Path(tempfile.mkdtemp(prefix="deltasync-lora-"))
        self.request: Any = None
        """The ``LoRARequest`` of the newest version's adapter, or ``None`` while the factors add nothing."""
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
            return  # more of the same version follows (an anchor in parts)
        from vllm.lora.request import LoRARequest

        old_request, old_directory = self.request, self.directory
        self.request = self.directory = None
        if adapter_active(self.factors):
            self.directory = write_adapter(self.factors, self.config, self._root / f"v{version}")
            # A new id per version: vLLM caches adapters by id.
            self.request = LoRARequest(f"deltasync-v{version}", version + 1, str(self.directory))
        if old_request is not None:
            self.llm.llm_engine.remove_lora(old_request.lora_int_id)
        if old_directory is not None:
            shutil.rmtree(old_directory, ignore_errors=True)
        logger.info("deltasync: v%s serves %s", version, self.directory or "the base weights (no adapter)")

    def close(self) -> None:
        """Delete the adapter directories."""
        shutil.rmtree(self._root, ignore_errors=True)
