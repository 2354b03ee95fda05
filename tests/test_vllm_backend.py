"""The ``deltasync`` weight-transfer backend in real vLLM engines (the CPU build), driven as vLLM drives backends.

- A server launched with ``--weight-transfer-config '{"backend": "deltasync"}'`` and no other flag of
  ours, updated through vLLM's HTTP round trip by ``deltasync follow``; its ``/weight_checker`` checksums
  and its served tokens equal those of a fresh server loaded from the trainer's weights.
- Hostile ``init_info`` / ``update_info`` and a damaged object through HTTP: a 4xx with the message, the
  weights untouched, the server still serving.
- In-process ``LLM(weight_transfer_config=...)`` engines (TP=1, TP=2, the tiny MoE, the tiny MoE expert
  parallel with its ranks reading only their share, a LoRA run's merged weights), each compared bit for bit
  with a fresh engine loaded from the trainer's weights, in the runtime layout the kernels read.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import Publisher
from deltasync.appliers.vllm.rpc import ServerEngine, parse_version_label, version_label
from deltasync.appliers.vllm.server_follower import ServerFollower
from deltasync.control import rollback
from deltasync.errors import IntegrityError, VersionError
from deltasync.protocol.keys import MANIFEST_KEY
from deltasync.protocol.manifest import Manifest
from deltasync.stores import open_store

from .vllm_helpers import (
    PROMPTS,
    VLLM_TESTS,
    Trainer,
    assert_backend_exact,
    assert_checksums_hold,
    engine,
    runtime_digests,
    save_checkpoint,
    tiny_qwen3,
    tiny_qwen3_moe,
)

pytestmark = VLLM_TESTS
BACKEND = {"backend": "deltasync"}


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from deltasync.demo.models import smollm2_checkpoint

    return smollm2_checkpoint()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def backend_server(model: Path, log: Path) -> Iterator[str]:
    """``vllm serve MODEL --weight-transfer-config '{"backend": "deltasync"}'`` (dev mode for the round trip's
    endpoints); nothing else of deltasync's. Yields the server URL."""
    from examples.grpo_delta_sync import free_port, start_server

    with open(log, "ab") as out, start_server(model, free_port(), log=out, backend=True) as url:
        yield url


