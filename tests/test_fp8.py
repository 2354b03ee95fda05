"""Block-fp8 replicas of a bf16 trainer: the reference rule, the published view, exact replicas.

The rule is checked against a block-by-block reading of FORMAT.md's text (numpy float32 division, then
torch's e4m3 cast); the published view against that rule after every version of real training (a
transformers Llama and a Qwen3-MoE, AdamW), on a torch replica (host and device decode paths, every
codec, every store backend) and on a checkpoint directory, bit for bit.
"""

from __future__ import annotations

import math
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deltasync import Publisher, Subscriber, TorchModuleApplier
from deltasync.appliers.checkpoint.applier import CheckpointDirApplier
from deltasync.codec import codec_names
from deltasync.errors import CodecError, ConfigError, FingerprintMismatch, QuantizationError
from deltasync.format import read_header
from deltasync.publish.fp8 import BlockFp8View, fp8_by_default
from deltasync.stores import Store
from deltasync.tensors import bits_view
from deltasync.tensors.fp8 import FP8_DTYPE, BlockFp8, quantize, quantize_all, scale_name

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------------ helpers


def by_the_text(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """FORMAT.md's rule read literally, one block at a time: amax in float32, scale = amax / 448 (1.0 for a
    zero block), q = e4m3(clamp(w / scale, +-448)), edge blocks holding only the elements that exist."""
    w = w.to(torch.bfloat16).float()
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scales = np.empty(grid, dtype=np.float32)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    for i in range(grid[0]):
        for j in range(grid[1]):
            rs, cs = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            values = w[rs, cs].numpy()
            amax = np.float32(np.abs(values).max())
            scale = np.float32(amax / np.float32(448.0)) if amax > 0 else np.float32(1.0)
            scales[i, j] = scale
            q[rs, cs] = torch.from_numpy(np.clip(values / scale, -448, 448).astype(np.float32)).to(FP8_DTYPE)
    return q, torch.from_numpy(scales)


def bits(t: torch.Tensor) -> torch.Tensor:
    return bits_view(t.detach().contiguous()).reshape(-1)


def assert_same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(bits(got[name]), bits(want[name])), name


def llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def qwen3_moe(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=160, intermediate_size=256, moe_intermediate_size=136, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    return transformers.Qwen3MoeForCausalLM(config)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, 24), generator=g)
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def reference(model: torch.nn.Module, view: BlockFp8View) -> dict[str, torch.Tensor]:
    """What a fresh engine loads: the trainer's weights written as a block-fp8 checkpoint by the rule."""
    from deltasync.tensors import published_tensors

    return quantize_all(dict(published_tensors(model)), view.quantized, view.rule)


def store_url() -> str:
    return f"memory://fp8-{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------------------------ the rule


