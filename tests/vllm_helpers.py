"""Shared pieces of the vLLM tests and benchmark: engines, a tiny Qwen3, a trainer.

vLLM starts its engine with spawn; nothing here runs at import time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync.protocol.manifest import MANIFEST_KEY, Manifest
from deltasync.stores import open_store

VLLM_TESTS = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (pip install vllm)"),
]
"""The marks of a test module that starts real vLLM engines."""

EXTENSION = "deltasync.appliers.vllm.worker.DeltaSyncWorkerExtension"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at", "One, two, three,"]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all afternoon.",
    "In 1969, astronauts first walked on the Moon, watched by millions of people on television.",
    "Python is a programming language that lets you work quickly and integrate systems effectively.",
    "Photosynthesis converts light energy into chemical energy that fuels the plant's activities.",
]
_CPU_SHM = "vllm_dist_*"
"""Segments in ``/dev/shm`` of vLLM's CPU all-reduce between tensor-parallel ranks: its workers unlink them when
they exit cleanly, and a shutdown that ends them otherwise leaves them behind (a CI run found two, 4 MB each)."""
ENGINE_ARGS: dict[str, Any] = dict(
    dtype="bfloat16", gpu_memory_utilization=0.15, max_model_len=512, enforce_eager=True, seed=0
)


@contextlib.contextmanager
def engine(
    model: str | Path, *, tp: int = 1, plain: bool = True, extension: bool | str = True, **engine_args: Any
) -> Iterator[Any]:
    """An in-process vLLM ``LLM`` (plain CPU weights unless ``plain=False``), shut down on exit."""
    from vllm import LLM

    env = {"DELTASYNC_VLLM_PLAIN_WEIGHTS": "1" if plain else "0"}
    shm = Path("/dev/shm")
    before = set(shm.glob(_CPU_SHM)) if tp > 1 and shm.is_dir() else None
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned engine processes inherit the environment at start
    try:
        llm = LLM(
            model=str(model),
            tensor_parallel_size=tp,
            **({"worker_extension_cls": extension if isinstance(extension, str) else EXTENSION} if extension else {}),
            **(ENGINE_ARGS | engine_args),
        )
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        if before is not None:  # the run's CPU all-reduce segments, whoever was to unlink them
            for path in set(shm.glob(_CPU_SHM)) - before:
                path.unlink(missing_ok=True)


def greedy(llm: Any, prompts: list[str] = PROMPTS, tokens: int = 8, logprobs: int | None = None) -> list[Any]:
    """Greedy token ids per prompt (with the sampled logprobs when ``logprobs`` is set)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=logprobs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if logprobs is None:
        return [list(o.outputs[0].token_ids) for o in outs]
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in outs
    ]


def logprob_gap(a: list[Any], b: list[Any]) -> float:
    """Largest difference between the sampled tokens' logprobs of two greedy runs (:func:`greedy`'s form)."""
    return max(abs(x - y) for (_, la), (_, lb) in zip(a, b) for x, y in zip(la, lb))


def assert_served(served: list[Any], reference: list[Any], without: list[Any]) -> None:
    """``served`` (:func:`greedy` with logprobs) is what the engine gives for ``reference``'s weights: the
    same tokens, and logprobs far closer to it than to ``without`` (what it would give had the weights or
    adapter under test not been served). Not bit for bit: a vLLM CPU engine's greedy logprobs are not
    reproducible from one run to the next even with the same weights (a last token's moved by 0.001-0.004
    in 2 of 40 repeats of one run); the weights themselves are compared bit for bit where they are held."""
    assert [tokens for tokens, _ in served] == [tokens for tokens, _ in reference]
    assert logprob_gap(served, reference) < 0.25 * logprob_gap(served, without), (
        logprob_gap(served, reference), logprob_gap(served, without))


class Trainer:
    """An fp32 transformers model trained with AdamW on a few sentences (real, non-trivial deltas)."""

    def __init__(self, model_dir: str | Path, *, lr: float = 1e-5, seed: int = 0) -> None:
        import transformers

        torch.manual_seed(seed)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.batch = self.tokenizer(TEXTS, return_tensors="pt", padding=True)

    def step(self) -> float:
        self.model.train()
        out = self.model(**self.batch, labels=self.batch.input_ids.masked_fill(self.batch.attention_mask == 0, -100))
        out.loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(out.loss)

    def bf16(self) -> dict[str, torch.Tensor]:
        """The published weights in their checkpoint names, cast to bf16 (tied ones once; experts per expert)."""
        from deltasync.tensors import published_tensors

        return {n: p.detach().to(torch.bfloat16) for n, p in published_tensors(self.model)}