def _post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _complete(url: str) -> list[int]:
    """Greedy tokens the server generates for the test prompts (its OpenAI-compatible endpoint)."""
    status, body = _post(f"{url}/v1/completions", {"model": _served_model(url), "prompt": PROMPTS, "max_tokens": 8,
                                                     "temperature": 0.0, "return_token_ids": True})
    assert status == 200, body
    return [c.get("token_ids") or c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def _served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as response:
        return json.loads(response.read())["data"][0]["id"]


def _checksums(url: str) -> dict[str, str]:
    status, body = _post(f"{url}/weight_checker", {"action": "checksum"})
    assert status == 200, body
    return body["checksums"]


@pytest.fixture(scope="module")
def run(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One server with the backend alone, a trainer and its publisher, shared by the server tests."""
    root = tmp_path_factory.mktemp("backend-server")
    store = str(root / "run")
    trainer = Trainer(smollm2, lr=1e-5)
    with backend_server(smollm2, root / "server.log") as url, Publisher(trainer.model, store) as publisher:
        yield {"url": url, "store": store, "trainer": trainer, "publisher": publisher, "root": root,
               "model": smollm2}


class TestServer:
    """A real server with the backend alone, updated through vLLM's standard endpoints."""

    def test_a_run_followed_through_the_round_trip_equals_a_fresh_server(self, run: dict[str, Any]) -> None:
        url, store, trainer, publisher = run["url"], run["store"], run["trainer"], run["publisher"]
        follower = ServerFollower(url, store)
        publisher.publish(0, block=True)
        publisher.flush()
        assert follower.update() is not None and follower.served == 0  # the anchor
        held = {}
        for step in range(1, 4):
            trainer.step()
            publisher.publish(step, block=True)
            publisher.flush()
            update = follower.update()
            assert update is not None and update.version == publisher.version
            run_id = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY)).run_id
            assert parse_version_label(ServerEngine(url).weight_version(), run_id) == publisher.version
            held[update.version] = _checksums(url)
        assert follower.update() is None  # nothing newer
        newest = follower.served
        # Back to an exact version, bit for bit, then the newest up to one, over the standard endpoints.
        assert follower.update(version=newest - 2) is not None and _checksums(url) == held[newest - 2]
        assert _post(f"{url}/start_weight_update", {})[0] == 200
        assert _post(f"{url}/update_weights", {"update_info": {"at_most": newest - 1}})[0] == 200
        label = version_label(newest - 1, run_id)
        assert _post(f"{url}/finish_weight_update", {"weight_version": label})[0] == 200
        assert _checksums(url) == held[newest - 1] and ServerEngine(url).weight_version() == label
        follower.served = newest - 1  # moved by the raw requests above, not by the follower
        assert follower.update(version=newest) is not None and _checksums(url) == held[newest]
        served, checksums = _complete(url), _checksums(url)
        reference = save_checkpoint(trainer.bf16(), run["model"], run["root"] / "reference")
        with backend_server(reference, run["root"] / "reference.log") as fresh:
            assert _checksums(fresh) == checksums  # what /weight_checker sees, bit for bit
            assert _complete(fresh) == served
        # A rollback of the live run: the server lands on the restored version's weights by an ordinary delta.
        done = rollback(publisher, to=newest - 2)
        assert follower.update() is not None and follower.served == done.version
        assert _checksums(url) == held[newest - 2]

    def test_hostile_requests_get_a_4xx_and_change_nothing(self, run: dict[str, Any], tmp_path: Path) -> None:
        url, store, trainer, publisher = run["url"], run["store"], run["trainer"], run["publisher"]
        ServerFollower(url, store).update()  # whatever the order of the tests: at the newest version
        before, served = _checksums(url), _complete(url)
        for update_info, status, kind in (
            ({"version": "newest"}, 400, "ConfigError"),
            ({"versoin": 3}, 400, "ConfigError"),
            ({"version": -1}, 400, "ConfigError"),
            ({"version": 1, "at_most": 2}, 400, "ConfigError"),
            ({"version": (publisher.version or 0) + 50}, 409, "VersionError"),
        ):
            assert _post(f"{url}/start_weight_update", {})[0] == 200
            code, body = _post(f"{url}/update_weights", {"update_info": update_info})
            assert code == status and body["error"]["type"] == kind, (update_info, code, body)
            assert body["error"]["message"] and "deltasync refused" not in body["error"]["message"]
        # Another model's run, at init: refused, and the engine keeps following its own run.
        other = tmp_path / "other"
        with Publisher({"w": torch.zeros(8)}, str(other)) as stranger:
            stranger.publish(0, block=True)
        code, body = _post(f"{url}/init_weight_transfer_engine", {"init_info": {"store": str(other)}})
        assert code == 409 and body["error"]["type"] == "FingerprintMismatch", body
        code, body = _post(f"{url}/init_weight_transfer_engine", {"init_info": {"stroe": store}})
        assert code == 400 and "unknown keys" in body["error"]["message"], body
        # What TRL's plain GRPOTrainer sends to set up NCCL: one line on what to do instead.
        nccl = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
        code, body = _post(f"{url}/init_weight_transfer_engine", {"init_info": nccl})
        message = body["error"]["message"]
        assert code == 400 and "not NCCL" in message and "DeltaSyncTransfer" in message, body
        # A damaged delta: refused before any write.
        follower = ServerFollower(url, store)
        follower.initialise()
        trainer.step()
        publisher.publish(99, block=True)
        publisher.flush()
        manifest = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY))
        newest = manifest.entry(manifest.latest)
        for ref in newest.delta + tuple(o for span in newest.spans for o in span.objects):  # whichever route
            path = Path(store) / ref.key
            data = bytearray(path.read_bytes())
            data[-3] ^= 0xFF
            os.chmod(path, 0o644)
            path.write_bytes(bytes(data))
        with pytest.raises(IntegrityError):
            follower.update()
        assert _checksums(url) == before and _complete(url) == served  # untouched, still serving
        client = ServerEngine(url)  # the client deltasync's own processes use: the refusal as its own error
        client.start_weight_update()
        with pytest.raises(VersionError, match="not published"):
            client.update_weights({"version": (publisher.version or 0) + 50})


    def test_vllms_own_trainer_api_drives_the_backend(self, run: dict[str, Any], tmp_path: Path) -> None:
        """vLLM's ``WeightTransferTrainerFactory`` builds the ``deltasync`` trainer engine: ``send_weights()``
        publishes the source as the next version and has the server apply it."""
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from deltasync.integrations.vllm.trainer import DeltaSyncTrainerEngine, DeltaSyncTrainerInitInfo

        url, trainer = run["url"], run["trainer"]
        store = str(tmp_path / "trainer-api")
        engine = WeightTransferTrainerFactory.trainer_init(
            DeltaSyncTrainerInitInfo(store=store, rank=0), client=ServerEngine(url), source=ModuleSource(trainer.model)
        )
        assert isinstance(engine, DeltaSyncTrainerEngine)
        try:
            for step in range(2):
                if step:
                    trainer.step()
                engine.send_weights()
                manifest = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY))
                assert parse_version_label(ServerEngine(url).weight_version(), manifest.run_id) == step
            assert [e.version for e in manifest.versions] == [0, 1] and manifest.versions[0].anchor
            assert_checksums_hold(_checksums(url), trainer.bf16())
        finally:
            engine.shutdown()


