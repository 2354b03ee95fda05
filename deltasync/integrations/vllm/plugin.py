"""deltasync's vLLM plugin: what installing deltasync adds to every vLLM process (``vllm.general_plugins``).

vLLM calls :func:`register` once in each of its processes at start. It:

- registers the ``deltasync`` weight-transfer backend with vLLM's worker-side registry
  (:mod:`deltasync.appliers.vllm.backend`) and trainer-side registry (:mod:`.trainer`), by module path:
  nothing is imported until a server or trainer selects the backend;
- in a worker on the CPU platform, wraps vLLM's CPU weight packing so that an engine whose
  ``weight_transfer_config`` selects ``deltasync`` keeps its Linear and expert weights patchable
  (:mod:`deltasync.appliers.vllm.cpu_hooks`, :mod:`deltasync.appliers.vllm.cpu_experts`). An engine that
  selects any other backend, or none, is packed exactly as vLLM packs it: the wrappers ask the engine's
  config at load time and step aside;
- in the API server process, answers the backend's refusals with their 4xx status instead of a 500
  (:mod:`deltasync.appliers.vllm.refusals`); every other error keeps vLLM's answer.

Each step is idempotent and does nothing where vLLM lacks what it needs.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["register", "selected"]

logger = logging.getLogger("deltasync.vllm")

_REGISTERED = False


def register() -> None:
    """vLLM's entry point (``vllm.general_plugins``): see the module docstring."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    _register_backend()
    _wrap_cpu_packing()
    _answer_refusals_with_their_status()


def selected() -> bool:
    """Whether the vLLM config in force (an engine loading its model) selects the ``deltasync`` backend."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return False
    config = get_current_vllm_config_or_none()
    transfer = getattr(config, "weight_transfer_config", None)
    return getattr(transfer, "backend", None) == "deltasync"


def _register_backend() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    except ImportError:  # a vLLM without the weight-transfer registry
        return
    for factory, module, name in (
        (WeightTransferEngineFactory, "deltasync.appliers.vllm.backend", "DeltaSyncWeightTransferEngine"),
        (WeightTransferTrainerFactory, "deltasync.integrations.vllm.trainer", "DeltaSyncTrainerEngine"),
    ):
        try:
            factory.register_engine("deltasync", module, name)
        except ValueError:  # registered already in this process
            pass


def _wrap_cpu_packing() -> None:
    """Keep weights patchable on the CPU platform, for engines that select the backend only."""
    from ...appliers.vllm.cpu_experts import install_expert_hooks
    from ...appliers.vllm.cpu_hooks import install_cpu_hooks

    install_cpu_hooks(when=selected)
    install_expert_hooks(when=selected)


def _answer_refusals_with_their_status() -> None:
    """Wrap the API server's catch-all exception handler, where this is the API server's process."""
    register_module = sys.modules.get("vllm.entrypoints.serve.exception_handling.register")
    if register_module is None:  # not a server process (or its app is not being built here)
        return
    original = getattr(register_module, "exception_handler", None)
    if original is None or getattr(original, "deltasync", False):
        return

    async def handler(request: Any, exc: Exception) -> Any:
        from ...appliers.vllm.refusals import status_of

        found = status_of(str(exc))
        if found is None:
            return await original(request, exc)
        from starlette.responses import JSONResponse

        status, kind, message = found
        body = {"error": {"message": message, "type": kind, "code": status, "param": None}}
        return JSONResponse(body, status_code=status)

    handler.deltasync = True  # type: ignore[attr-defined]
    register_module.exception_handler = handler
