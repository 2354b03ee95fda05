"""Mixture-of-Experts replicas: a trained Qwen3-MoE followed by real vLLM engines, exact in packed layouts.

The trainer is a real transformers Qwen3-MoE (fused experts in memory) trained
with AdamW; it publishes in the checkpoint's per-expert names. The replicas are
vLLM CPU engines, whose MoE kernel pads the expert width (48 -> 64) and prepacks
the expert weights after loading. After every version each rank reads back
bit-exact in checkpoint coordinates; at the end the engine's runtime tensors
(packed as the kernel reads them) equal those of a fresh engine loaded from the
trainer's weights. A map that does not know the packing is refused at start-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deltasync.errors import LayoutMismatch
from deltasync.publish.publisher import Publisher
from tests.vllm_helpers import (
    VLLM_TESTS,
    Trainer,
    assert_engine_exact,
    engine,
    greedy,
    runtime_digests,
    save_checkpoint,
    tiny_qwen3_moe,
)

pytestmark = VLLM_TESTS

PACKED = "vllm-cpu-packed-experts"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from deltasync.demo.models import smollm2_checkpoint

    return tiny_qwen3_moe(tmp_path_factory.mktemp("moe") / "qwen3-moe", smollm2_checkpoint())


@pytest.fixture(autouse=True)
def _rpc_callables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests run functions in the workers through ``collective_rpc`` (engines inherit the environment)."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _drop_packed_layout(worker: Any) -> None:
    from deltasync.appliers.mapping import unregister_layout

    unregister_layout(PACKED)


def _restore_packed_layout(worker: Any) -> None:
    from deltasync.appliers.mapping import layout_names, register_layout
    from deltasync.appliers.vllm.cpu_experts import PACKED_EXPERTS

    if PACKED not in layout_names():
        register_layout(PACKED_EXPERTS)


def _follow(llm: Any, moe_dir: Path, store: str, trainer: Trainer, steps: int) -> dict[str, Any]:
    """Train ``steps`` AdamW steps, publishing each; the engine follows and is exact after every version."""
    from deltasync.appliers.vllm.follower import VLLMFollower

    follower = VLLMFollower(llm, model=moe_dir)
    layouts = {p: name for rank in follower.ranks for p, name in rank["layouts"].items()}
    assert {layouts[p] for p in layouts if p.endswith(("w13_weight", "w2_weight"))} == {PACKED}
    assert not any(rank["tables"] for rank in follower.ranks), "expert tensors must map as boxes, not tables"
    touched = []
    with Publisher(trainer.model, store) as pub:
        sub = follower.subscriber(store, ack=False)
        pub.publish(0, block=True)
        for step in range(1, steps + 1):
            trainer.step()
            pub.publish(step, block=True)
            pub.flush()
            assert sub.update() is not None
            weights = trainer.bf16()
            assert_engine_exact(follower, weights)
            assert follower.last_apply["verified"] > 0
            touched.append(pub.stats.last.nnz if pub.stats.last else None)
            assert all(len(tokens) > 0 for tokens in greedy(llm))
        sub.close()
    return {"weights": trainer.bf16(), "digests": llm.collective_rpc(runtime_digests), "touched": touched}


def test_unknown_packing_is_refused_then_a_trained_moe_is_followed_exactly(moe_dir: Path, tmp_path: Path) -> None:
    """Without the packed-experts layout the map addresses the unpacked layout: the proof refuses it and nothing
    is written. With it, default CPU weights at TP=1 are exact after every version, and the runtime bytes equal a
    fresh engine's."""
    from deltasync.appliers.vllm.follower import VLLMFollower

    trainer = Trainer(moe_dir, lr=1e-4)
    with engine(moe_dir, plain=False) as llm:
        before = llm.collective_rpc(runtime_digests)
        llm.collective_rpc(_drop_packed_layout)
        with pytest.raises(LayoutMismatch) as caught:
            VLLMFollower(llm, model=moe_dir)
        assert "w13_weight" in str(caught.value) and "w2_weight" in str(caught.value)
        assert caught.value.name.endswith(("w13_weight", "w2_weight"))
        assert llm.collective_rpc(runtime_digests) == before  # nothing was written
        llm.collective_rpc(_restore_packed_layout)
        followed = _follow(llm, moe_dir, str(tmp_path / "run"), trainer, steps=3)  # proves once the layout is known
    fresh_dir = save_checkpoint(followed["weights"], moe_dir, tmp_path / "fresh")
    with engine(fresh_dir, plain=False) as llm:
        fresh = llm.collective_rpc(runtime_digests)
    assert followed["digests"] == fresh