class TestRule:
    @pytest.mark.parametrize("shape", [(128, 128), (200, 300), (576, 576), (1, 129), (7, 5), (256, 64)])
    def test_the_quantizer_is_the_rule_as_written(self, shape: tuple[int, int]) -> None:
        g = torch.Generator().manual_seed(sum(shape))
        w = torch.randn(shape, generator=g) * 0.03
        q, scales = quantize("w", w)
        want_q, want_scales = by_the_text(w)
        assert scales.shape == BlockFp8().grid(shape) == want_scales.shape
        assert torch.equal(bits(q), bits(want_q)) and torch.equal(bits(scales), bits(want_scales))

    def test_edge_blocks_hold_only_what_exists(self) -> None:
        """A 200x300 tensor has a 2x3 grid; its edge blocks' scales come from their own elements alone."""
        w = torch.full((200, 300), 0.01)
        w[199, 299] = 4.48  # the last edge block's largest
        w[0, 0] = 0.448
        _, scales = quantize("w", w)
        assert scales.shape == (2, 3)
        assert scales[1, 2].item() == pytest.approx(4.48 / 448, rel=1e-2)
        assert scales[0, 0].item() == pytest.approx(0.448 / 448, rel=1e-2)
        amax = np.float32(torch.tensor(0.01).to(torch.bfloat16).item())  # of the bf16 cast
        assert scales[0, 1].item() == scales[1, 0].item() == amax / np.float32(448.0)

    def test_a_block_whose_amax_changes_moves_its_scale_and_every_element(self) -> None:
        g = torch.Generator().manual_seed(3)
        w = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
        q0, s0 = quantize("w", w)
        w[5, 200] = w[:128, 128:].abs().max() * 2
        q1, s1 = quantize("w", w)
        changed_scales = (bits(s0) != bits(s1)).view(2, 2)
        assert changed_scales.tolist() == [[False, True], [False, False]]
        moved = (bits(q0) != bits(q1)).view(256, 256)
        assert not moved[128:].any() and not moved[:, :128].any()  # other blocks untouched
        assert moved[:128, 128:].float().mean() > 0.9  # nearly every element of the block (zeros stay)

    def test_an_all_zero_block_has_scale_one_and_zero_elements(self) -> None:
        w = torch.zeros(130, 64)
        w[129, 0] = -0.0
        q, scales = quantize("w", w)
        assert scales.tolist() == [[1.0], [1.0]]
        assert int(bits(q)[129 * 64]) == -128  # -0.0 stays -0.0 (0x80)
        assert not bits(q)[: 129 * 64].any()

    def test_the_largest_element_maps_to_448_and_nothing_saturates_past_it(self) -> None:
        w = torch.tensor([[3.0, -3.0, 1e-30, 0.0]]).repeat(4, 1)
        q, scales = quantize("w", w)
        assert q.float()[0].tolist()[:2] == [448.0, -448.0]
        assert scales.item() == np.float32(np.float32(3.0) / np.float32(448.0))

    @pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
    def test_an_inf_or_nan_is_refused_naming_the_tensor(self, bad: float) -> None:
        w = torch.zeros(300, 20)
        w[250, 3] = bad
        with pytest.raises(QuantizationError, match="layers.0.q_proj.weight") as info:
            quantize("layers.0.q_proj.weight", w)
        assert info.value.name == "layers.0.q_proj.weight"

    def test_leading_dimensions_are_quantized_one_matrix_at_a_time(self) -> None:
        g = torch.Generator().manual_seed(4)
        w = torch.randn(3, 130, 70, generator=g)
        q, scales = quantize("experts", w)
        assert scales.shape == (3, 2, 1)
        for e in range(3):
            want_q, want_s = by_the_text(w[e])
            assert torch.equal(bits(q[e]), bits(want_q)) and torch.equal(bits(scales[e]), bits(want_s))

    def test_bad_rules_are_refused(self) -> None:
        with pytest.raises(ConfigError):
            BlockFp8((0, 128))
        with pytest.raises(ConfigError):
            quantize("norm", torch.ones(8))

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    @pytest.mark.cuda
    def test_a_gpu_quantizes_to_the_same_bits(self) -> None:
        g = torch.Generator().manual_seed(5)
        w = torch.randn(1000, 700, generator=g) * 0.02
        q, s = quantize("w", w)
        q_gpu, s_gpu = quantize("w", w.cuda())
        assert torch.equal(bits(q), bits(q_gpu.cpu())) and torch.equal(bits(s), bits(s_gpu.cpu()))


# ------------------------------------------------------------------------------------------------ the view


class TestView:
    def test_the_convention_keeps_embeddings_norms_head_and_routers_in_bf16(self) -> None:
        view = BlockFp8View(qwen3_moe())
        assert "model.layers.0.self_attn.q_proj.weight" in view.quantized
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in view.quantized
        for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
                     "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"):
            assert kept not in view.quantized and kept in view
        assert not fp8_by_default("model.layers.0.shared_expert_gate.weight", torch.zeros(1, 8))

    def test_names_and_specs_follow_the_checkpoint(self) -> None:
        model = llama()
        view = BlockFp8View(model)
        specs = {s.name: s for s in view.specs()}
        q = "model.layers.0.self_attn.q_proj.weight"
        assert specs[q].dtype == "F8_E4M3" and specs[q].shape == (192, 192)
        assert specs[scale_name(q)].dtype == "F32" and specs[scale_name(q)].shape == (2, 2)
        assert specs["model.norm.weight"].dtype == "BF16"
        assert [s.name for s in view.specs()] == list(view)
        assert {n: (tuple(t.shape), t.dtype) for n, t in view.items()} == {
            s.name: (s.shape, s.torch_dtype) for s in view.specs()}
        assert torch.equal(bits(view[scale_name(q)]), bits(dict(view.items())[scale_name(q)]))

    def test_named_tensors_must_exist_and_be_matrices(self) -> None:
        model = llama()
        with pytest.raises(ConfigError, match="no tensors"):
            BlockFp8View(model, names=["model.layers.9.mlp.up_proj.weight"])
        with pytest.raises(ConfigError, match="two"):
            BlockFp8View(model, names=["model.norm.weight"])

    def test_a_plain_fp8_cast_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="block-fp8 view"):
            Publisher(llama(), store_url(), dtype=torch.float8_e4m3fn)

    def test_the_snapshot_costs_one_byte_an_element_of_the_fp8_tensors(self) -> None:
        model = llama()
        view = BlockFp8View(model)
        with Publisher(view, store_url()) as publisher:
            publisher.publish(0)
            publisher.flush()
            sizes = {name: t.numel() * t.element_size() for name, t in publisher.snapshot.items()}
        for name in view.quantized:
            tensor = dict(model.named_parameters())[name]
            assert sizes[name] == tensor.numel()  # e4m3: one byte an element
            assert sizes[scale_name(name)] == 4 * math.prod(BlockFp8().grid(tensor.shape))
        assert sizes["model.norm.weight"] == 2 * 192


