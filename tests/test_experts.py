"""Mixture-of-Experts without an engine: checkpoint names, expert boxes, the packed layout, the map proof.

Fast tests on real components: a transformers Qwen3-MoE (fused experts in
memory), the mapping and proof layers on CPU tensors, and vLLM's real CPU
prepack op where vllm is installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import safetensors.torch
import torch

from deltasync import Publisher, Subscriber
from deltasync.appliers import TorchModuleApplier
from deltasync.appliers.apply import Patch
from deltasync.appliers.mapping import PLAIN, IndexMap, Layout, Target, fit_targets
from deltasync.appliers.verify import check_written, compare_held, merge_compared, pack_held, prove_map
from deltasync.errors import TensorMismatch
from deltasync.tensors import TensorSpec, bits_view, fingerprint, published_tensors

transformers = pytest.importorskip("transformers")


def _tiny_moe(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=64, tie_word_embeddings=False,
    )
    return transformers.Qwen3MoeForCausalLM(config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    model = _tiny_moe()
    target = tmp_path_factory.mktemp("moe") / "ckpt"
    model.save_pretrained(target, safe_serialization=True)
    return model, target


class TestCheckpointNames:
    def test_fused_experts_publish_as_zero_copy_checkpoint_tensors(self, saved) -> None:
        model, target = saved
        views = dict(published_tensors(model))
        on_disk = safetensors.torch.load_file(str(target / "model.safetensors"))
        assert set(views) == set(on_disk)
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in views
        assert all(torch.equal(views[n], on_disk[n]) for n in on_disk)
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert all(v.untyped_storage().data_ptr() in storages for v in views.values())  # no copies
        # Views follow the live weights.
        with torch.no_grad():
            model.model.layers[1].mlp.experts.gate_up_proj[3, 24 + 5, 7] += 1.0
        again = dict(published_tensors(model))
        assert again["model.layers.1.mlp.experts.3.up_proj.weight"][5, 7] == views[
            "model.layers.1.mlp.experts.3.up_proj.weight"
        ][5, 7]
        with torch.no_grad():
            model.model.layers[1].mlp.experts.gate_up_proj[3, 24 + 5, 7] -= 1.0

    def test_dense_model_keeps_its_names(self) -> None:
        torch.manual_seed(0)
        config = transformers.Qwen3Config(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
        )
        model = transformers.Qwen3ForCausalLM(config)
        assert [n for n, _ in published_tensors(model)] == [n for n, _ in model.named_parameters()]

    def test_trainer_run_reaches_a_fused_replica_exactly(self, saved, tmp_path: Path) -> None:
        """Trainer and replica both hold fused experts; the wire carries per-expert names."""
        model, target = saved
        trainer = _tiny_moe()
        replica = _tiny_moe(seed=1).to(torch.bfloat16)
        on_disk = safetensors.torch.load_file(str(target / "model.safetensors"))
        ckpt_specs = [TensorSpec.of(n, t, torch.bfloat16) for n, t in on_disk.items()]
        applier = TorchModuleApplier(replica)
        assert applier.fingerprint == fingerprint(ckpt_specs)
        opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        store = str(tmp_path / "run")
        with Publisher(trainer, store) as pub, Subscriber(store, applier, ack=False) as sub:
            for step in range(3):
                trainer(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                pub.publish(step, block=True)
                pub.flush()
                sub.update()
                for (n, a), (_, b) in zip(trainer.named_parameters(), replica.named_parameters()):
                    assert torch.equal(bits_view(a.detach().to(torch.bfloat16)), bits_view(b.detach())), n


class TestExpertBoxes:
    def test_per_expert_tensors_map_to_boxes_in_stacked_parameters(self) -> None:
        """gate/up rows of expert 2 in w13 [E, 2*I_pad, H]; down [H, I] in w2 [E, H, I_pad]: boxes, no tables."""
        experts, inter, pad, hidden = 4, 24, 32, 16
        w13 = torch.nn.Parameter(torch.zeros(experts, 2 * pad, hidden), requires_grad=False)
        w2 = torch.nn.Parameter(torch.zeros(experts, hidden, pad), requires_grad=False)
        up = TensorSpec("up", (inter, hidden), "BF16")
        down = TensorSpec("down", (hidden, inter), "BF16")
        c = torch.arange(inter * hidden)
        r13 = 2 * (2 * pad * hidden) + pad * hidden + c  # expert 2, rows pad..pad+inter
        (t13,) = fit_targets(w13, "w13", up, c, r13)
        assert t13.table is None and t13.describe() == ["box", [0, 0], [inter, hidden]]
        rows, cols = c // inter, c % inter
        r2 = 2 * (hidden * pad) + rows * pad + cols
        (t2,) = fit_targets(w2, "w2", down, c, r2)
        assert t2.table is None and t2.base == 2 * hidden * pad
        probe = torch.tensor([0, 5, inter * hidden - 1])
        assert t13.translate(probe)[1].tolist() == r13[probe].tolist()
        assert t2.translate(probe)[1].tolist() == r2[probe].tolist()


def _reversed_layout() -> Layout:
    """A layout that reads and writes each parameter's elements in reverse order (a stand-in for a packing)."""
    def flip(data: torch.Tensor, runtime: torch.Tensor) -> torch.Tensor:
        return data.numel() - 1 - runtime

    return Layout(
        "reversed",
        claims=lambda name, param: True,
        read=lambda data, runtime, published: PLAIN.read(data, flip(data, runtime), published),
        write=lambda data, runtime, bits, published: PLAIN.write(data, flip(data, runtime), bits, published),
    )