def test_shared_expert_architecture_followed_exactly(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """Qwen2-MoE: routed experts plus a shared expert and its gate, exact after every version (read back through
    the map; that the packed experts' bytes equal a fresh engine's is the test above's)."""
    from deltasync.demo.models import smollm2_checkpoint

    moe_dir = tiny_qwen3_moe(tmp_path_factory.mktemp("moe-shared") / "qwen2-moe", smollm2_checkpoint(),
                             shared_expert=True)
    trainer = Trainer(moe_dir, lr=1e-4, seed=4)
    with engine(moe_dir, plain=False) as llm:
        followed = _follow(llm, moe_dir, str(tmp_path / "run"), trainer, steps=2)
    assert any("shared_expert" in name for name in followed["weights"])


def test_trained_moe_tp2_exact_on_both_ranks(moe_dir: Path, tmp_path: Path) -> None:
    """TP=2 splits every expert's width across ranks (24 each, padded to 32): each rank exact."""
    trainer = Trainer(moe_dir, lr=1e-4, seed=1)
    with engine(moe_dir, tp=2, plain=True) as llm:
        followed = _follow(llm, moe_dir, str(tmp_path / "run"), trainer, steps=2)
    assert len(followed["digests"]) == 2


def test_sampled_check_can_be_switched_off(moe_dir: Path, tmp_path: Path) -> None:
    """``verify=0`` skips the sampled read-back of sparse deltas (anchors are always read back)."""
    from deltasync.appliers.vllm.follower import VLLMFollower

    trainer = Trainer(moe_dir, lr=1e-5, seed=2)  # sparse: no tensor is carried whole
    store = str(tmp_path / "run")
    with engine(moe_dir, plain=True) as llm, Publisher(trainer.model, store) as pub:
        follower = VLLMFollower(llm, model=moe_dir, verify=0)
        sub = follower.subscriber(store, ack=False)
        pub.publish(0, block=True)
        pub.flush()
        assert sub.update() is not None
        assert follower.last_apply["verified"] > 0  # the anchor
        trainer.step()
        pub.publish(1, block=True)
        pub.flush()
        assert sub.update() is not None
        assert follower.last_apply["verified"] == 0
        assert_engine_exact(follower, trainer.bf16())
        sub.close()


def test_expert_parallel_ranks_prove_apply_and_fetch_only_their_experts(moe_dir: Path, tmp_path: Path) -> None:
    """EP=2: each rank holds 4 of 8 experts per layer, proves and applies exactly; a rank's range reads
    fetch only its experts. (vLLM 0.32's CPU build loads EP engines but its forward pass crashes, so
    this engine never generates.)"""
    from deltasync.appliers.vllm.follower import VLLMFollower
    from deltasync.protocol.keys import MANIFEST_KEY
    from deltasync.protocol.manifest import Manifest
    from deltasync.replica.ranged import fetch_tensors
    from deltasync.stores import open_store

    trainer = Trainer(moe_dir, lr=1e-4, seed=3)
    store = str(tmp_path / "run")
    with engine(moe_dir, tp=2, plain=True, enable_expert_parallel=True) as llm, Publisher(trainer.model, store) as pub:
        follower = VLLMFollower(llm, model=moe_dir)
        held = follower.rank_tensors()
        experts = [{n for n in held[r] if ".mlp.experts." in n} for r in (0, 1)]
        assert experts[0] and experts[1] and experts[0].isdisjoint(experts[1])
        assert all(".experts.0." in n or ".experts.1." in n or ".experts.2." in n or ".experts.3." in n
                   for n in experts[0])
        sub = follower.subscriber(store, ack=False)
        pub.publish(0, block=True)
        for step in (1, 2):
            trainer.step()
            pub.publish(step, block=True)
        pub.flush()
        sub.update()
        assert_engine_exact(follower, trainer.bf16())
        sub.close()
    run = open_store(store)
    manifest = Manifest.from_bytes(run.get(MANIFEST_KEY))
    for entry in manifest.versions:
        for ref in entry.anchor + entry.delta:
            reads = [fetch_tensors(run, ref, held[r].__contains__, gap=0) for r in (0, 1)]
            assert all(f.bytes_read < ref.size for f in reads), (ref.key, [f.bytes_read for f in reads], ref.size)
