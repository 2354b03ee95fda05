"""Block-fp8 vLLM replicas: vLLM's own loaders and post-processing, patched by the run's fp8 versions.

A bf16 transformers trainer (a Llama and a Qwen3-MoE, AdamW) publishes its block-fp8 view; the engine
loads the view's first version as an fp8 checkpoint (``quantization_config``: ``fp8``, block 128x128).
vLLM's CPU build has no block-fp8 engine that serves here (docs/VLLM.md, "Block-fp8 engines"), so the
model is built in process with vLLM's real config, loaders and post-processing
(``tests/vllm_fp8_inprocess.py``), and driven through deltasync's worker extension as a follower drives
it: map, proof, every version's files, read-back. After every version each tensor reads back as the
reference quantizer's output of the trainer's weights; at the end every runtime parameter (fused
q/k/v and gate/up with their block scales, stacked experts with theirs) equals a fresh model's loaded
from the last version's reference checkpoint, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from deltasync import Publisher
from deltasync.appliers.vllm.quantized import check_quantization, engine_rule
from deltasync.errors import LayoutMismatch
from deltasync.publish.fp8 import BlockFp8View
from deltasync.tensors import TensorSpec, published_tensors
from deltasync.tensors.fp8 import quantize_all
from tests.vllm_helpers import VLLM_TESTS

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# Four KV heads of 64: at TP=2 every shard of q, k, v, gate, up and the experts is whole 128-row blocks, as vLLM's
# block-fp8 layers require.
COMMON = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False)


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def _qwen3_moe() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True))


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest() for n, t in tensors.items()
    }


def _checkpoint(directory: Path, model: torch.nn.Module, view: BlockFp8View) -> dict[str, torch.Tensor]:
    """The view's reference as an fp8 checkpoint directory vLLM loads (the routers left unquantized)."""
    tensors = quantize_all(dict(published_tensors(model)), view.quantized, view.rule)
    directory.mkdir(parents=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, directory / "model.safetensors")
    config = model.config.to_dict()
    routers = sorted(n.removesuffix(".weight") for n in tensors if n.endswith(".mlp.gate.weight"))
    config["quantization_config"] = dict(FP8_CONFIG, **({"ignored_layers": routers} if routers else {}))
    config["torch_dtype"] = "bfloat16"
    config["architectures"] = [type(model).__name__]
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


def _train(tmp_path: Path, make: Any, steps: int, **options: Any) -> dict[str, Any]:
    """Train and publish ``steps`` versions of ``make()``'s block-fp8 view; the engine's checkpoint is version 0's.

    Returns the request for ``tests/vllm_fp8_inprocess.py`` (the reference's digests and checkpoint per version)."""
    model = make()
    view = BlockFp8View(model)
    _checkpoint(tmp_path / "v0", model, view)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    expected, checkpoints = {}, {}
    with Publisher(view, str(tmp_path / "store"), anchor_ratio=100.0, max_span=0, **options) as publisher:
        publisher.publish(0)
        publisher.flush()
        for step in range(1, steps + 1):
            ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(step))
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            publisher.publish(step)
            publisher.flush()
            version = str(publisher.version)
            expected[version] = _digests(_checkpoint(tmp_path / f"v{version}", model, view))
            checkpoints[version] = str(tmp_path / f"v{version}")
    return {"model": str(tmp_path / "v0"), "store": str(tmp_path / "store"), "expected": expected,
            "checkpoints": checkpoints, "fresh": checkpoints[max(checkpoints, key=int)]}


def _in_process(tmp_path: Path, request: dict[str, Any], *, ranks: int = 1) -> list[dict[str, Any]]:
    """``tests/vllm_fp8_inprocess.py`` on ``request``, one process per tensor-parallel rank, each one's answer."""
    script = ROOT / "tests" / "vllm_fp8_inprocess.py"
    running = []
    for rank in range(ranks):
        path = tmp_path / f"request-{rank}.json"
        path.write_text(json.dumps({**request, "tp": ranks, "rank": rank, "init": str(tmp_path / "rendezvous")}))
        # A group name of its own per rank: vLLM's CPU communicator then uses torch.distributed (gloo), not
        # shared-memory segments; nothing here needs a collective beyond the rendezvous.
        env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="WARNING", VLLM_DIST_IDENT=f"{path.name}")
        running.append(subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=env))
    answers = []
    for process in running:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
        answers.append(json.loads(out.strip().splitlines()[-1]))
    return answers


