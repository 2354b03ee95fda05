"""A LoRA run followed by a real vLLM engine serving the adapter (vLLM's CPU LoRA), through both forms.

The trainer publishes :class:`deltasync.lora.LoraWeights` in ``"auto"`` mode:
merged weights while its learning rate is small, the adapter itself once it is
large. One engine (``enable_lora=True``) follows the whole run: its weights
equal the published base names bit for bit at every version, and while the run
is in adapter form it serves the adapter the follower wrote, whose tensors are
bit-identical to the trainer's own ``save_pretrained`` and whose greedy tokens
and logprobs equal those of that directory loaded into the same engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import Publisher
from tests.vllm_helpers import PROMPTS, VLLM_TESTS, Trainer, assert_engine_exact, engine, tiny_qwen3

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'deltasync[peft]')")

pytestmark = [*VLLM_TESTS, pytest.mark.filterwarnings("ignore::UserWarning")]

RANK = 8


def generate(llm: Any, request: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs, with ``request``'s adapter (``None``: the engine's weights alone)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    outs = llm.generate(PROMPTS, params, lora_request=request, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in outs
    ]


def test_auto_lora_run_is_followed_merged_then_as_a_vllm_adapter(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from vllm.lora.request import LoRARequest

    from deltasync.appliers.vllm_follower import VLLMFollower
    from deltasync.lora import WEIGHTS_NAME, LoraWeights
    from deltasync.models import smollm2_checkpoint

    base = tiny_qwen3(tmp_path / "tiny-qwen3", smollm2_checkpoint())
    trainer = Trainer(base)
    config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear")
    model = peft.get_peft_model(trainer.model, config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    weights = LoraWeights(model, mode="auto")
    forms, infos = [], []
    with (
        engine(base, enable_lora=True, max_lora_rank=RANK, max_loras=2) as llm,
        Publisher(weights, str(tmp_path / "run"), on_publish=infos.append) as publisher,
    ):
        publisher.publish(0, block=True)
        follower = VLLMFollower(llm, model=base, lora=config)
        subscriber = follower.subscriber(str(tmp_path / "run"))
        for step in range(1, 7):
            if step == 4:  # a LoRA learning rate: the adapter becomes the smaller form
                for group in opt.param_groups:
                    group["lr"] = 1e-2
            batch = trainer.batch
            model(**batch, labels=batch.input_ids.masked_fill(batch.attention_mask == 0, -100)).loss.backward()
            opt.step()
            opt.zero_grad()
            publisher.publish(step, block=True)
            publisher.flush()
            subscriber.poll()
            assert subscriber.version == publisher.version
            form = publisher.stats.last.form if publisher.stats.last.kind == "delta" else forms[-1]
            forms.append(form)
            expected = weights.forms()[form]
            assert_engine_exact(follower, {n: expected[n].detach().to(torch.bfloat16) for n in follower.engine_specs})
            if form == "merged":
                assert follower.lora_request is None
                continue
            saved = tmp_path / f"trainer-v{publisher.version}"
            model.save_pretrained(saved)
            ours, theirs = load_file(follower.adapter.directory / WEIGHTS_NAME), load_file(saved / WEIGHTS_NAME)
            assert ours.keys() == theirs.keys()
            for name, tensor in theirs.items():
                assert tensor.dtype == ours[name].dtype, name
                assert torch.equal(tensor.view(torch.int32), ours[name].view(torch.int32)), name
            reference = LoRARequest(f"trainer-v{publisher.version}", 1000 + publisher.version, str(saved))
            served = generate(llm, follower.lora_request)
            assert served == generate(llm, reference)
            assert served != generate(llm, None)  # the adapter is in use
            llm.llm_engine.remove_lora(reference.lora_int_id)
        follower.adapter.close()
    assert forms[:3] == ["merged"] * 3 and forms[-1] == "adapter", forms
    deltas = [i for i in infos if i.kind == "delta"]
    assert deltas[-1].bytes < deltas[3].bytes  # the switch costs once, the adapter's versions after it less
