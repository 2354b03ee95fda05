"""PEFT / LoRA models published as exact merged weights (deltasync.publish.peft), on real peft and transformers models.

Tiny random models (2 layers, hidden 64) with real LoRA adapters: the merged
weights match PEFT's own ``merge_and_unload()`` bit for bit, a training run
never writes the trainer's base weights (while TRL's in-place merge/unmerge
cycle drifts them), a bf16 replica of the *base* model follows every version
exactly, and the TRL callback publishes a GRPOTrainer's LoRA policy.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import Publisher, Subscriber
from deltasync.appliers import TorchModuleApplier
from deltasync.errors import ConfigError
from deltasync.stores import MemoryStore
from deltasync.tensors import published_tensors

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'deltasync[peft]')")
transformers = pytest.importorskip("transformers", reason="transformers missing (pip install 'deltasync[trl]')")

from deltasync.publish.lora import publishable  # noqa: E402
from deltasync.publish.peft import MergedWeights  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # peft warns about tied weights and fan_in_fan_out
VOCAB = 128


def qwen3(*, tie: bool = False, seed: int = 0, **config: Any) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie, **config,
    )
    return transformers.Qwen3ForCausalLM(cfg)


def qwen3_moe(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def gpt2(seed: int = 0) -> Any:
    """GPT-2 keeps its projections as Conv1D ([in, out]): LoRA needs fan_in_fan_out=True there."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def lora(model: Any, **config: Any) -> Any:
    """A LoRA model with random (non-zero) B, so every merge changes the weights."""
    config.setdefault("target_modules", "all-linear")
    return peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **config))


def checkpoint(model: Any) -> dict[str, torch.Tensor]:
    """What a plain (or merged) model publishes: its tensors in its checkpoint's names."""
    return {name: t.detach() for name, t in published_tensors(model)}


def reference(peft_model: Any) -> dict[str, torch.Tensor]:
    """PEFT's own merge, on a deep copy: the merged checkpoint a fresh engine would load."""
    return checkpoint(copy.deepcopy(peft_model).merge_and_unload())


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).view(torch.int16)


def assert_same_bits(ours: Any, theirs: dict[str, torch.Tensor], *, bf16: bool = True) -> None:
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        if bf16:
            assert torch.equal(bits(tensor), bits(theirs[name])), name
        else:
            assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name


def two_adapters() -> Any:
    model = lora(qwen3(), r=8, lora_alpha=16)
    model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "down_proj"],
                                                init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    return model


def bf16_base(autocast: bool) -> Any:
    """A bf16 base; PEFT keeps the adapters in fp32 unless autocast_adapter_dtype=False."""
    config = peft.LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    return peft.get_peft_model(qwen3().to(torch.bfloat16), config, autocast_adapter_dtype=autocast)