class TestProof:
    def _map(self, weights: torch.Tensor, layout: Layout) -> IndexMap:
        spec = TensorSpec("w", tuple(weights.shape), "BF16")
        index = IndexMap([spec])
        param = torch.nn.Parameter(weights.clone(), requires_grad=False)
        index.targets["w"].append(Target(param, "runtime.w", spec.shape, layout, lo=(0, 0), hi=spec.shape,
                                         flat=(0, spec.numel, 0)))
        return index

    def test_a_map_that_reads_back_the_loaded_weights_proves(self) -> None:
        weights = torch.randn(8, 16).to(torch.bfloat16)
        proof = prove_map(self._map(weights, PLAIN), lambda name: weights)
        assert proof.failed == {} and proof.tensors == 1 and proof.elements == weights.numel()

    def test_a_layout_the_engine_does_not_use_is_refused_by_parameter(self) -> None:
        weights = torch.randn(8, 16).to(torch.bfloat16)  # the engine holds them plain
        proof = prove_map(self._map(weights, _reversed_layout()), lambda name: weights)
        assert list(proof.failed) == ["runtime.w"] and "'reversed'" in proof.failed["runtime.w"]

    def test_constant_tensors_are_listed_and_missing_ones_fail(self) -> None:
        ones = torch.ones(4, 4, dtype=torch.bfloat16)
        assert prove_map(self._map(ones, _reversed_layout()), lambda name: ones).constant == ["w"]
        assert "not in the engine's checkpoint" in prove_map(self._map(ones, PLAIN), lambda name: None).failed["runtime.w"]

    def test_check_written_reads_patches_back(self) -> None:
        weights = torch.randn(8, 16).to(torch.bfloat16)
        index = self._map(weights, PLAIN)
        spec = index.specs["w"]
        idx = torch.tensor([1, 7, 100])
        values = bits_view(torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
        patch = Patch("w", spec, idx, values)
        index.targets["w"][0].param.data.view(-1)[idx] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
        assert check_written(index, [patch]) == (3, [])
        index.targets["w"][0].param.data.view(-1)[7] = 0.0  # a write that did not land
        checked, wrong = check_written(index, [patch])
        assert checked == 3 and len(wrong) == 1 and wrong[0]["param"] == "runtime.w" and wrong[0]["wrong"] == 1
        assert check_written(index, [patch], samples=0) == (0, [])

    def test_compare_counts_wrong_elements_and_those_no_rank_holds(self) -> None:
        """Two ranks hold rows 0-3 and 3-6 (row 3 on both): as many reads as elements, yet row 7 is nobody's."""
        weights = torch.randn(8, 16).to(torch.bfloat16)
        spec = TensorSpec("w", (8, 16), "BF16")

        def rank(lo: int, hi: int, held: torch.Tensor) -> tuple[dict, bytes | str]:
            index = IndexMap([spec])
            param = torch.nn.Parameter(held[lo:hi].clone(), requires_grad=False)
            index.targets["w"].append(Target(param, "runtime.w", spec.shape, lo=(lo, 0), hi=(hi, 16), offset=(-lo, 0)))
            counts, masks = compare_held(index, lambda name: weights if name == "w" else None)
            return counts, pack_held(masks, text=True)

        assert merge_compared({"w": spec}, [rank(0, 4, weights), rank(3, 7, weights)]) == {
            "w": {"read": 128, "wrong": 0, "missing": 16}
        }
        off = weights.clone()
        off.view(torch.int16)[0, :3] += 1  # the rank holds three elements one ulp off
        assert merge_compared({"w": spec}, [rank(0, 8, off)]) == {"w": {"read": 128, "wrong": 3, "missing": 0}}
        with pytest.raises(TensorMismatch, match="64 elements given"):
            compare_held(IndexMap.whole({"w": torch.nn.Parameter(weights, requires_grad=False)}),
                         lambda name: weights[:4])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
class TestPackedExperts:
    """vLLM's real CPU prepack op: patching through the probed permutation equals re-packing from scratch."""

    @pytest.mark.parametrize("shape", [(2 * 64, 128), (128, 64)])
    def test_patch_in_place_equals_repacking(self, shape: tuple[int, int]) -> None:
        from deltasync.appliers.vllm import cpu_experts

        assert cpu_experts.install_expert_hooks()
        isa = "amx" if torch.cpu._is_amx_tile_supported() else "vec"
        plain = torch.randn(3, *shape).to(torch.bfloat16)
        packed = cpu_experts._tagging_prepack(plain, isa)
        assert cpu_experts.packed_isa(packed) == isa
        param = torch.nn.Parameter(packed, requires_grad=False)
        setattr(param, cpu_experts.PREPACK_ATTR, isa)
        assert cpu_experts.PACKED_EXPERTS.claims("w13_weight", param)
        changed = torch.randperm(plain.numel(), generator=torch.Generator().manual_seed(0))[:500]
        new = plain.clone()
        new.view(-1)[changed] = torch.randn(500).to(torch.bfloat16)
        cpu_experts.PACKED_EXPERTS.write(param.data, changed, bits_view(new.view(-1)[changed]), torch.bfloat16)
        repacked = cpu_experts._ORIGINAL_PREPACK(new, isa)
        assert torch.equal(bits_view(param.data), bits_view(repacked))
        read = cpu_experts.PACKED_EXPERTS.read(param.data, changed, torch.bfloat16)
        assert torch.equal(read, bits_view(new.view(-1)[changed]))
