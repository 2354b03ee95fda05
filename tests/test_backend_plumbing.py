"""The ``deltasync`` backend's plumbing that needs no engine: refusals as HTTP statuses (both ways), the typed
errors a client gets back, the plugin's conditional CPU hooks, and routes to a version below the newest."""

from __future__ import annotations

import http.server
import importlib.util
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltasync import errors
from deltasync.appliers.vllm.refusals import STATUS, refusal_text, status_of
from deltasync.appliers.vllm.rpc import ServerEngine

HAS_VLLM = importlib.util.find_spec("vllm") is not None


class TestRefusals:
    @pytest.mark.parametrize(("error", "status"), [
        (errors.ConfigError("bad update_info", argument="version"), 400),
        (errors.ObjectNotFound("gone"), 404),
        (errors.FingerprintMismatch("another model"), 409),
        (errors.VersionError("not published"), 409),
        (errors.IntegrityError("flipped byte"), 422),
        (errors.CodecError("bad stream"), 422),
        (errors.StoreError("down"), 502),
        (errors.LayoutMismatch("read back wrong", name="w"), 409),
        (errors.DeltaSyncError("something else"), 500),
    ])
    def test_each_refusal_carries_its_status_through_vllms_wrapping(self, error: Any, status: int) -> None:
        text = refusal_text(error)
        for wrapped in (
            text,
            f"Call to collective_rpc method failed: {text}",
            f"Call to collective_rpc method failed: Worker failed with error '{text}', please check the stack "
            "trace above for the root cause",
        ):
            assert status_of(wrapped) == (status, type(error).__name__, str(error))

    def test_other_errors_keep_vllms_answer(self) -> None:
        assert status_of("Worker failed with error 'CUDA out of memory'") is None

    def test_every_status_is_a_4xx_or_the_stores_502(self) -> None:
        assert {code for _, code in STATUS} <= {400, 404, 409, 422, 502}


