"""vLLM replicas apply deltas in place: exact through fused and tensor-parallel parameters.

Real vLLM (CPU build) engines; each start takes 15-25 s, so engines are shared
per module and the file stays within a few minutes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from deltasync.appliers.vllm.wire import pack
from deltasync.errors import FingerprintMismatch, IntegrityError
from deltasync.format import Header
from deltasync.publish.publisher import Publisher
from tests.vllm_helpers import (
    BENCH_EXTENSION,
    VLLM_TESTS,
    Trainer,
    assert_engine_exact,
    assert_served,
    engine,
    greedy,
    latest,
    save_checkpoint,
    tiny_qwen3,
)

pytestmark = VLLM_TESTS


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from deltasync.demo.models import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="module")
def plain_run(smollm2: Path, tmp_path_factory: pytest.TempPathFactory):
    """TP=1 SmolLM2 with plain CPU weights, following a trainer's run from the checkpoint it loaded."""
    from deltasync.appliers.vllm.follower import VLLMFollower

    store = str(tmp_path_factory.mktemp("vllm-plain") / "run")
    trainer = Trainer(smollm2, lr=1e-5)
    # The extension with vLLM's own loader beside deltasync's (a reference for the served outputs).
    with engine(smollm2, plain=True, extension=BENCH_EXTENSION) as llm, Publisher(trainer.model, store) as pub:
        pub.publish(0, block=True)
        pub.flush()
        run_id, version = latest(store)
        follower = VLLMFollower(llm, model=smollm2)
        # The engine loaded the same checkpoint: follow with deltas from the first version.
        sub = follower.subscriber(store, ack=False, start_version=version, run_id=run_id)
        yield llm, follower, sub, trainer, pub
        sub.close()


