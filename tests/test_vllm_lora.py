"""A LoRA run followed by real vLLM engines serving the adapter (vLLM's CPU LoRA), through both forms.

The trainer publishes :class:`deltasync.publish.lora.LoraWeights` in ``"auto"`` mode:
merged weights while its learning rate is small, the adapter itself once it is
large. An engine follows the whole run: its weights equal the published base
names bit for bit at every version, and while the run is in adapter form it
serves the adapter the follower wrote, whose tensors are bit-identical to the
trainer's own ``save_pretrained`` and whose greedy tokens equal those of that
directory loaded into the same engine, its logprobs within the engine's own
run-to-run noise (``vllm_helpers.assert_served``). Once in process
(``LLM(enable_lora=True)``), once as a ``vllm serve`` server that loads each
version's adapter in place under one name.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import Publisher
from tests.vllm_helpers import PROMPTS, VLLM_TESTS, Trainer, assert_engine_exact, assert_served, engine, tiny_qwen3

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'deltasync[peft]')")

pytestmark = [*VLLM_TESTS, pytest.mark.filterwarnings("ignore::UserWarning")]

RANK = 8
TOKENS = 6
Served = list[tuple[list[int], list[float]]]


def follow_auto_run(
    base: Path, tmp_path: Path, make_follower: Callable[[Any], Any], check: Callable[[Any, str, Path], None]
) -> list[str]:
    """Train a LoRA model (3 steps at lr 1e-5, then 3 at 1e-2), publishing ``"auto"``; after each version
    the follower holds it: engine weights exact, and ``check(follower, form, trainer_adapter_dir)``."""
    from safetensors.torch import load_file

    from deltasync.publish.lora import WEIGHTS_NAME, LoraWeights

    trainer = Trainer(base)
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear")
    model = peft.get_peft_model(trainer.model, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    weights = LoraWeights(model, mode="auto")
    forms: list[str] = []
    with Publisher(weights, str(tmp_path / "run")) as publisher:
        publisher.publish(0, block=True)
        follower = make_follower(config)
        subscriber = follower.subscriber(str(tmp_path / "run"))
        for step in range(1, 7):
            for group in opt.param_groups:  # from step 4 a LoRA learning rate: the adapter becomes smaller
                group["lr"] = 1e-5 if step < 4 else 1e-2
            batch = trainer.batch
            model(**batch, labels=batch.input_ids.masked_fill(batch.attention_mask == 0, -100)).loss.backward()
            opt.step()
            opt.zero_grad()
            publisher.publish(step, block=True)
            publisher.flush()
            subscriber.poll()
            assert subscriber.version == publisher.version
            forms.append(publisher.stats.last.form)
            expected = weights.forms()[forms[-1]]
            assert_engine_exact(follower, {n: expected[n].detach().to(torch.bfloat16) for n in follower.engine_specs})
            saved = tmp_path / f"trainer-v{publisher.version}"
            model.save_pretrained(saved)
            if forms[-1] == "adapter":
                ours, theirs = load_file(follower.adapter.directory / WEIGHTS_NAME), load_file(saved / WEIGHTS_NAME)
                assert ours.keys() == theirs.keys()
                for name, tensor in theirs.items():
                    assert tensor.dtype == ours[name].dtype, name
                    assert torch.equal(tensor.view(torch.int32), ours[name].view(torch.int32)), name
            check(follower, forms[-1], saved)
        follower.close()
    assert forms[:3] == ["merged"] * 3 and forms[-1] == "adapter", forms
    return forms


def test_in_process_engine_follows_merged_then_serves_the_adapter(tmp_path: Path) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from deltasync.appliers.vllm.follower import VLLMFollower
    from deltasync.demo.models import smollm2_checkpoint

    base = tiny_qwen3(tmp_path / "tiny-qwen3", smollm2_checkpoint())
    with engine(base, enable_lora=True, max_lora_rank=RANK, max_loras=2) as llm:

        def generate(request: Any) -> Served:
            params = SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=1)
            outs = llm.generate(PROMPTS, params, lora_request=request, use_tqdm=False)
            return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                                 o.outputs[0].token_ids)])
                    for o in outs]

        def check(follower: Any, form: str, saved: Path) -> None:
            if form == "merged":
                assert follower.lora_request is None  # the engine's weights alone hold the merged policy
                return
            version = int(saved.name.rsplit("v", 1)[1])
            reference = LoRARequest(saved.name, 1000 + version, str(saved))
            served = generate(follower.lora_request)
            assert_served(served, generate(reference), generate(None))  # and the adapter is in use
            llm.llm_engine.remove_lora(reference.lora_int_id)

        follow_auto_run(base, tmp_path, lambda config: VLLMFollower(llm, model=base, lora=config), check)


def test_server_replica_serves_each_versions_adapter_under_one_name(tmp_path: Path) -> None:
    from deltasync.appliers.vllm.follower import VLLMFollower
    from deltasync.appliers.vllm.lora import LORA_NAME
    from deltasync.demo.models import smollm2_checkpoint
    from tests.test_trl import _example

    example = _example()
    base = tiny_qwen3(tmp_path / "tiny-qwen3", smollm2_checkpoint())
    with open(tmp_path / "server.log", "wb") as log, example.start_server(base, example.free_port(), log=log,
                                                                          lora_rank=RANK) as url:

        def post(path: str, body: dict[str, Any]) -> bytes:
            request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.read()

        def complete(model: str) -> Served:
            body = {"model": model, "prompt": PROMPTS, "max_tokens": TOKENS, "temperature": 0.0, "logprobs": 1}
            choices = sorted(json.loads(post("/v1/completions", body))["choices"], key=lambda c: c["index"])
            return [(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]) for c in choices]

        def check(follower: Any, form: str, saved: Path) -> None:
            served = complete(LORA_NAME)  # clients always ask for the same name
            if form == "merged":  # the loaded adapter is zero: the engine's (merged) weights serve alone
                assert [tokens for tokens, _ in served] == [tokens for tokens, _ in complete(str(base))]
                return
            post("/v1/load_lora_adapter", {"lora_name": saved.name, "lora_path": str(saved)})
            assert_served(served, complete(saved.name), complete(str(base)))

        follow_auto_run(base, tmp_path, lambda config: VLLMFollower(url, model=base, lora=config), check)


def test_grpo_lora_run_generates_from_the_servers_adapter(tmp_path: Path) -> None:
    """DeltaSyncGRPOTrainer with peft_config and lora="auto": the server's follower serves each version's
    adapter under one name, the trainer generates from it, and the server ends exact with the final version."""
    import trl  # noqa: F401  (the GRPO stack must be importable)
    from safetensors.torch import load_file

    from deltasync.appliers.vllm.follower import VLLMFollower
    from deltasync.demo.models import smollm2_checkpoint
    from deltasync.integrations import DeltaSyncCallback
    from deltasync.publish.lora import LORA_NAME, WEIGHTS_NAME, LoraWeights
    from tests.test_trl import _example

    example = _example()
    base = tiny_qwen3(tmp_path / "tiny-qwen3", smollm2_checkpoint())
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear", task_type="CAUSAL_LM")
    config.save_pretrained(str(tmp_path / "adapter"))
    store = str(tmp_path / "run")
    callback = DeltaSyncCallback(store, sync="on_policy", lora="adapter", wait_timeout=180)
    with (
        open(tmp_path / "server.log", "wb") as log,
        example.start_server(base, example.free_port(), log=log, lora_rank=RANK) as url,
        example.start_follower(store, url, base, log=log, lora=tmp_path / "adapter") as follower_process,
    ):
        trainer = example.make_trainer(base, url, callback, tmp_path / "out", steps=3, lr=1e-3, peft_config=config)
        trainer.train()
        assert follower_process.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        callback.wait_for(callback.version, timeout=120)
        assert trainer.vllm_generation.vllm_client.model == LORA_NAME  # generated from the adapter
        assert {i.form for i in callback.history} == {"adapter"}
        assert any("deltasync/adapter_form" in h for h in trainer.state.log_history)
        # The server holds the final version: base weights exact, and its adapter is the trainer's.
        reader = VLLMFollower(url, model=base)
        assert reader.engine_version() == callback.version
        frozen = LoraWeights(trainer.model, mode="adapter").forms()["adapter"]
        assert_engine_exact(reader, {n: frozen[n].detach().to(torch.bfloat16) for n in reader.engine_specs})
        trainer.model.save_pretrained(tmp_path / "final")
        final = load_file(tmp_path / "final" / WEIGHTS_NAME)
        body = {"model": LORA_NAME, "prompt": PROMPTS, "max_tokens": TOKENS, "temperature": 0.0, "logprobs": 1}
        ref = {"lora_name": "final", "lora_path": str(tmp_path / "final")}
        post = urllib.request.Request(url + "/v1/load_lora_adapter", data=json.dumps(ref).encode(), method="POST",
                                      headers={"Content-Type": "application/json"})
        urllib.request.urlopen(post, timeout=120).read()

        def complete(model: str) -> Served:
            request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body | {"model": model}).encode(),
                                             method="POST", headers={"Content-Type": "application/json"})
            choices = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"]
            choices.sort(key=lambda c: c["index"])
            return [(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]) for c in choices]

        assert final
        assert_served(complete(LORA_NAME), complete("final"), complete(str(base)))
