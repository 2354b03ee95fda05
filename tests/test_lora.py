"""LoRA runs in two exact forms (deltasync.publish.lora, deltasync.publish.forms): merged weights or the adapter, smaller wins.

Every version a replica holds is compared bit for bit with the form the
publisher committed; the adapter form's factors with the trainer's own fp32
parameters and its ``save_pretrained`` files. The vLLM replica of such a run is
``tests/test_vllm_lora.py``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import Publisher, Subscriber
from deltasync.appliers import TorchModuleApplier
from deltasync.errors import ConfigError
from deltasync.publish.forms import wire_cost
from deltasync.stores import MemoryStore
from deltasync.tensors import ChangeSet, TensorChange, TensorSpec

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'deltasync[peft]')")
transformers = pytest.importorskip("transformers", reason="transformers missing (pip install 'deltasync[trl]')")

from deltasync.publish.lora import (  # noqa: E402
    WEIGHTS_NAME,
    LoraWeights,
    adapter_active,
    adapter_specs,
    publishable,
    write_adapter,
)
from tests.test_peft import VOCAB, qwen3  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def lora_model(**config: Any) -> Any:
    config = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"} | config
    return peft.get_peft_model(qwen3(), peft.LoraConfig(**config))


def replica_of(weights: LoraWeights) -> dict[str, torch.Tensor]:
    """A replica's tensors: base names in bf16, factors in their own dtype."""
    return {
        n: t.detach().clone().to(t.dtype if n in weights.own_dtype else torch.bfloat16) for n, t in weights.items()
    }


def assert_holds(replica: dict[str, torch.Tensor], form: Any) -> None:
    assert replica.keys() == set(form)
    for name, tensor in form.items():
        held = replica[name]
        want = tensor.detach().to(held.dtype)
        ints = torch.int16 if held.element_size() == 2 else torch.int32
        assert torch.equal(held.view(ints), want.view(ints)), name


class Run:
    """A LoRA model trained by AdamW on a fixed batch, one version per step."""

    def __init__(self, model: Any, lr: float) -> None:
        self.model = model
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.batch = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))

    def lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.model(input_ids=self.batch, labels=self.batch).loss.backward()
        self.opt.step()
        self.opt.zero_grad()


def test_auto_publishes_merged_at_small_lr_then_the_adapter_and_a_replica_holds_every_version() -> None:
    run = Run(lora_model(), lr=1e-5)
    weights = LoraWeights(run.model, mode="auto")
    replica = replica_of(weights)
    store, infos = MemoryStore("lora-auto"), []
    forms = []
    with Publisher(weights, store, anchor_every=3, on_publish=infos.append) as publisher:
        subscriber = Subscriber(store, TorchModuleApplier(replica, dtype=None))
        for step in range(12):
            run.lr(1e-5 if step < 5 else 1e-2)
            run.step()
            publisher.publish(step, block=True)
            publisher.flush()
            subscriber.update()
            assert subscriber.version == publisher.version
            forms.append(publisher.writer_engine.form)
            assert_holds(replica, weights.forms()[forms[-1]])
    assert forms[1:5] == ["merged"] * 4 and forms[-1] == "adapter", forms
    deltas = {i.version: i for i in infos if i.kind == "delta"}
    assert {i.form for i in deltas.values()} == {"merged", "adapter"}
    switch = forms.index("adapter")
    assert deltas[switch + 2].bytes < deltas[switch].bytes  # the switch costs once
    # A new replica starts from the newest anchor (taken in the adapter form) and ends exact too.
    late = replica_of(LoraWeights(lora_model(), mode="auto"))
    Subscriber(store, TorchModuleApplier(late, dtype=None)).update()
    assert_holds(late, weights.forms()["adapter"])


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_a_forced_form_is_kept_and_the_trainer_is_only_read(mode: str) -> None:
    run = Run(lora_model(), lr=1e-2)
    base = {n: p.detach().clone() for n, p in run.model.named_parameters() if "lora_" not in n}
    weights = LoraWeights(run.model, mode=mode)
    assert list(weights.forms()) == [mode]
    replica = replica_of(weights)
    store, infos = MemoryStore(f"lora-{mode}"), []
    with Publisher(weights, store, on_publish=infos.append) as publisher:
        subscriber = Subscriber(store, TorchModuleApplier(replica, dtype=None))
        for step in range(3):
            run.step()
            publisher.publish(step, block=True)
            publisher.flush()
            subscriber.update()
            assert_holds(replica, weights.forms()[mode])
    assert {i.form for i in infos} == {mode}
    factors = {n: replica[n] for n in weights.own_dtype}
    assert adapter_active(factors) == (mode == "adapter")
    if mode == "adapter":  # the factors are the trainer's fp32 parameters, bit for bit
        saved = peft.utils.get_peft_model_state_dict(run.model)
        assert all(torch.equal(factors[n].view(torch.int32), saved[n].view(torch.int32)) for n in factors)
    for name, param in run.model.named_parameters():
        if name in base:
            assert torch.equal(param.detach(), base[name]), name