def _run(tmp_path: Path, make: Any, kernel: str, steps: int = 3) -> dict[str, Any]:
    request = _train(tmp_path, make, steps, anchor_every=1000)
    return _in_process(tmp_path, {**request, "kernel": kernel})[0]


@pytest.mark.parametrize("make", [_llama, _qwen3_moe], ids=["llama", "qwen3-moe"])
def test_vllm_block_fp8_is_exact_after_every_version(tmp_path: Path, make: Any) -> None:
    result = _run(tmp_path, make, "reference")
    assert result.get("refused") is None, result.get("refused")
    assert not result["proof"]["failed"], result["proof"]["failed"]
    assert result["reached"] == {"1": True, "2": True, "3": True}
    assert result["runtime_differs"] == [] and result["runtime_compared"] > 0
    runtime = result["runtime"]
    qkv = next(n for n in runtime if n.endswith("qkv_proj.weight"))
    assert runtime[qkv][1] == "torch.float8_e4m3fn" and qkv + "_scale_inv" in runtime


def test_the_deltasync_backend_follows_an_fp8_run_exactly(tmp_path: Path) -> None:
    """The weight-transfer backend (what ``/update_weights`` and TRL's ``DeltaSyncTransfer`` drive), built as vLLM
    builds it in a worker over vLLM's own fp8 model: the engine's rule checked, the map proven, every version
    fetched, checked and written; exact after each, and the runtime bytes equal a fresh load's at the end."""
    from deltasync.appliers.checkpoint.files import checkpoint_specs

    request = _train(tmp_path, _qwen3_moe, 3, anchor_every=1000)
    answer = _in_process(tmp_path, {**request, "kernel": "reference", "path": "backend"})[0]
    assert sorted(answer["compared"], key=int) == ["1", "2", "3"]
    specs = {s.name: s for s in checkpoint_specs(request["model"])}
    for version, counts in answer["compared"].items():
        assert counts.keys() == specs.keys(), version
        assert all(c["wrong"] == 0 and c["read"] == specs[n].numel for n, c in counts.items()), version
    assert answer["runtime_differs"] == [] and answer["runtime_compared"] > 0