class TestPlainWeights:
    def test_map_is_all_boxes(self, plain_run) -> None:
        _, follower, *_ = plain_run
        (rank,) = follower.ranks
        assert rank["cpu_hooks"] == "plain" and rank["repacked_layers"] == [] and rank["tables"] == []
        assert rank["decodes_files"] and follower.takes_files("delta")
        assert follower.takes_files("anchor")  # by files dropped for it: the engine's processes run on this machine
        follower.ranks = [rank | {"decodes_files": False}]  # an older worker extension: the follower decodes
        try:
            assert not follower.takes_files("delta")
        finally:
            follower.ranks = [rank]
        assert sum(rank["counts"].values()) == sum(s.numel for s in follower.specs.values())

    def test_real_deltas_exact_and_generations_match(self, plain_run, smollm2: Path, tmp_path: Path) -> None:
        llm, follower, sub, trainer, pub = plain_run
        initial = greedy(llm, logprobs=1)
        for step in range(1, 4):
            trainer.step()
            pub.publish(step, block=True)
            pub.flush()
            calls = follower.rpc_calls
            info = sub.update()
            assert info is not None and info.route == ("delta",)
            assert follower.rpc_calls - calls == 1  # the files, decoded and written in the one worker
            assert follower.last_apply["decode_ms"] > 0
            assert_engine_exact(follower, trainer.bf16())
            assert follower.engine_version() == pub.version
        assert [v for v, _ in follower.history] == [pub.version - 2, pub.version - 1, pub.version]
        served = greedy(llm, logprobs=1)
        assert served != initial  # the check below can tell weights that were not served apart
        # Reference: the same engine after vLLM's own loader wrote the same weights (same kernels and
        # threads; another machine's transformers or a second engine may break a near tie differently).
        weights = trainer.bf16()
        llm.collective_rpc("bench_load_full", args=(str(save_checkpoint(weights, smollm2, tmp_path / "ckpt")), 1))
        assert_engine_exact(follower, weights)
        assert_served(served, greedy(llm, logprobs=1), initial)  # the weights: bit for bit, above
        # The check counts what differs: three elements of one tensor, one ulp off.
        name = "model.layers.1.mlp.down_proj.weight"
        off = weights[name].clone()
        off.view(torch.int16).view(-1)[[0, 7, 1000]] += 1
        (tmp_path / "off").mkdir()
        safetensors.torch.save_file({name: off}, str(tmp_path / "off" / "model.safetensors"))
        assert follower.compare(tmp_path / "off") == {name: {"read": off.numel(), "wrong": 3, "missing": 0}}
        # vLLM labels each request's tokens with the weight version in force.
        from vllm import SamplingParams

        out = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        labels = [s.version for s in out[0].outputs[0].weight_versions]
        assert labels == [f"{pub.version}@{sub.run_id[:12]}"]  # the version, tied to the run

    def test_sharded_version_applies_exactly_in_one_call(self, plain_run, tmp_path: Path) -> None:
        """A version written as two trainer-rank shards (rows split in half) reaches the engine exactly."""
        import time

        from deltasync.format import encode_delta
        from deltasync.protocol.manifest import MANIFEST_KEY, Manifest, ObjectRef, VersionEntry
        from deltasync.publish.diff import Snapshot, diff
        from deltasync.publish.sharded import chunk_rows
        from deltasync.stores import open_store
        from deltasync.tensors import TensorSpec

        _, follower, _, trainer, _ = plain_run
        before = trainer.bf16()  # what the engine holds now (the previous test ended exact)
        url = str(tmp_path / "sharded")
        with Publisher(before, url) as anchor:  # v0: the engine's current weights
            anchor.publish(0, block=True)
        trainer.step()
        after = trainer.bf16()
        specs = tuple(TensorSpec.of(n, t) for n, t in before.items())
        store = open_store(url)
        refs = []
        for rank in range(2):
            rows = {n: chunk_rows(t.shape[0], 2, rank) for n, t in before.items()}
            mine = {n: before[n][a:b] for n, (a, b) in rows.items()}
            changes = diff(Snapshot.capture(mine), {n: after[n][a:b] for n, (a, b) in rows.items()})
            data = encode_delta(changes, version=1, base_version=0, model=specs, rows=rows)
            key = f"deltas/0000000001-shard-r{rank:05d}.safetensors"
            store.put(key, data)
            refs.append(ObjectRef.of(key, [data], rank))
        manifest = Manifest.from_bytes(store.get(MANIFEST_KEY))
        entry = VersionEntry(1, step=1, time=time.time(), nnz=1, delta=tuple(refs))
        store.put(MANIFEST_KEY, manifest.with_version(entry, now=time.time(), lease_s=0.0).to_bytes())
        with follower.subscriber(url, ack=False, start_version=0, run_id=manifest.run_id) as sub:
            calls = follower.rpc_calls
            info = sub.update()
            assert info is not None and info.version == 1 and info.route == ("delta",)
            assert follower.rpc_calls - calls == 1  # both shards' files in one call
        assert_engine_exact(follower, after)

    def test_decoded_here_when_asked(self, plain_run, tmp_path: Path) -> None:
        """``decode_in_worker=False``: the follower decodes (one batched lookup of the bases, one apply)."""
        _, follower, _, trainer, _ = plain_run
        weights = trainer.bf16()  # what the engine holds now (the previous test ended exact)
        url = str(tmp_path / "here")
        with Publisher(weights, url) as pub:
            pub.publish(0, block=True)
            pub.flush()
            trainer.step()
            for name, tensor in trainer.bf16().items():
                weights[name].copy_(tensor)
            pub.publish(1, block=True)
            pub.flush()
        follower.decode_in_worker = False
        try:
            with follower.subscriber(url, ack=False, start_version=0, run_id=latest(url)[0]) as sub:
                calls = follower.rpc_calls
                info = sub.update()
                assert info is not None and info.version == 1 and info.route == ("delta",)
                assert follower.rpc_calls - calls == 2
        finally:
            follower.decode_in_worker = True
        assert_engine_exact(follower, weights)

    def test_worker_refuses_a_delta_onto_other_weights_and_writes_nothing(self, plain_run, tmp_path: Path) -> None:
        """The engine's weights were changed behind deltasync's back: the worker's decode of the next delta
        cannot reproduce the publisher's values, so it refuses the files with a typed error before writing
        anything, and the engine keeps its version and every weight it had."""
        _, follower, _, trainer, _ = plain_run
        weights = trainer.bf16()  # what the engine holds now (the previous test ended exact)
        url = str(tmp_path / "elsewhere")
        pub = Publisher(weights, url)
        pub.publish(0, block=True)
        pub.flush()
        name, other = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"
        held = weights[name].view(torch.int16).reshape(-1).numpy().copy()
        follower._rpc("deltasync_apply", pack({name: {"val": held + 1}}, text=False))  # one ulp, behind its back
        version, other_before = follower.engine_version(), follower.gather(other).clone()
        trainer.step()
        for key, tensor in trainer.bf16().items():
            weights[key].copy_(tensor)
        pub.publish(1, block=True)
        pub.flush()
        pub.close()
        try:
            with follower.subscriber(url, ack=False, start_version=0, run_id=latest(url)[0]) as sub:
                calls = follower.rpc_calls
                with pytest.raises(IntegrityError, match="base version"):
                    sub.update()
                assert follower.rpc_calls - calls == 1 and sub.version == 0  # refused in the worker, as a refusal
            assert follower.engine_version() == version
            assert np.array_equal(follower.gather(name).view(torch.int16).reshape(-1).numpy(), held + 1)
            assert torch.equal(follower.gather(other).view(torch.int16), other_before.view(torch.int16))
        finally:  # put the weight back for the tests after this one
            follower._rpc("deltasync_apply", pack({name: {"val": held}}, text=False))

    def test_bad_deltas_refused_and_outputs_unchanged(self, plain_run, tmp_path: Path) -> None:
        llm, follower, sub, trainer, pub = plain_run
        before, version = greedy(llm), follower.engine_version()
        name = "model.layers.0.self_attn.q_proj.weight"
        held = follower.gather(name).clone()
        # Wrong model: refused at validation.
        other = Header("delta", 99, 98, "0" * 32, 1, {})
        with pytest.raises(FingerprintMismatch):
            follower.validate(other)
        # Out-of-range index, unknown tensor, count mismatch: every rank refuses before any write.
        good_idx = np.array([0, 1], dtype=np.int64)
        vals = np.array([1, 2], dtype=np.int16)
        bad_batches = [
            {name: {"idx": np.array([0, 10**9], dtype=np.int64), "val": vals}},
            {"model.layers.0.self_attn.q_proj.weight": {"idx": good_idx, "val": vals}, "nope.weight": {"idx": good_idx, "val": vals}},
            {name: {"idx": good_idx, "val": np.array([1, 2, 3], dtype=np.int16)}},
            {name: {"idx": good_idx, "val": vals.astype(np.int32)}},
        ]
        for batch in bad_batches:
            with pytest.raises(Exception):
                follower._rpc("deltasync_apply", pack(batch, text=False), 12345)
        # Corrupt bytes in the store: the subscriber refuses the object.
        trainer.step()
        pub.publish(100, block=True)
        pub.flush()
        store = sub.store.inner
        newest = sorted(o.key for o in store.list("deltas/"))[-1]
        data = bytearray(store.get(newest))
        data[-10] ^= 0xFF
        store.put(newest, bytes(data))
        with pytest.raises(IntegrityError):
            sub.update()
        assert torch.equal(follower.gather(name).view(torch.int16), held.view(torch.int16))
        assert follower.engine_version() == version
        assert greedy(llm) == before

    def test_an_anchor_handed_over_as_files_on_this_machine_is_written_exactly(self, plain_run) -> None:
        """The worker reads an anchor the follower dropped (a server's path: no base64 text), checks it and
        writes every element; a dropped file that is not the follower's is answered ``unreadable`` (not a
        refusal of the version) and nothing is written."""
        from deltasync.appliers.vllm.file_drop import FileDrop
        from deltasync.format import encode_anchor

        _, follower, _, trainer, _ = plain_run
        weights = trainer.bf16()
        flipped = {n: (t.view(torch.int16) ^ 1).view(torch.bfloat16) for n, t in weights.items()}
        drop = FileDrop()
        try:
            assert drop.readable(follower._rpc)  # the engine's worker process reads this process's files
            version = follower.engine_version()
            for target in (flipped, weights):
                with drop.files([encode_anchor(target, version=5)]) as refs:
                    assert "header" in refs[0]  # referenced by its header, checked by its tensors' digests
                    (answer,) = follower._rpc("deltasync_apply_files", refs, "anchor", None)
                assert not answer.get("refused") and not answer.get("unreadable") and answer["wrong"] == []
                assert answer["verified"] == sum(t.numel() for t in target.values())
                assert_engine_exact(follower, target)
                if target is flipped:
                    with drop.files([encode_anchor(weights, version=6)]) as refs:
                        Path(refs[0]["path"]).write_bytes(encode_anchor(weights, version=7))  # not the one hashed
                        (answer,) = follower._rpc("deltasync_apply_files", refs, "anchor", None)
                    assert "IntegrityError" in answer["unreadable"] and "written" not in answer
                    assert_engine_exact(follower, flipped)
            assert follower.engine_version() == version  # no version given: the label stays
        finally:
            drop.close()

    def test_a_dropped_follower_and_its_subscriber_are_freed_at_once(self, plain_run, tmp_path: Path) -> None:
        """Neither the follower, its drop directory nor its subscriber refers back to another in a cycle: once
        the user drops them, reference counting frees them (and the bases they prefetched) at once, not when
        the cycle collector next runs."""
        import gc
        import weakref

        from deltasync.appliers.vllm.follower import VLLMFollower

        llm, follower, *_ = plain_run
        gc.disable()
        try:
            other = VLLMFollower(llm, model=follower.model_dir)
            assert other.takes_files("anchor")  # the drop asked the engine through the follower's RPC
            sub = other.subscriber(str(tmp_path / "run"), ack=False)
            assert sub.update() is None  # nothing published there yet
            held = weakref.ref(other), weakref.ref(sub)
            sub.close()
            other.close()
            del other, sub
            assert [ref() for ref in held] == [None, None]
        finally:
            gc.enable()