def test_written_adapter_is_what_save_pretrained_writes_and_peft_loads_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    bare = qwen3()
    run = Run(peft.get_peft_model(copy.deepcopy(bare), peft.LoraConfig(r=4, target_modules=["q_proj", "up_proj"])), 1e-2)
    for _ in range(2):
        run.step()
    weights = LoraWeights(run.model, mode="adapter")
    ours = write_adapter(weights.factors, weights.config, tmp_path / "ours")
    run.model.save_pretrained(tmp_path / "theirs")
    a, b = load_file(ours / WEIGHTS_NAME), load_file(tmp_path / "theirs" / WEIGHTS_NAME)
    assert a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(bare), str(ours)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(run.batch).logits, run.model.eval()(run.batch).logits)


def test_adapter_specs_from_the_checkpoint_match_the_trainers(tmp_path: Path) -> None:
    bare = qwen3()
    bare.save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=4, target_modules="all-linear", rank_pattern={"q_proj": 2})
    weights = LoraWeights(peft.get_peft_model(bare, config))
    ours = sorted(adapter_specs(tmp_path / "base", config), key=lambda s: s.name)
    assert ours == sorted((TensorSpec.of(n, t) for n, t in weights.factors.items()), key=lambda s: s.name)


def test_modules_to_save_ride_as_base_tensors_in_both_forms() -> None:
    run = Run(lora_model(target_modules=["q_proj"], modules_to_save=["lm_head"]), lr=1e-2)
    run.step()
    weights = LoraWeights(run.model)
    trained = run.model.base_model.model.lm_head.modules_to_save["default"].weight
    for form in weights.forms().values():
        assert torch.equal(form["lm_head.weight"], trained.detach())
    assert not any("lm_head" in n for n in weights.factors)
    assert weights.config.modules_to_save is None


def test_refused() -> None:
    two = lora_model()
    two.add_adapter("second", peft.LoraConfig(r=4, target_modules=["q_proj"]))
    two.base_model.set_adapter(["default", "second"])
    with pytest.raises(ConfigError, match="one LoRA adapter"):
        LoraWeights(two)
    with pytest.raises(ConfigError, match="lora_bias"):
        LoraWeights(peft.get_peft_model(qwen3(attention_bias=True), peft.LoraConfig(target_modules=["q_proj"], lora_bias=True)))
    with pytest.raises(ConfigError, match="lora mode"):
        LoraWeights(lora_model(), mode="both")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no PEFT adapters"):
        LoraWeights(qwen3())
    plain = qwen3()
    assert publishable(plain, lora="auto") is plain
    assert isinstance(publishable(lora_model(), lora="auto"), LoraWeights)
    with pytest.raises(ConfigError, match="lora must be"):
        publishable(plain, lora="adapters")  # type: ignore[arg-type]


def test_wire_cost_is_close_to_the_encoded_size_and_skips_zeros_and_fixed_tensors() -> None:
    from deltasync.format import encode_delta
    from deltasync.publish.diff import Snapshot, diff

    weights = {"w": torch.randn(200_000) * 0.02}
    snapshot = Snapshot.capture(weights)
    where = torch.randperm(200_000, generator=torch.Generator().manual_seed(0))[:4_000]
    weights["w"][where] *= 1.01  # about one ulp up at 2 % of the elements
    changes = diff(snapshot, weights)
    encoded = len(encode_delta(changes, version=1, base_version=0))
    assert 0.7 < wire_cost(changes) / encoded < 1.4, (wire_cost(changes), encoded)
    spec = TensorSpec("z", (8,), "F32")
    zeroed = TensorChange(spec, None, torch.zeros(8, dtype=torch.int32), None, 8)
    assert wire_cost(ChangeSet((zeroed,), (spec,))) == 0
    assert wire_cost(changes, skip={"w"}) == 0


def test_trainer_logs_the_share_of_adapter_versions(tmp_path: Path) -> None:
    from deltasync.integrations import DeltaSyncCallback

    model = lora_model()
    rows = [{"input_ids": list(range(i, i + 16)), "labels": list(range(i, i + 16))} for i in range(8)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", lr_scheduler_type="constant",
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    callback = DeltaSyncCallback(str(tmp_path / "run"), lora="auto").attach(trainer)

    class Committed(transformers.TrainerCallback):
        """Waits for each step's version before the Trainer logs (on a busy machine uploads may lag)."""

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            callback.publisher.flush()

    trainer.add_callback(Committed())  # after the deltasync callback: its publish comes first
    trainer.train()
    callback.publisher.close()
    logged = [r for r in trainer.state.log_history if "deltasync/adapter_form" in r]
    assert logged and logged[-1]["deltasync/adapter_form"] == 1.0
    assert {i.form for i in callback.history} == {"merged", "adapter"}  # v0 is the merged anchor