def _exact(llm: Any, reference_dir: Path, **engine_args: Any) -> None:
    """The engine's runtime weights (packed layouts as the kernels read them) equal a fresh engine's loaded
    from ``reference_dir``, with the same backend and flags, bit for bit."""
    ours = llm.collective_rpc(runtime_digests)
    with engine(reference_dir, extension=False, weight_transfer_config=BACKEND, **engine_args) as fresh:
        theirs = fresh.collective_rpc(runtime_digests)
    assert ours == theirs


def _follow(llm: Any, store: str) -> None:
    """One round trip to the newest version, as vLLM's ``LLM`` offers it."""
    manifest = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY))
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": manifest.latest}})
    llm.finish_weight_update(f"{manifest.latest}@{manifest.run_id[:12]}")


def _train_and_follow(llm: Any, trainer: Any, publisher: Any, store: str, steps: int = 3) -> None:
    """Point the engine at ``store``; then per training step one version published and followed."""
    llm.init_weight_transfer_engine({"init_info": {"store": store}})
    for step in range(steps):
        if step:
            trainer.step()
        publisher.publish(step, block=True)
        publisher.flush()
        _follow(llm, store)
        assert llm.get_weight_version().startswith(f"{publisher.version}@")


def test_in_process_engine_follows_exactly_in_the_kernels_packed_layout(smollm2: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU kernels pack Linear weights; the backend patches a host copy and repacks what it touched: the
    packed bytes the kernels read equal a fresh engine's loaded from the trainer's weights."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    store = str(tmp_path / "run")
    trainer = Trainer(smollm2, lr=1e-5)
    with engine(smollm2, plain=False, extension=False, weight_transfer_config=BACKEND) as llm, \
            Publisher(trainer.model, store) as publisher:
        _train_and_follow(llm, trainer, publisher, store)
        _exact(llm, save_checkpoint(trainer.bf16(), smollm2, tmp_path / "reference"), plain=False)


def test_tensor_parallel_ranks_exchange_bases_and_end_exact(smollm2: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    model = tiny_qwen3(tmp_path / "qwen3", smollm2)
    store = str(tmp_path / "run")
    trainer = Trainer(model, lr=1e-3)
    with engine(model, tp=2, extension=False, weight_transfer_config=BACKEND) as llm, \
            Publisher(trainer.model, store) as publisher:
        _train_and_follow(llm, trainer, publisher, store)
        assert_backend_exact(llm, trainer.bf16())


def test_the_tiny_moe_follows_exactly(smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    model = tiny_qwen3_moe(tmp_path / "moe", smollm2)
    store = str(tmp_path / "run")
    trainer = Trainer(model, lr=1e-3)
    with engine(model, plain=False, extension=False, weight_transfer_config=BACKEND) as llm, \
            Publisher(trainer.model, store) as publisher:
        _train_and_follow(llm, trainer, publisher, store)
        assert_backend_exact(llm, trainer.bf16())  # read back through the probed expert layout


def _reads(worker: Any) -> list[str] | None:
    """The tensors this rank's backend reads of each version (run through ``collective_rpc``)."""
    reads = worker.weight_transfer_engine.reads
    return None if reads is None else sorted(reads)


def test_expert_parallel_ranks_read_only_their_experts(smollm2: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """EP=2: each rank reads the tensors it holds (half the experts, its slices of the rest) and the engine ends
    exact; that range reads then move less than whole objects is test_backend_plumbing's. vLLM 0.32's CPU build
    loads expert-parallel engines but cannot run their forward pass, so this engine never generates."""
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    model = tiny_qwen3_moe(tmp_path / "moe", smollm2)
    store = str(tmp_path / "run")
    trainer = Trainer(model, lr=1e-3)
    with engine(model, tp=2, plain=True, enable_expert_parallel=True, extension=False,
                weight_transfer_config=BACKEND) as llm, Publisher(trainer.model, store) as publisher:
        _train_and_follow(llm, trainer, publisher, store, steps=2)
        assert_backend_exact(llm, trainer.bf16())
        reads = [set(r or ()) for r in llm.collective_rpc(_reads)]
    experts = [{n for n in r if ".mlp.experts." in n} for r in reads]
    assert experts[0] and experts[1] and experts[0].isdisjoint(experts[1])  # each rank reads its experts alone
    assert reads[0] | reads[1] == set(trainer.bf16())


def test_a_lora_runs_merged_versions_follow_exactly(smollm2: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A PEFT LoRA run publishes its exact merged weights; the engine serves them like any version."""
    import peft

    from deltasync.publish.peft import MergedWeights

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    store = str(tmp_path / "run")
    trainer = Trainer(smollm2, lr=1e-3)
    trainer.model = peft.get_peft_model(trainer.model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trainer.opt = torch.optim.AdamW([p for p in trainer.model.parameters() if p.requires_grad], lr=1e-3)
    merged = MergedWeights(trainer.model)
    with engine(smollm2, extension=False, weight_transfer_config=BACKEND) as llm, Publisher(merged, store) as pub:
        _train_and_follow(llm, trainer, pub, store)
        assert_backend_exact(llm, {n: t.to(torch.bfloat16) for n, t in merged.items()})