def latest(store_url: str) -> tuple[str, int]:
    """``(run_id, latest version)`` of a store."""
    manifest = Manifest.from_bytes(open_store(store_url).get(MANIFEST_KEY))
    assert manifest.latest is not None
    return manifest.run_id, manifest.latest


def tiny_qwen3(target: Path, tokenizer_dir: Path) -> Path:
    """A random 2-layer Qwen3 (hidden 128, 4 heads, 2 KV heads, head_dim 32) saved as bf16 safetensors."""
    import transformers

    if (target / ".complete").exists():
        return target
    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    (target / ".complete").touch()
    return target


def tiny_qwen3_moe(
    target: Path,
    tokenizer_dir: Path,
    *,
    shared_expert: bool = False,
    hidden: int = 128,
    experts: int = 8,
    top_k: int = 2,
    width: int = 48,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
) -> Path:
    """A random Qwen3-MoE (default: 2 layers, hidden 128, 8 experts, top-2, expert width 48: vLLM pads it to 64).

    head_dim 32 (the CPU attention needs >= 32); saved as bf16 safetensors with per-expert names.
    ``shared_expert``: a Qwen2-MoE instead, whose layers add a shared expert (width 80) and its gate
    (its head_dim is hidden / heads).
    """
    import transformers

    if (target / ".complete").exists():
        return target
    torch.manual_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=width,
        num_experts=experts,
        num_experts_per_tok=top_k,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if shared_expert:
        model = transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=80)
        )
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**common, head_dim=head_dim))
    model = model.to(torch.bfloat16)
    shutil.rmtree(target, ignore_errors=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    (target / ".complete").touch()
    return target


def runtime_digests(worker: Any) -> dict[str, str]:
    """SHA-256 of every runtime parameter's bytes in a vLLM worker (packed layouts as the kernels read them).

    Run through ``collective_rpc`` (needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``).
    """
    import hashlib

    from deltasync.appliers.vllm.cpu_hooks import plain_weights
    from deltasync.appliers.vllm.mapping import runtime_params

    model = worker.get_model()
    return {
        name: hashlib.sha256(p.data.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, p in runtime_params(model, plain_weights(model)).items()
    }


def save_checkpoint(weights: dict[str, torch.Tensor], source_dir: Path, target: Path) -> Path:
    """A copy of ``source_dir`` (config, tokenizer) with ``weights`` as its safetensors file."""
    import safetensors.torch

    shutil.copytree(source_dir, target, ignore=shutil.ignore_patterns("*.safetensors", ".complete"))
    safetensors.torch.save_file({n: t.contiguous() for n, t in weights.items()}, str(target / "model.safetensors"),
                                metadata={"format": "pt"})
    return target


def assert_engine_exact(follower: Any, weights: dict[str, torch.Tensor]) -> None:
    """Every rank's elements of every tensor in ``weights`` equal it bit for bit, and every element is held.

    The ranks compare what they hold with ``weights`` saved to a file (``VLLMFollower.compare``): moving
    the engine's weights back (``gather``) took 50 s per check through a server's HTTP RPC.
    """
    import tempfile

    import safetensors.torch

    with tempfile.TemporaryDirectory(prefix="expected-") as directory:
        saved = {n: t.detach().contiguous().clone() for n, t in weights.items()}
        safetensors.torch.save_file(saved, str(Path(directory) / "model.safetensors"))
        found = follower.compare(directory)
    assert set(found) == set(weights), sorted(set(weights) ^ set(found))[:5]
    wrong = {n: c["wrong"] for n, c in found.items() if c["wrong"]}
    assert not wrong, f"{len(wrong)} tensors differ: {dict(list(wrong.items())[:5])}"
    missing = {n: c["missing"] for n, c in found.items() if c["missing"]}
    assert not missing, f"elements held by no rank: {dict(list(missing.items())[:5])}"


class BenchExtension:
    """Worker-side timings for ``benchmarks/vllm_apply.py``: vLLM's own update paths, in the same worker.

    Mixed in after :class:`~deltasync.appliers.vllm.worker.DeltaSyncWorkerExtension` (see :data:`BENCH_EXTENSION`).
    """

    def bench_load_full(self, checkpoint: str, repeats: int) -> list[float]:
        """``model.load_weights`` with every full tensor already in memory; ms per repeat."""
        import time

        import safetensors.torch

        tensors = safetensors.torch.load_file(str(Path(checkpoint) / "model.safetensors"))
        model = self.get_model()  # type: ignore[attr-defined]
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            with torch.no_grad():
                model.load_weights(iter(tensors.items()))
            out.append(1e3 * (time.perf_counter() - start))
        return out

    def bench_checkpoint_patches(self, payload: bytes, repeats: int) -> list[float]:
        """vLLM's ``load_checkpoint_weight_patches`` with the same sparse patch; ms per repeat."""
        import time

        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        from deltasync.appliers.vllm.wire import unpack

        index = self._deltasync_index  # type: ignore[attr-defined]
        patches = [
            CheckpointWeightPatch(
                name,
                index.specs[name].shape,
                torch.bfloat16,
                torch.from_numpy(parts["val"]).view(torch.bfloat16),
                torch.from_numpy(parts["idx"]),
            )
            for name, parts in unpack(payload).items()
        ]
        model = self.get_model()  # type: ignore[attr-defined]
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            load_checkpoint_weight_patches(model, patches)
            out.append(1e3 * (time.perf_counter() - start))
        return out


def _bench_extension() -> type:
    from deltasync.appliers.vllm.worker import DeltaSyncWorkerExtension

    return type("DeltaSyncBenchExtension", (DeltaSyncWorkerExtension, BenchExtension), {})


def __getattr__(name: str) -> Any:
    # Resolved by qualified name inside vLLM workers; built lazily so importing this module needs no vllm.
    if name == "DeltaSyncBenchExtension":
        return _bench_extension()
    raise AttributeError(name)


BENCH_EXTENSION = "tests.vllm_helpers.DeltaSyncBenchExtension"


def backend_compared(worker: Any, directory: str) -> tuple[dict[str, dict[str, int]], Any]:
    """In a worker whose engine runs the ``deltasync`` backend: how the elements this rank holds compare with the
    safetensors checkpoint in ``directory`` (``compare_held``), read back through the backend's own index map.

    Run through ``collective_rpc`` (needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``)."""
    from deltasync.appliers.checkpoint.files import checkpoint_reader
    from deltasync.appliers.verify import compare_held, pack_held

    index = worker.weight_transfer_engine.replica.index
    with checkpoint_reader(directory) as loaded, torch.no_grad():
        counts, masks = compare_held(index, loaded)
    return counts, pack_held(masks, text=False)


def assert_backend_exact(llm: Any, weights: dict[str, torch.Tensor]) -> None:
    """Every rank of a backend engine holds ``weights`` bit for bit, and every element is held by some rank."""
    import tempfile

    import safetensors.torch

    from deltasync.appliers.verify import merge_compared
    from deltasync.tensors import TensorSpec

    with tempfile.TemporaryDirectory(prefix="expected-") as directory:
        safetensors.torch.save_file({n: t.detach().contiguous().clone() for n, t in weights.items()},
                                    str(Path(directory) / "model.safetensors"))
        answers = llm.collective_rpc(backend_compared, args=(directory,))
    found = merge_compared({n: TensorSpec.of(n, t) for n, t in weights.items()}, answers)
    assert set(found) == set(weights), sorted(set(weights) ^ set(found))[:5]
    wrong = {n: c for n, c in found.items() if c["wrong"] or c["missing"]}
    assert not wrong, f"{len(wrong)} tensors differ or are not held: {dict(list(wrong.items())[:5])}"


def assert_checksums_hold(checksums: dict[str, str], weights: dict[str, torch.Tensor]) -> int:
    """The server's ``/weight_checker`` checksums of the parameters it keeps as the checkpoint holds them
    (embeddings and norms under their own names; the CPU build repacks a linear layer's weight for its kernels,
    even one it does not fuse) equal SHA-256 of ``weights``' bytes; returns how many were compared."""
    import hashlib

    compared = 0
    for key, digest in checksums.items():
        name = key.rsplit(":", 1)[-1]
        if name in weights and (weights[name].dim() == 1 or "embed" in name):
            data = weights[name].detach().contiguous().view(-1).view(torch.uint8).numpy()
            assert hashlib.sha256(data).hexdigest() == digest, name
            compared += 1
    assert compared, "no parameter of the server carries a checkpoint tensor's name"
    return compared