# ------------------------------------------------------------------------------------------------ replicas


def follow(model_fn, steps: int, *, codec: str = "compact", stage: bool = False, url: str | None = None,
           lr: float = 1e-3) -> tuple[Publisher, Subscriber, dict[str, torch.Tensor]]:
    """Train ``steps`` versions, checking after each that the replica equals the fresh-load reference."""
    model = model_fn()
    view = BlockFp8View(model)
    held = {n: torch.zeros_like(t) for n, t in reference(model, view).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    publisher = Publisher(view, url or store_url(), codec=codec, anchor_every=1000, anchor_ratio=100.0)
    subscriber = Subscriber(publisher.store, TorchModuleApplier(held, stage=stage), ack=False)
    publisher.publish(0)
    publisher.flush()
    subscriber.update()
    assert_same_bits(held, reference(model, view))
    for step in range(1, steps + 1):
        train(model, opt, step)
        publisher.publish(step)
        publisher.flush()
        subscriber.update()
        assert subscriber.version == publisher.version
        assert_same_bits(held, reference(model, view))
    return publisher, subscriber, held


class TestReplicas:
    def test_a_trained_llama_is_exact_after_every_version(self) -> None:
        publisher, subscriber, _ = follow(llama, 4, lr=3e-5)
        publisher.close()
        subscriber.close()

    def test_a_trained_moe_is_exact_after_every_version(self) -> None:
        """Experts are where the bytes are: every expert's projections are fp8, the router stays bf16."""
        publisher, subscriber, held = follow(qwen3_moe, 3, lr=3e-5)
        assert held["model.layers.0.mlp.experts.2.gate_proj.weight"].dtype == FP8_DTYPE
        assert held["model.layers.0.mlp.gate.weight"].dtype == torch.bfloat16
        publisher.close()
        subscriber.close()

    @pytest.mark.parametrize("codec", [c for c in codec_names() if c != "dense"])
    def test_every_codec_carries_the_view(self, codec: str) -> None:
        publisher, subscriber, _ = follow(llama, 2, codec=codec)
        publisher.close()
        subscriber.close()

    def test_patches_rebuilt_on_the_device_path_are_exact(self) -> None:
        publisher, subscriber, _ = follow(llama, 2, stage=True)
        publisher.close()
        subscriber.close()

    def test_every_store_backend(self, store: Store) -> None:
        model = llama()
        view = BlockFp8View(model)
        held = {n: torch.zeros_like(t) for n, t in reference(model, view).items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with Publisher(view, store) as publisher:
            for step in range(3):
                if step:
                    train(model, opt, step)
                publisher.publish(step)
                publisher.flush()
            with Subscriber(store, TorchModuleApplier(held), ack=False) as subscriber:
                subscriber.update()
        assert_same_bits(held, reference(model, view))

    def test_dense_where_dense_is_cheaper(self) -> None:
        """A tensor whose fp8 bytes all move at random is sent whole, as for bf16: the encoder keeps the smaller
        of the changes and the whole tensor (a small step that moves most bytes by one code stays sparse, which
        is then smaller; scaling a block moves only its scale)."""
        model = llama()
        view = BlockFp8View(model)
        with Publisher(view, store_url(), anchor_every=1000, anchor_ratio=100.0) as publisher:
            publisher.publish(0)
            publisher.flush()
            with torch.no_grad():
                up = model.model.layers[0].mlp.up_proj.weight
                g = torch.Generator().manual_seed(6)  # log-uniform magnitudes: e4m3 codes that do not compress
                signs = torch.randint(0, 2, up.shape, generator=g) * 2 - 1
                up.copy_(signs * torch.exp2(-12 * torch.rand(up.shape, generator=g)))
                model.model.layers[1].mlp.up_proj.weight[0, 0] += 0.5
            publisher.publish(1)
            publisher.flush()
            ref = publisher.writer_engine.manifest.versions[-1].delta[0]
            header = read_header(publisher.store.get(ref.key))
        tables = header.tensors
        assert tables["model.layers.0.mlp.up_proj.weight"].codec == "dense"
        assert tables["model.layers.1.mlp.up_proj.weight"].codec == "compact"

    def test_a_checkpoint_directory_replica_ends_as_the_fresh_checkpoint(self, tmp_path: Path) -> None:
        """The file a fresh engine would load, patched in place version after version."""
        model = llama()
        view = BlockFp8View(model)
        save_file({n: t.contiguous() for n, t in reference(model, view).items()}, tmp_path / "model.safetensors")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        url = store_url()
        with Publisher(view, url) as publisher:
            publisher.publish(0)
            publisher.flush()
            applier = CheckpointDirApplier(tmp_path)  # the view's tensors keep their dtypes, the rest is bf16
            with Subscriber(url, applier, ack=False) as subscriber:
                for step in range(1, 4):
                    train(model, opt, step)
                    publisher.publish(step)
                    publisher.flush()
                    subscriber.update()
            applier.close()
        assert_same_bits(load_file(tmp_path / "model.safetensors"), reference(model, view))

    def test_a_bf16_replica_is_refused_before_anything_is_written(self) -> None:
        model = llama()
        url = store_url()
        with Publisher(BlockFp8View(model), url) as publisher:
            publisher.publish(0)
            publisher.flush()
        held = {n: t.detach().to(torch.bfloat16).clone() for n, t in model.named_parameters()}
        before = {n: t.clone() for n, t in held.items()}
        with Subscriber(url, TorchModuleApplier(held), ack=False) as subscriber:
            with pytest.raises(FingerprintMismatch):
                subscriber.update()
        assert_same_bits(held, before)


class TestBadInput:
    def test_a_nan_in_the_weights_is_refused_at_publish_and_nothing_is_lost(self) -> None:
        model = llama()
        view = BlockFp8View(model)
        url = store_url()
        with Publisher(view, url) as publisher:
            publisher.publish(0)
            publisher.flush()
            weight = model.model.layers[1].self_attn.o_proj.weight
            with torch.no_grad():
                kept = weight[3, 4].item()
                weight[3, 4] = float("nan")
            with pytest.raises(QuantizationError, match="model.layers.1.self_attn.o_proj.weight"):
                publisher.publish(1)
            assert publisher.version == 0
            with torch.no_grad():
                weight[3, 4] = kept + 0.25  # the trainer goes on
            assert publisher.publish(2)
            publisher.flush()
            assert publisher.version == 1
        held = {n: torch.zeros_like(t) for n, t in reference(model, view).items()}
        with Subscriber(url, TorchModuleApplier(held), ack=False) as subscriber:
            subscriber.update()
        assert_same_bits(held, reference(model, view))

    def test_a_nan_in_the_first_version_is_refused_too(self) -> None:
        model = llama()
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
        with Publisher(BlockFp8View(model), store_url()) as publisher:
            with pytest.raises(QuantizationError, match="down_proj"):
                publisher.publish(0)

    def test_a_replica_refuses_an_e4m3_nan_and_keeps_its_weights(self) -> None:
        """A writer that is not the rule (here: a plain Publisher given fp8 bytes) cannot poison a replica."""
        q, scales = quantize("w", torch.randn(64, 64))
        weights = {"w": q.clone(), "w_scale_inv": scales.clone()}
        url = store_url()
        with Publisher(weights, url, dtype=None) as publisher:
            publisher.publish(0)
            publisher.flush()
            held = {n: t.clone() for n, t in weights.items()}
            with Subscriber(url, TorchModuleApplier(held), ack=False) as subscriber:
                subscriber.update()
                bits(weights["w"])[7] = 0x7F
                publisher.publish(1)
                publisher.flush()
                with pytest.raises(CodecError, match="e4m3 NaN"):
                    subscriber.update()
                assert subscriber.version == 0
        assert_same_bits(held, {"w": q, "w_scale_inv": scales})


class TestIntegrations:
    def test_a_trainer_with_the_callback_publishes_the_fp8_view(self, tmp_path: Path) -> None:
        """DeltaSyncCallback(fp8=True) in a real transformers Trainer: the store ends at the reference view of
        the trained weights, and the logged dense size is the view's (a byte an fp8 element)."""
        from datasets import Dataset

        from deltasync.integrations import DeltaSyncCallback

        model = llama()
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (8, 16), generator=g)
        data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-4,
            logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        url = str(tmp_path / "run")
        callback = DeltaSyncCallback(url, fp8=True).attach(trainer)
        trainer.train()
        view = BlockFp8View(model)
        held = {n: torch.zeros_like(t) for n, t in reference(model, view).items()}
        with Subscriber(url, TorchModuleApplier(held), ack=False) as subscriber:
            subscriber.update()
        assert_same_bits(held, reference(model, view))
        # What the trainer's logs show as the dense size (deltasync/dense_bytes) is the view's, a byte an fp8 element.
        from deltasync.integrations.trl.metrics import publish_metrics

        deltas = [info for info in callback.history if info.kind == "delta"]
        view_bytes = sum(t.numel() * t.element_size() for t in held.values())
        assert deltas and publish_metrics(deltas, callback.version)["deltasync/dense_bytes"] == view_bytes

    def test_a_stream_of_tensors_publishes_the_same_view(self) -> None:
        """What AsyncGRPOTrainer's weight transfer hands over, one tensor at a time, gives the same versions."""
        from deltasync.publish.fp8 import fp8_stream
        from deltasync.tensors import published_tensors

        model = llama()
        view = BlockFp8View(model)
        url = store_url()
        with Publisher(None, url, dtype=None) as publisher:
            publisher.publish(0, tensors=fp8_stream(published_tensors(model)))
            with torch.no_grad():
                model.model.layers[0].mlp.down_proj.weight.mul_(1.01)
            publisher.publish(1, tensors=fp8_stream(published_tensors(model)))
            publisher.flush()
            held = {n: torch.zeros_like(t) for n, t in reference(model, view).items()}
            with Subscriber(url, TorchModuleApplier(held), ack=False) as subscriber:
                subscriber.update()
                assert subscriber.version == 1
        assert_same_bits(held, reference(model, view))

    def test_the_options_are_checked(self) -> None:
        from deltasync.integrations import DeltaSyncCallback
        from deltasync.integrations.trl import DeltaSyncTransfer

        with pytest.raises(ConfigError, match="fp8"):
            DeltaSyncCallback(store_url(), fp8="yes")
        with pytest.raises(ConfigError, match="dtype"):
            DeltaSyncTransfer(store_url(), fp8=True, dtype=torch.bfloat16)
        assert DeltaSyncTransfer(store_url(), fp8=BlockFp8((64, 64))).fp8 == BlockFp8((64, 64))


def test_deltasync_watch_keeps_an_fp8_checkpoint_directory(tmp_path: Path) -> None:
    """The command a user runs, into an empty directory, from the conformance suite's fp8 run: the directory ends as
    the reference's last version, e4m3 tensors and their scales in their own dtypes."""
    import hashlib
    import json
    import subprocess
    import sys

    case_dir = Path(__file__).resolve().parent.parent / "conformance" / "golden" / "fp8-block-compact"
    case = json.loads((case_dir / "case.json").read_text())
    target = tmp_path / "ckpt"
    target.mkdir()
    done = subprocess.run([sys.executable, "-m", "deltasync.cli", "watch", str(case_dir / "store"), "--model",
                           str(target), "--once", "--no-ack"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    held = {}
    for path in target.glob("*.safetensors"):
        held.update(load_file(path))
    digests = {n: hashlib.sha256(bits(t).numpy().tobytes()).hexdigest() for n, t in held.items()}
    assert digests == case["versions"][max(case["versions"], key=int)]
    assert held["proj.weight"].dtype == FP8_DTYPE and held["proj.weight_scale_inv"].dtype == torch.float32