CASES: dict[str, Callable[[], Any]] = {
    "all-linear": lambda: lora(qwen3(), r=8, lora_alpha=16),
    "rslora": lambda: lora(qwen3(), r=16, lora_alpha=8, use_rslora=True),
    "two-active-adapters": two_adapters,
    "fan_in_fan_out": lambda: lora(gpt2(), r=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True),
    "lora_bias": lambda: lora(qwen3(attention_bias=True), target_modules=["q_proj", "v_proj"], lora_bias=True),
    "embedding": lambda: lora(qwen3(), target_modules=["embed_tokens", "q_proj"]),
    "modules_to_save": lambda: lora(qwen3(), target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "tied-embeddings": lambda: lora(qwen3(tie=True)),  # all-linear leaves the tied lm_head alone
    "moe-attention": lambda: lora(qwen3_moe(), target_modules=["q_proj", "o_proj"]),
    "bf16-base-fp32-adapters": lambda: bf16_base(True),
    "bf16-base-bf16-adapters": lambda: bf16_base(False),
}


class TestMergedWeights:
    @pytest.mark.parametrize("case", list(CASES))
    def test_equals_merge_and_unload_bit_for_bit(self, case: str) -> None:
        model = CASES[case]()
        theirs = reference(model)
        # In the base weights' own dtype, every element (fp32 masters included), then the published bf16 cast.
        assert_same_bits(MergedWeights(model, dtype=None), theirs, bf16=False)
        assert_same_bits(MergedWeights(model), theirs)
        merged = MergedWeights(model)  # merged tensors come in the published dtype, the others as they are
        assert merged.merged_names and all(merged[n].dtype == torch.bfloat16 for n in merged.merged_names)

    @pytest.mark.parametrize(
        "case", ["all-linear", "fan_in_fan_out", "modules_to_save", "tied-embeddings", "moe-attention"]
    )
    def test_names_are_the_base_checkpoint_names(self, case: str) -> None:
        model = CASES[case]()
        merged = MergedWeights(model)
        base = type(model.get_base_model())(model.get_base_model().config)  # the bare architecture
        assert list(merged) == list(checkpoint(base))
        assert not any("lora_" in n or "base_layer" in n or "modules_to_save" in n for n in merged)
        if case == "moe-attention":  # fused experts come out per expert, as the checkpoint stores them
            assert "model.layers.0.mlp.experts.3.down_proj.weight" in merged

    def test_other_tensors_are_the_base_parameters_themselves(self) -> None:
        model = CASES["all-linear"]()
        merged = MergedWeights(model)
        assert set(merged.merged_names) == {n for n in merged if n.endswith("proj.weight")}
        norm = model.get_base_model().model.layers[0].input_layernorm.weight
        assert merged["model.layers.0.input_layernorm.weight"].data_ptr() == norm.data_ptr()
        assert "model.layers.0.self_attn.q_proj.weight" in merged and "nope" not in merged

    def test_reading_never_writes_the_model(self) -> None:
        model = CASES["two-active-adapters"]()
        params = dict(model.named_parameters())
        before = {n: (p._version, p.detach().clone()) for n, p in params.items()}
        for _ in MergedWeights(model, dtype=None).items():
            pass
        for name, (version, value) in before.items():  # _version counts in-place writes
            assert params[name]._version == version and torch.equal(params[name], value), name

    def test_each_merged_tensor_is_computed_once_per_publish(self, monkeypatch: pytest.MonkeyPatch) -> None:
        model = CASES["all-linear"]()
        calls: list[str] = []
        delta = peft.tuners.lora.Linear.get_delta_weight
        monkeypatch.setattr(peft.tuners.lora.Linear, "get_delta_weight", lambda s, a: calls.append(a) or delta(s, a))
        merged = MergedWeights(model)
        assert calls == []  # making the mapping computes nothing
        with Publisher(merged, MemoryStore("once")) as publisher:
            calls.clear()
            publisher.publish(0, block=True)  # the anchor: one pass
            assert len(calls) == len(merged.merged_names) == 14
            with torch.no_grad():
                model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight.add_(1e-2)
            calls.clear()
            publisher.publish(1, block=True)  # a delta: one pass
            assert len(calls) == 14
            publisher.flush()
            assert publisher.stats.last.nnz > 0

    def test_adapters_loaded_through_transformers_without_a_peft_model(self) -> None:
        config: dict[str, Any] = dict(r=8, target_modules=["q_proj", "v_proj"])
        model, twin = qwen3(), lora(qwen3(), **config)  # the same base; the twin takes the model's adapter
        model.add_adapter(peft.LoraConfig(init_lora_weights=False, **config))
        adapter = {k: v for k, v in model.state_dict().items() if "lora_" in k}
        assert not twin.get_base_model().load_state_dict(adapter, strict=False).unexpected_keys
        assert_same_bits(MergedWeights(model, dtype=None), reference(twin), bf16=False)

    def test_modules_to_save_publishes_the_trained_copy_under_the_base_name(self) -> None:
        model = CASES["modules_to_save"]()
        head = model.base_model.model.lm_head
        with torch.no_grad():
            head.modules_to_save["default"].weight.add_(1.0)  # as training would move it
        merged = MergedWeights(model, dtype=None)
        assert torch.equal(merged["lm_head.weight"], head.modules_to_save["default"].weight)
        assert not torch.equal(merged["lm_head.weight"], head.original_module.weight)
        assert_same_bits(merged, reference(model), bf16=False)

    def test_active_adapters_are_read_on_every_pass(self) -> None:
        model = two_adapters()
        merged = MergedWeights(model)
        model.base_model.set_adapter("second")
        assert_same_bits(merged, reference(model))

    def test_a_merged_adapter_is_refused_until_unmerged(self) -> None:
        model = CASES["all-linear"]()
        merged = MergedWeights(model)
        model.merge_adapter()
        with pytest.raises(RuntimeError, match=r"merged into the base weights; call unmerge_adapter\(\) first"):
            dict(merged.items())
        model.unmerge_adapter()
        dict(merged.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["all-linear", "two-active-adapters", "bf16-base-bf16-adapters", "moe-attention"])
def test_on_cuda_merged_on_the_device_and_equal_to_merge_and_unload(case: str) -> None:
    model = CASES[case]().to("cuda")  # bf16 adapters: PEFT's delta is a bf16 matmul on the GPU, and ours too
    merged = MergedWeights(model)
    assert all(merged[n].device.type == "cuda" for n in merged.merged_names)
    assert_same_bits(MergedWeights(model, dtype=None), reference(model), bf16=False)
    assert_same_bits(merged, reference(model))


def _step(model: Any, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()


class TestTrainingRun:
    STEPS = 20

    def test_twenty_publishes_leave_the_base_untouched_and_a_base_replica_exact(self) -> None:
        bare = qwen3()
        replica = copy.deepcopy(bare).to(torch.bfloat16)  # a replica that loaded the base checkpoint, no PEFT
        model = lora(bare, r=8)
        base = model.get_base_model()
        frozen = {n: p.detach().clone() for n, p in base.named_parameters() if "lora_" not in n}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        batch = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
        store = MemoryStore("peft-run")
        infos: list[Any] = []
        with Publisher(MergedWeights(model), store, anchor_every=8, on_publish=infos.append) as publisher:
            subscriber = Subscriber(store, TorchModuleApplier(replica))
            for step in range(self.STEPS):
                _step(model, opt, batch)
                publisher.publish(step, block=True)
                publisher.flush()
                subscriber.update()
                assert subscriber.version == publisher.version == step
                assert_same_bits(checkpoint(replica), reference(model))  # the replica: PEFT's merge, cast to bf16
        deltas = [i for i in infos if i.kind == "delta"]
        assert len(deltas) == self.STEPS - 1 and all(i.nnz > 0 for i in deltas)
        for name, param in base.named_parameters():
            if name in frozen:  # every base weight, bit for bit as it started: no drift
                assert torch.equal(param.detach().view(torch.int32), frozen[name].view(torch.int32)), name

    def test_merge_unmerge_cycles_drift_the_fp32_base(self) -> None:
        """What TRL does around each vLLM sync (merge_adapter, copy, unmerge_adapter), on a twin of the run."""
        model = lora(qwen3(), r=8)
        twin = copy.deepcopy(model)
        start = {n: p.detach().clone() for n, p in twin.named_parameters() if "base_layer" in n}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        batch = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
        merged = MergedWeights(model)
        twin_lora = {n: p for n, p in twin.named_parameters() if "lora_" in n}
        for step in range(self.STEPS):
            _step(model, opt, batch)
            dict(merged.items())  # deltasync's publish pass
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name in twin_lora:
                        twin_lora[name].copy_(param)
            twin.merge_adapter()
            twin.unmerge_adapter()
        drifted = sum(int((p.detach() != start[n]).sum()) for n, p in twin.named_parameters() if n in start)
        untouched = sum(int((p.detach() != start[n]).sum()) for n, p in model.named_parameters() if n in start)
        print(f"\nafter {self.STEPS} merge/unmerge cycles: {drifted} of "
              f"{sum(t.numel() for t in start.values())} fp32 base elements drifted; deltasync: {untouched}")
        assert drifted > 0 and untouched == 0


class TestRefused:
    @pytest.mark.parametrize(
        "make, match",
        [
            (lambda: peft.get_peft_model(qwen3(), peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[])),
             "uses the IA3 tuner"),
            (lambda: peft.get_peft_model(qwen3(), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
             "uses the PREFIX_TUNING tuner"),
            (lambda: peft.get_peft_model(qwen3(), peft.LoHaConfig(target_modules=["q_proj"])), "uses the LOHA tuner"),
            (lambda: lora(qwen3(), target_modules=["q_proj"], use_dora=True), "is a DoRA adapter"),
            (lambda: lora(qwen3(), target_modules=["q_proj"], trainable_token_indices=[1, 2]),
             "TrainableTokensWrapper"),
            (lambda: lora(qwen3(tie=True), target_modules=["q_proj"], modules_to_save=["lm_head"]), "share one weight"),
            (lambda: lora(qwen3(tie=True), target_modules=["q_proj", "lm_head"]), "share one weight"),
            (lambda: lora(qwen3(tie=True), target_modules=["embed_tokens"]), "share one weight"),
            (lambda: lora(qwen3_moe(), target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
             "ParamWrapper layer"),
        ],
        ids=["ia3", "prefix-tuning", "loha", "dora", "trainable-tokens", "tied-modules-to-save", "tied-lm-head",
             "tied-embedding", "moe-expert-parameters"],
    )
    def test_unsupported_models_raise_config_error(self, make: Callable[[], Any], match: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = make()
        with pytest.raises(ConfigError, match=match):
            MergedWeights(model)

    def test_sharded_peft_models_and_plain_models(self) -> None:
        model = CASES["all-linear"]()
        with pytest.raises(ConfigError, match="sharded parameters"):
            publishable(model, sharded=True)
        assert isinstance(publishable(model), MergedWeights)
        plain = qwen3()
        assert publishable(plain, sharded=True) is plain
        with pytest.raises(ConfigError, match="has no PEFT adapters"):
            MergedWeights(plain)


HAS_GRPO = all(importlib.util.find_spec(m) is not None for m in ("trl", "datasets"))


@pytest.mark.skipif(not HAS_GRPO, reason="needs trl and datasets (pip install 'deltasync[trl]')")
def test_grpo_trainer_with_a_lora_config_publishes_the_merged_policy(tmp_path: Path) -> None:
    """TRL's GRPOTrainer (transformers generation, no vLLM) wraps the model in PEFT; the callback publishes merged."""
    import trl
    from datasets import Dataset

    from deltasync.demo.models import smollm2_checkpoint
    from deltasync.integrations import DeltaSyncCallback

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_checkpoint())
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    bare = transformers.LlamaForCausalLM(config)
    replica = copy.deepcopy(bare).to(torch.bfloat16)
    frozen = {n: p.detach().clone() for n, p in bare.named_parameters()}
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, learning_rate=1e-3, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, use_vllm=False, beta=0.0,
    )
    prompts = Dataset.from_dict({"prompt": ["The capital of France is", "Water boils at", "One, two,", "def f():"] * 2})
    callback = DeltaSyncCallback(str(tmp_path / "run"))
    trainer = trl.GRPOTrainer(
        model=bare, reward_funcs=lambda completions, **_: [len(c) / 100 for c in completions], args=args,
        train_dataset=prompts, processing_class=tokenizer,
        peft_config=peft.LoraConfig(r=8, target_modules="all-linear"),
    )
    callback.attach(trainer)
    trainer.train()

    assert [i.kind for i in callback.history if i.kind != "span"] == ["anchor", "delta", "delta", "delta"]
    assert callback.version == 3
    Subscriber(str(tmp_path / "run"), TorchModuleApplier(replica)).update()
    assert_same_bits(checkpoint(replica), reference(trainer.model))
    base = trainer.model.get_base_model()
    for name, param in base.named_parameters():  # TRL's policy trained; its base weights never moved
        clean = name.replace("base_layer.", "")
        if "lora_" not in name:
            assert torch.equal(param.detach(), frozen[clean]), name