def test_vllms_own_cpu_kernel_is_refused_or_absent(tmp_path: Path) -> None:
    """vLLM's CPU block-fp8 kernel exists only for AMX machines, and repacks the weights for AMX tiles: there the
    proof finds the packed bytes differ from the checkpoint and names each packed parameter, before any write;
    elsewhere vLLM refuses to build the layer at all."""
    result = _run(tmp_path, _llama, "native", steps=1)
    if "unbuildable" in result:
        assert "kernel" in result["unbuildable"]
        return
    failed = result["proof"]["failed"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in failed and "model.layers.1.mlp.down_proj.weight" in failed
    assert not any(name.endswith("_scale_inv") for name in failed)  # the scales are kept as loaded
    assert "reached" not in result  # nothing applied


@pytest.mark.parametrize("make", [_llama, _qwen3_moe], ids=["llama", "qwen3-moe"])
def test_tensor_parallel_ranks_hold_their_shards_of_weights_and_scales_exactly(tmp_path: Path, make: Any) -> None:
    """TP=2: each rank maps and proves its shard of every fused weight and of its block scales (blocks split
    between the ranks), writes each version's anchor where it holds it, and together the ranks hold every element
    of every version's reference exactly; each rank's runtime bytes equal a fresh TP=2 load's."""
    from deltasync.appliers.checkpoint.files import checkpoint_specs
    from deltasync.appliers.verify import merge_compared

    request = _train(tmp_path, make, 2, anchor_every=1)
    answers = _in_process(tmp_path, {**request, "kernel": "reference"}, ranks=2)
    for answer in answers:
        assert answer.get("refused") is None and not answer["proof"]["failed"], answer.get("refused")
        assert answer["runtime_differs"] == [], answer["runtime_differs"]
        assert "apply" not in answer["compared"], answer["compared"]
    specs = {s.name: s for s in checkpoint_specs(request["model"])}
    for version in request["checkpoints"]:
        merged = merge_compared(specs, [(a["compared"][version]["tensors"], a["compared"][version]["held"])
                                        for a in answers])
        assert merged.keys() == specs.keys()
        assert all(c["wrong"] == 0 and c["missing"] == 0 for c in merged.values()), version
    shards = answers[0]["runtime"]
    qkv = next(n for n in shards if n.endswith("qkv_proj.weight_scale_inv"))
    rows = sum(specs[qkv.replace("qkv_proj", part)].shape[0] for part in ("q_proj", "k_proj", "v_proj"))
    assert shards[qkv][0][0] == rows // 2  # each rank holds half of every block row of the fused scales


class TestEngineRule:
    """The engine's quantization config against what the run publishes (vLLM's own config classes)."""

    def _config(self, **fields: Any) -> Any:
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config

        return Fp8Config.from_config({**FP8_CONFIG, **fields})

    def _specs(self, block: int = 128) -> list[TensorSpec]:
        return [TensorSpec("w.weight", (256, 384), "F8_E4M3"),
                TensorSpec("w.weight_scale_inv", (256 // block, 384 // block), "F32"),
                TensorSpec("norm.weight", (384,), "BF16")]

    def test_a_block_fp8_engine_of_the_runs_block_is_accepted(self) -> None:
        rule, block = engine_rule(self._config())
        assert block == (128, 128) and "block fp8 128x128" in rule
        check_quantization(self._config(), self._specs())

    def test_another_block_size_is_refused_naming_it(self) -> None:
        with pytest.raises(LayoutMismatch, match="block fp8 64x64") as info:
            check_quantization(self._config(weight_block_size=[64, 64]), self._specs())
        assert info.value.name == "w.weight"

    def test_an_unquantized_engine_is_refused_for_an_fp8_run(self) -> None:
        with pytest.raises(LayoutMismatch, match="none: weights as loaded"):
            check_quantization(None, self._specs())

    @pytest.mark.parametrize(("scheme", "named"), [("fp8_per_tensor", "fp8 per tensor"),
                                                   ("fp8_per_block", "fp8 per 128x128 block")])
    def test_online_quantization_is_refused_naming_its_scheme(self, scheme: str, named: str) -> None:
        """``--quantization fp8_per_tensor`` / ``fp8_per_block`` on a bf16 checkpoint: the engine makes its own fp8
        weights (same names as a block checkpoint's, for per-block), which no run's delta describes."""
        from vllm.config.quantization import resolve_quantization_config
        from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig

        online = OnlineQuantizationConfig(args=resolve_quantization_config(scheme, None))
        for specs in ([TensorSpec("w.weight", (256, 384), "BF16")], self._specs()):
            with pytest.raises(LayoutMismatch, match=f"{named} quantized online"):
                check_quantization(online, specs)

    def test_an_engine_quantizing_a_bf16_run_is_refused_naming_its_rule(self) -> None:
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config

        online = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=None)
        with pytest.raises(LayoutMismatch, match="per-tensor fp8"):
            check_quantization(online, [TensorSpec("w.weight", (8, 8), "BF16")])
        with pytest.raises(LayoutMismatch, match="per-tensor fp8"):
            check_quantization(online, self._specs())
        check_quantization(None, [TensorSpec("w.weight", (8, 8), "BF16")])


pytestmark = VLLM_TESTS


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("make", [_llama, _qwen3_moe], ids=["llama", "qwen3-moe"])
def test_a_cuda_engine_serving_block_fp8_follows_the_run_exactly(
    tmp_path: Path, make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real engine on a GPU loads the fp8 checkpoint and the follower patches it after every version; DeepGEMM's
    UE8M0 requantization is off (it rewrites the loaded weights, which the proof would refuse)."""
    from deltasync.appliers.vllm.follower import VLLMFollower
    from tests.vllm_helpers import engine, latest

    monkeypatch.setenv("VLLM_USE_DEEP_GEMM", "0")
    model = make()
    view = BlockFp8View(model)
    _checkpoint(tmp_path / "v0", model, view)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    store = str(tmp_path / "store")
    with engine(tmp_path / "v0", skip_tokenizer_init=True) as llm, Publisher(view, store) as publisher:
        publisher.publish(0, block=True)
        publisher.flush()
        run_id, version = latest(store)
        follower = VLLMFollower(llm, model=tmp_path / "v0")
        with follower.subscriber(store, ack=False, start_version=version, run_id=run_id) as subscriber:
            for step in range(1, 4):
                ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(step))
                model(ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                publisher.publish(step, block=True)
                publisher.flush()
                subscriber.update()
                _checkpoint(tmp_path / f"v{step}", model, view)
                compared = follower.compare(tmp_path / f"v{step}")
                assert all(c["wrong"] == 0 and c["missing"] == 0 for c in compared.values()), compared