class TestTensorParallel:
    def test_tp2_qwen3_exact_on_both_ranks(self, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        from deltasync.appliers.vllm.follower import VLLMFollower

        model_dir = tiny_qwen3(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", smollm2)
        store = str(tmp_path_factory.mktemp("vllm-tp2") / "run")
        trainer = Trainer(model_dir, lr=1e-3)
        with engine(model_dir, tp=2, plain=True) as llm, Publisher(trainer.model, store) as pub:
            pub.publish(0, block=True)
            pub.flush()
            run_id, version = latest(store)
            follower = VLLMFollower(llm, model=model_dir)
            assert len(follower.ranks) == 2
            # Column/row/vocab shards are boxes; each rank holds about half of every sharded tensor.
            q = "model.layers.0.self_attn.q_proj.weight"
            assert [r["counts"][q] for r in follower.ranks] == [q_numel := follower.specs[q].numel // 2] * 2
            assert q_numel > 0 and all(r["tables"] == [] for r in follower.ranks)
            with follower.subscriber(store, ack=False, start_version=version, run_id=run_id) as sub:
                for step in range(1, 3):
                    trainer.step()
                    pub.publish(step, block=True)
                    pub.flush()
                    assert sub.update() is not None
                    assert_engine_exact(follower, trainer.bf16())
            assert {r["version"] for r in follower._rpc("deltasync_version")} == {pub.version}


class TestPackedFallback:
    def test_cpu_packed_layers_exact_from_anchor(self, smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
        from deltasync.appliers.vllm.follower import VLLMFollower

        store = str(tmp_path_factory.mktemp("vllm-packed") / "run")
        trainer = Trainer(smollm2, lr=1e-5)
        with Publisher(trainer.model, store) as pub:
            for step in range(2):
                trainer.step()
                pub.publish(step, block=True)
            pub.flush()
            weights = trainer.bf16()
        with engine(smollm2, plain=False) as llm:
            follower = VLLMFollower(llm, model=smollm2)
            (rank,) = follower.ranks
            assert rank["cpu_hooks"] == "stash" and "model.layers.0.self_attn.qkv_proj" in rank["repacked_layers"]
            initial = greedy(llm, logprobs=1)
            with follower.subscriber(store, ack=False) as sub:
                info = sub.update()  # anchor, then a delta: both through the host copies and re-packing
            assert info is not None and info.version == pub.version
            assert_engine_exact(follower, weights)
            patched = greedy(llm, logprobs=1)
            # Stale packed weights would give the initial outputs. That the re-packed bytes the kernels read equal
            # a fresh engine's, bit for bit, is shown by the backend's packed-layout test (the same re-packing).
            assert patched != initial