class _Refusing(http.server.BaseHTTPRequestHandler):
    answer: tuple[int, dict[str, Any]] = (409, {})

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        status, body = self.answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def refusing() -> Iterator[type[_Refusing]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Refusing.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield _Refusing
    server.shutdown()


class TestClient:
    def test_a_refusal_comes_back_as_its_own_error(self, refusing: Any) -> None:
        refusing.answer = (409, {"error": {"type": "FingerprintMismatch", "message": "another model's run",
                                           "code": 409}})
        with pytest.raises(errors.FingerprintMismatch, match="another model's run"):
            ServerEngine(refusing.url).update_weights({"version": 3})

    def test_anything_else_is_a_plain_error_naming_the_url(self, refusing: Any) -> None:
        refusing.answer = (500, {"error": {"type": "InternalServerError", "message": "boom"}})
        with pytest.raises(errors.DeltaSyncError, match="answered 500") as caught:
            ServerEngine(refusing.url).start_weight_update()
        assert type(caught.value) is errors.DeltaSyncError


class TestRoutesBelowTheNewest:
    def test_a_replica_goes_to_exactly_the_version_asked_ahead_or_back(self, tmp_path: Any) -> None:
        import torch

        from deltasync import Publisher, Subscriber, TorchModuleApplier

        weights = {"w": torch.zeros(64)}
        replica = {"w": torch.zeros(64, dtype=torch.bfloat16)}
        with Publisher(weights, str(tmp_path), anchor_every=100, anchor_ratio=1e9) as pub:
            for step in range(6):
                weights["w"][step] += 1.0
                pub.publish(step, block=True)
            pub.flush()
        with Subscriber(str(tmp_path), TorchModuleApplier(replica), ack=False) as sub:
            info = sub.update(version=2)
            assert info is not None and sub.version == 2 and replica["w"][:3].tolist() == [1.0, 1.0, 1.0]
            assert replica["w"][3] == 0
            assert sub.update(version=2) is None
            info = sub.update(version=1)  # back: again from the anchor at or before it
            assert info is not None and info.route[0] == "anchor" and sub.version == 1
            assert replica["w"][:2].tolist() == [1.0, 1.0] and replica["w"][2] == 0
            with pytest.raises(errors.VersionError, match="not published"):
                sub.update(version=9)
            assert sub.update(version=4) is not None and sub.version == 4 and replica["w"][4] == 1
            assert sub.update() is not None and sub.version == 5


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
class TestPlugin:
    def test_the_cpu_hooks_step_aside_for_engines_of_other_backends(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.config.weight_transfer import WeightTransferConfig

        from deltasync.appliers.vllm import cpu_hooks
        from deltasync.integrations.vllm.plugin import selected

        calls: list[str] = []
        monkeypatch.setattr(cpu_hooks, "_ORIGINAL_DISPATCH", lambda layer, remove: calls.append("vllm"))
        monkeypatch.setattr(cpu_hooks, "_plain_dispatch", lambda layer, remove: calls.append("deltasync"))
        monkeypatch.setattr(cpu_hooks, "_WHEN", selected)
        monkeypatch.setenv(cpu_hooks.PLAIN_WEIGHTS_ENV, "1")
        for backend, expected in (("deltasync", "deltasync"), ("nccl", "vllm")):
            config = VllmConfig(weight_transfer_config=WeightTransferConfig(backend=backend))
            with set_current_vllm_config(config):
                cpu_hooks._dispatch(object(), True)
            assert calls[-1] == expected
        cpu_hooks._dispatch(object(), True)  # no engine loading: vLLM's own
        assert calls[-1] == "vllm"

    def test_the_server_answers_a_refusal_with_its_status(self) -> None:
        from fastapi import FastAPI
        from starlette.testclient import TestClient as HTTP
        from vllm.entrypoints.serve.exception_handling import register

        from deltasync.integrations.vllm import plugin

        plugin._answer_refusals_with_their_status()
        app = FastAPI()
        app.state.args = type("Args", (), {"log_error_stack": False})()
        register.init_exception_handler(app)

        @app.post("/refuse")
        async def refuse() -> None:
            raise Exception("Call to collective_rpc method failed: " + refusal_text(errors.VersionError("no v9")))

        @app.post("/fail")
        async def fail() -> None:
            raise Exception("disk on fire")

        client = HTTP(app, raise_server_exceptions=False)
        answer = client.post("/refuse")
        assert answer.status_code == 409 and answer.json()["error"] == {
            "message": "no v9", "type": "VersionError", "code": 409, "param": None}
        assert client.post("/fail").status_code == 500


def _ranks_in_step(rank: int, world: int, init: str, out: str) -> None:
    """One rank of two, exchanging as a tensor-parallel engine's ranks do (see the test below)."""
    import torch
    import torch.distributed as dist

    from deltasync.appliers.mapping import IndexMap
    from deltasync.appliers.vllm.backend import RankReplica
    from deltasync.protocol.manifest import ObjectRef, Plan, Step

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    outcome: dict[str, Any] = {}
    try:
        weights = {"w": torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)}
        replica = RankReplica(IndexMap.whole(weights), [], dist.new_group(backend="gloo"), verify=0)
        replica.begin()
        if rank == 1:
            replica.fail(errors.StoreError("rank 1 could not reach the store"))
            outcome["first"] = "failed"
        else:
            try:
                replica.exchange("fetched")
            except errors.StoreError as exc:
                outcome["first"] = f"StoreError: {exc}"
        replica.begin()
        ref = ObjectRef(f"deltas/{rank}", 8, "0" * 64)
        try:
            replica.accept_route(Plan(0, 1, (Step(1, "delta", (ref,)),)))
        except errors.VersionError as exc:
            outcome["route"] = str(exc)
        replica.begin()
        outcome["agreed"] = replica.exchange(rank)
    finally:
        (Path(out) / f"rank-{rank}.json").write_text(json.dumps(outcome))
        dist.destroy_process_group()


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
def test_the_ranks_of_an_engine_stop_together_and_take_one_route(tmp_path: Any) -> None:
    """A rank that fails between two exchanges sends its error to the next one, so every rank stops there with
    it; ranks that planned different routes all refuse them; after either, the ranks are still in step."""
    import torch.multiprocessing as mp

    mp.start_processes(_ranks_in_step, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["first"] == "StoreError: rank 1 could not reach the store" and ranks[1]["first"] == "failed"
    assert all("different routes" in r["route"] for r in ranks)
    assert all(r["agreed"] == [0, 1] for r in ranks)


def _expert_parallel_rank(rank: int, world: int, init: str, out: str, store: str) -> None:
    """One rank of an expert-parallel engine: rows ``[4r, 4r+4)`` of ``shared`` and all of ``expert.r``."""
    side = 512  # an expert's bytes outweigh the range reader's merging gap, so skipping one shows
    import torch
    import torch.distributed as dist

    from deltasync.appliers.mapping import IndexMap, Target
    from deltasync.appliers.vllm.backend import RankReplica
    from deltasync.replica.subscriber import Subscriber
    from deltasync.tensors import TensorSpec

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        specs = [TensorSpec("shared", (8, 16), "BF16")] + [TensorSpec(f"expert.{e}", (side, side), "BF16")
                                                               for e in range(world)]
        index = IndexMap(specs)
        rows = torch.nn.Parameter(torch.zeros(4, 16, dtype=torch.bfloat16), requires_grad=False)
        mine = torch.nn.Parameter(torch.zeros(side, side, dtype=torch.bfloat16), requires_grad=False)
        index.targets["shared"].append(Target(rows, "shared", (8, 16), lo=(4 * rank, 0), hi=(4 * rank + 4, 16),
                                              offset=(-4 * rank, 0)))
        index.targets[f"expert.{rank}"].append(Target(mine, f"expert.{rank}", (side, side), lo=(0, 0),
                                                      hi=(side, side), offset=(0, 0), flat=(0, side * side, 0)))
        replica = RankReplica(index, specs, dist.new_group(backend="gloo"), verify=8)
        held = frozenset({"shared", f"expert.{rank}"})
        with Subscriber(store, replica, replica_id=f"rank{rank}", ack=False, only=held) as subscriber:
            replica.begin()
            info = subscriber.update()
        assert info is not None
        torch.save({"rows": rows.data, "expert": mine.data, "route": list(info.route), "bytes": info.bytes},
                   Path(out) / f"rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_expert_parallel_ranks_read_only_their_experts_and_end_exact(tmp_path: Any) -> None:
    """Each rank of an expert-parallel engine range-reads the tensors it holds (its experts, the shared tensor it
    holds a slice of) from every version of the route, exchanges the bases of the shared tensor's changed
    elements, and ends bit for bit on the published weights, having read well under each object's size."""
    import torch
    import torch.multiprocessing as mp

    from deltasync import Publisher
    from deltasync.protocol.keys import MANIFEST_KEY
    from deltasync.protocol.manifest import Manifest, plan_route
    from deltasync.stores import open_store

    gen = torch.Generator().manual_seed(0)
    weights = {"shared": torch.randn(8, 16, generator=gen).bfloat16(),
               **{f"expert.{e}": torch.randn(512, 512, generator=gen).bfloat16() for e in range(2)}}
    store = str(tmp_path / "run")
    with Publisher(weights, store) as publisher:
        for step in range(3):
            if step:
                for tensor in weights.values():  # a few elements of every tensor move
                    flat = tensor.view(-1)
                    flat[torch.randperm(flat.numel(), generator=gen)[:9]] += 1.0
            publisher.publish(step, block=True)
        publisher.flush()
    manifest = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY))
    assert [e.version for e in manifest.versions if e.delta] == [1, 2]
    mp.start_processes(_expert_parallel_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path), store),
                       nprocs=2, start_method="spawn", join=True)
    plan = plan_route(manifest, None)
    assert plan is not None and [s.label for s in plan.steps] == ["anchor", "span"]  # a span is read by range too
    whole = plan.nbytes
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank-{rank}.pt")
        assert got["route"] == ["anchor", "span"]
        assert torch.equal(got["rows"].view(torch.int16), weights["shared"][4 * rank:4 * rank + 4].view(torch.int16))
        assert torch.equal(got["expert"].view(torch.int16), weights[f"expert.{rank}"].view(torch.int16))
        assert got["bytes"] < 0.6 * whole, (rank, got["bytes"], whole)  # its expert, not the other
